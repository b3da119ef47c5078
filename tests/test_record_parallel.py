"""The recorder with N games in parallel (a local Ray fleet) writes the episodes of the one-game order."""

import json
import os

import pytest
from conftest import require_module

from experiments.configs.record import get_config
from experiments.record import run
from histeve_jax.data.records import read_shard, shard_paths

pytestmark = pytest.mark.game
os.environ.setdefault("RAY_DEDUP_LOGS", "0")


def test_record_on_two_games_writes_episodes_in_task_then_seed_order(tmp_path):
    require_module("ray", "pip install ray")
    cfg = get_config("tiny")
    # craft_planks takes ~4x the steps of place_dirt, so on two games the place_dirt episodes finish first
    cfg.tasks = ("craft_planks", "place_dirt")
    cfg.episodes = 2
    cfg.seed = 7
    cfg.obs_size = (32, 32)
    cfg.instances = 2
    cfg.progress_bar = False
    summary = run(cfg, str(tmp_path))
    assert {n: (s["successes"], s["kept"], s["interrupted"]) for n, s in summary["tasks"].items()} == {
        "craft_planks": (2, 2, 0), "place_dirt": (2, 2, 0)}
    assert json.loads((tmp_path / "summary.json").read_text())["tasks"] == summary["tasks"]
    episodes: dict[str, list] = {}
    for p in shard_paths(tmp_path / "records"):
        for r in read_shard(p):
            episodes.setdefault(r.episode_id, []).append(r)
    order = [(eps[0].task_id, eps[0].metadata["seed"]) for eps in episodes.values()]
    assert order == [("craft_planks", 7), ("craft_planks", 8), ("place_dirt", 7), ("place_dirt", 8)]
    for eps in episodes.values():
        assert [r.step for r in eps] == list(range(len(eps)))
        assert eps[-1].done and eps[-1].completed == 1 and all(r.kind == "demo" for r in eps)
