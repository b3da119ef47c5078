"""The recorder writes expert episodes from the real game in the project's record format."""

import json

import numpy as np
import pytest

from experiments.configs.record import get_config
from experiments.record import run
from histeve_jax.data.records import BINARY_KEYS, decode_frame, read_shard, shard_paths

pytestmark = pytest.mark.game  # skips without the game, fails under CI=true (conftest)


def test_record_writes_episodes_with_regime_cursor_events_and_subtasks(tmp_path):
    cfg = get_config("tiny")
    cfg.tasks = ("craft_planks", "place_dirt")
    cfg.episodes = 1
    cfg.task_episodes = "place_dirt=2"
    cfg.obs_size = (32, 48)
    cfg.progress_bar = False
    summary = run(cfg, str(tmp_path))
    assert summary["tasks"]["craft_planks"]["successes"] == 1
    assert summary["tasks"]["place_dirt"]["episodes"] == 2
    written = json.loads((tmp_path / "summary.json").read_text())
    assert written["tasks"].keys() == {"craft_planks", "place_dirt"}
    assert (tmp_path / "config.json").exists()
    records = [r for p in shard_paths(tmp_path / "records") for r in read_shard(p)]
    episodes = {}
    for r in records:
        episodes.setdefault(r.episode_id, []).append(r)
    assert len(episodes) == 3
    assert sorted(e[0].task_id for e in episodes.values()) == ["craft_planks", "place_dirt", "place_dirt"]
    for eps in episodes.values():
        assert [r.step for r in eps] == list(range(len(eps)))
        assert eps[-1].done and not any(r.done for r in eps[:-1])
        assert eps[-1].completed == 1 and eps[0].completed == 0
        assert all(r.kind == "demo" and r.instruction for r in eps)
        assert set(eps[0].action) == set(BINARY_KEYS) | {"camera"}
        assert decode_frame(eps[0].frame).shape == (32, 48, 3)
    craft = next(e for e in episodes.values() if e[0].task_id == "craft_planks")
    gui = [r for r in craft if r.is_gui_open]
    assert gui and all(r.cursor is not None for r in gui)
    assert all(r.cursor is None for r in craft if not r.is_gui_open)
    assert craft[0].action["inventory"] == 1 and not craft[0].is_gui_open
    subtasks = [r.subtask for r in craft]
    boundaries = [s for i, s in enumerate(subtasks) if i == 0 or s != subtasks[i - 1]]
    assert boundaries[0] == "open_inventory" and "take_output" in boundaries
    assert craft[-1].events["craft_item"] == {"default:wood": 4}
    # the cursor moves as the camera actions say while the GUI is open
    moved = [(a, b) for a, b in zip(gui, gui[1:], strict=False) if any(a.action["camera"])]
    assert moved and any(np.abs(np.subtract(b.cursor, a.cursor)).sum() > 0 for a, b in moved)


@pytest.mark.parametrize("bad, message", [("mine_log=4", "'mine_log' is not one of the recorded tasks"),
                                          ("place_dirt:4", "'place_dirt:4' is not task=episodes")])
def test_per_task_episodes_name_recorded_tasks(tmp_path, bad, message):
    cfg = get_config("tiny")
    cfg.task_episodes = bad
    with pytest.raises(ValueError, match=message):
        run(cfg, str(tmp_path))
    assert not (tmp_path / "records").exists()  # refused before any game or shard


def test_task_files_that_vary_a_shipped_task_add_up_under_its_name(tmp_path):
    import yaml

    from histeve_jax.envs.tasks import TASK_DIR

    spec = yaml.safe_load((TASK_DIR / "place_dirt.yaml").read_text())  # a copy that starts turned
    spec["init"] = {**spec["init"], "yaw": 90.0}
    path = tmp_path / "place_dirt_turned.yaml"
    path.write_text(yaml.safe_dump(spec))
    cfg = get_config("tiny")
    cfg.tasks = ("place_dirt", str(path), "place_dirt[yaw=180,pos=2]")  # and a variant of its start
    cfg.episodes = 1
    cfg.task_episodes = f"{path}=2,place_dirt[yaw=180,pos=2]=1"
    cfg.obs_size = (32, 48)
    cfg.progress_bar = False
    summary = run(cfg, str(tmp_path / "run"))
    assert summary["tasks"].keys() == {"place_dirt"}
    assert summary["tasks"]["place_dirt"]["episodes"] == 4
    assert summary["tasks"]["place_dirt"]["successes"] == 4
    assert summary["tasks"]["place_dirt"]["success_rate"] == 1.0
    # the entries of one name go on from each other's seeds: no start is played twice
    records = [r for p in shard_paths(tmp_path / "run" / "records") for r in read_shard(p)]
    firsts = [r for r in records if r.step == 0]
    assert [r.episode_id.split("-")[1] for r in firsts] == ["0", "1", "2", "3"]
