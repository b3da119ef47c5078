"""A trained run plays: it loads from its workdir, sees frames in exactly the training layout, is served in
batches, and the evaluation reports rates with Wilson intervals beside the expert on the same seeds."""

from __future__ import annotations

import json
import os

import jax
import numpy as np
import pytest

from experiments.configs import imitation
from histeve_jax.data import records as records_lib
from histeve_jax.data import synthetic
from histeve_jax.eval.evaluate import EvalSpec, check, evaluate, format_table, wilson_interval
from histeve_jax.eval.policy_agent import FrameHistory, PolicyServer, load_run
from histeve_jax.policy import decode_actions
from histeve_jax.train.loop import train
from histeve_jax.train.specs import RunSpec


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A tiny imitation run (4 steps on synthetic demos): its workdir, as the main job leaves one."""
    root = tmp_path_factory.mktemp("run")
    synthetic.write_demo_dataset(root / "train", episodes=4, length=8, seed=0)
    c = imitation.get_config("tiny")
    c.data.train_dirs = str(root / "train")
    c.data.batch_size = 2
    c.num_train_steps = 4
    c.optimizer.warmup_steps = 1
    c.eval_every = 0
    c.checkpoint_every = 4
    c.progress_bar = False
    c.async_checkpoint = False
    train(RunSpec.from_config(c, str(root / "work")))
    return str(root / "work")


def test_wilson_interval_matches_hand_values():
    # p = 0.5, n = 10: 0.5 +- 1.96 * sqrt(0.25/10 + 1.96^2/400) / (1 + 1.96^2/10)
    lo, hi = wilson_interval(5, 10)
    assert lo == pytest.approx(0.2366, abs=1e-4) and hi == pytest.approx(0.7634, abs=1e-4)
    lo, hi = wilson_interval(0, 10)
    assert lo == 0.0 and hi == pytest.approx(0.2775, abs=1e-4)
    assert wilson_interval(10, 10)[1] == pytest.approx(1.0) and wilson_interval(0, 0) == (0.0, 1.0)


def test_frame_history_is_the_training_window(tmp_path):
    """The frames the agent gives the policy at step s are the pipeline's window of record s (history
    frames `stride` steps back, clamped to the first)."""
    from histeve_jax.data.pipeline import WindowSource, open_shards

    synthetic.write_demo_dataset(tmp_path, episodes=1, length=14, seed=3, frame_format="png")
    source = WindowSource(open_shards(str(tmp_path)), history=2, stride=3)
    hist = FrameHistory(history=2, stride=3)
    for j in range(len(source)):
        window = source[j]
        frame = records_lib.decode_frame(window["frames"][-1])  # the current one
        got = hist.push(frame)
        want = [records_lib.decode_frame(f) for f in window["frames"]]
        assert len(got) == len(want) == 3
        for a, b in zip(got, want, strict=True):
            np.testing.assert_array_equal(a, b)


def test_frame_history_within_a_regime_is_the_training_window(tmp_path):
    """``data.history_in_regime``: a window's history frames come only from the current GUI-open (or closed)
    run, the steps before its first repeating that one, in the pipeline's windows and the agent's alike;
    off, the same records give windows across the switch."""
    import dataclasses

    from histeve_jax.data.pipeline import WindowSource, open_shards

    synthetic.write_demo_dataset(tmp_path / "src", episodes=1, length=14, seed=3, frame_format="png")
    src = WindowSource(open_shards(str(tmp_path / "src")))
    gui = [False] * 5 + [True] * 6 + [False] * 3  # opens at step 5, closes at step 11
    episode = [dataclasses.replace(records_lib.deserialize(records_lib.serialize(src[j]["record"] | {
        "frame": src[j]["frames"][-1]})), is_gui_open=g) for j, g in enumerate(gui)]
    records_lib.write_episodes(tmp_path / "eps", [episode])
    frames = [records_lib.decode_frame(r.frame) for r in episode]
    for in_regime in (False, True):
        source = WindowSource(open_shards(str(tmp_path / "eps")), history=2, stride=3, in_regime=in_regime)
        hist = FrameHistory(history=2, stride=3, in_regime=in_regime)
        for j in range(len(source)):
            window = [records_lib.decode_frame(f) for f in source[j]["frames"]]
            got = hist.push(frames[j], int(gui[j]))
            first = min(b for b in range(j + 1) if all(g == gui[j] for g in gui[b:j + 1])) if in_regime else 0
            want = [frames[max(j - k * 3, first)] for k in (2, 1, 0)]
            for a, b, c in zip(got, window, want, strict=True):
                np.testing.assert_array_equal(a, c)
                np.testing.assert_array_equal(b, c)
    with pytest.raises(ValueError, match="regime"):
        FrameHistory(history=1, stride=1, in_regime=True).push(frames[0])


def test_a_run_loads_from_its_workdir_and_pads_without_changing_actions(run_dir):
    loaded = load_run(run_dir)
    stride = imitation.get_config("tiny").data.stride
    assert loaded.step == 4 and loaded.history == 1 and loaded.stride == stride
    rng = np.random.default_rng(0)
    obs = [([rng.integers(0, 256, (56, 56, 3), dtype=np.uint8) for _ in range(2)], text)
           for text in ("place a dirt block on the ground", "open the inventory and craft wooden planks")]
    alone = loaded.sample(obs, [0, 1], jax.random.key(0), greedy=True)
    padded = loaded.sample(obs, [0, 1], jax.random.key(0), greedy=True, batch=4)  # rows and length padded
    assert [a.tokens for a in alone] == [a.tokens for a in padded]
    assert [int(a.regime) for a in alone] == [0, 1]


def test_a_jpeg_run_acts_on_what_its_training_frames_were(run_dir):
    """The run's frames were stored as JPEG (``data.frame_format``): a live frame reaches the policy as its
    JPEG round trip, the pixels a training window decodes; the inputs equal those of the decoded frame."""
    import dataclasses

    loaded = load_run(run_dir)
    assert (loaded.frame_format, loaded.jpeg_quality) == ("jpeg", 95)
    rng = np.random.default_rng(1)
    raw = rng.integers(0, 256, (56, 56, 3), dtype=np.uint8)
    stored = records_lib.decode_frame(records_lib.encode_frame(raw, "jpeg", 95))
    assert np.abs(stored.astype(int) - raw).mean() > 1.0  # the codec is lossy on this frame
    np.testing.assert_array_equal(loaded.through_codec(raw), stored)
    text = "open the inventory and craft wooden planks"
    live = loaded.inputs([([raw, raw], text)])["pixel_values"]
    png = dataclasses.replace(loaded, frame_format="png")  # a lossless run: frames go in as they are
    np.testing.assert_array_equal(live, png.inputs([([stored, stored], text)])["pixel_values"])
    assert not np.array_equal(png.inputs([([raw, raw], text)])["pixel_values"], live)


def test_bad_runs_are_one_clear_error(run_dir, tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_run(str(tmp_path))
    empty = tmp_path / "no_ckpt"
    empty.mkdir()
    (empty / "config.json").write_text(open(os.path.join(run_dir, "config.json")).read())
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        load_run(str(empty))
    # A checkpoint of another shape: the config now describes a policy with another action vocabulary.
    other = tmp_path / "other"
    other.mkdir()
    os.symlink(os.path.join(run_dir, "checkpoints"), other / "checkpoints", target_is_directory=True)
    cfg = json.load(open(os.path.join(run_dir, "config.json")))
    cfg["data"]["codebook"] = "openha"
    (other / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="does not match"):
        load_run(str(other))
    with pytest.raises(ValueError, match="no_such_task"):
        check(EvalSpec(tasks=("no_such_task",), episodes=1, seed=0, agents=("expert",)))
    # A task file the experts do not cover: named before any game starts.
    from histeve_jax.envs import tasks as tasks_lib

    src = open(os.path.join(os.path.dirname(tasks_lib.__file__), "place_dirt.yaml")).read()
    (tmp_path / "place_two.yaml").write_text(src.replace("name: place_dirt", "name: place_two"))
    with pytest.raises(ValueError, match="no scripted expert"):
        check(EvalSpec(tasks=(str(tmp_path / "place_two.yaml"),), episodes=1, seed=0, agents=("expert",)))
    # A task and its variant: results go by task name, so one evaluation takes one entry per name.
    check(EvalSpec(tasks=("mine_log[against=1]", "place_dirt"), episodes=1, seed=0, agents=("expert",)))
    with pytest.raises(ValueError, match=r"\['mine_log'\] given more than once"):
        check(EvalSpec(tasks=("mine_log", "mine_log[against=1]"), episodes=1, seed=0, agents=("expert",)))
    with pytest.raises(ValueError, match="needs policy="):
        EvalSpec(tasks=("place_dirt",), episodes=1, seed=0, agents=("policy",))
    with pytest.raises(ValueError, match="top_p"):
        EvalSpec(tasks=("place_dirt",), episodes=1, seed=0, agents=("expert",), top_p=0.0)
    with pytest.raises(ValueError, match="obs_size"):
        EvalSpec(tasks=("place_dirt",), episodes=1, seed=0, agents=("expert",), obs_size=(112,))
    with pytest.raises(ValueError, match="after_success"):
        EvalSpec(tasks=("place_dirt",), episodes=1, seed=0, agents=("expert",), after_success=-1)


def test_the_policy_server_batches_concurrent_requests(run_dir):
    import asyncio

    server = PolicyServer(run_dir, max_batch=2, max_wait_s=0.5, greedy=True)
    rng = np.random.default_rng(1)
    frames = [rng.integers(0, 256, (56, 56, 3), dtype=np.uint8) for _ in range(2)]

    async def two():
        return await asyncio.gather(server.act(frames, "place a dirt block on the ground", 0),
                                    server.act(frames, "place a dirt block on the ground", 1))

    a, b = asyncio.run(two())
    assert server.stats() == {"calls": 1, "mean_batch": 2.0}
    loaded = server.loaded
    want = loaded.sample([(frames, "place a dirt block on the ground")] * 2, [0, 1], jax.random.key(0),
                         greedy=True)
    assert a["tokens"] == want[0].tokens and b["tokens"] == want[1].tokens
    assert a["regime"] == 0 and b["regime"] == 1
    # A vanishing nucleus keeps only the most likely token: the sampling server acts greedily.
    nucleus = PolicyServer(run_dir, max_batch=2, max_wait_s=0.5, top_p=1e-6, seed=3)

    async def two_sampled():
        return await asyncio.gather(nucleus.act(frames, "place a dirt block on the ground", 0),
                                    nucleus.act(frames, "place a dirt block on the ground", 1))

    c, d = asyncio.run(two_sampled())
    assert c["tokens"] == a["tokens"] and d["tokens"] == b["tokens"]


@pytest.mark.game
def test_the_policy_plays_in_the_game_recorded_beside_the_expert(run_dir, tmp_path):
    """A short closed-loop evaluation on a real local Ray with a real game: the policy's episodes are
    recorded with their action tokens and log-probs, the expert's on the same seed, a report per episode."""
    spec = EvalSpec(tasks=("place_dirt",), episodes=1, seed=1000, agents=("policy", "expert"), policy=run_dir,
                    max_steps=15, instances=1, out_dir=str(tmp_path / "eval"), progress_bar=False)
    summary = evaluate(spec)
    pol, exp = summary["results"]["policy"]["place_dirt"], summary["results"]["expert"]["place_dirt"]
    assert pol["episodes"] == 1 and exp["episodes"] == 1 and pol["seeds"] == exp["seeds"] == [1000]
    assert exp["successes"] == 1 and exp["ci95"][1] == pytest.approx(1.0)
    recs = [r for p in records_lib.shard_paths(tmp_path / "eval" / "records" / "policy")
            for r in records_lib.read_shard(p)]
    assert recs and all(r.kind == "eval" for r in recs) and recs[-1].done
    # No obs_size given: the games render at the run's training frame size (112x196), not a default.
    assert summary["obs_size"] == [112, 196] == list(load_run(run_dir).config.image_size)
    assert records_lib.decode_frame(recs[0].frame).shape[:2] == (112, 196)
    config = load_run(run_dir).config
    for r in recs[:-1]:  # the recorded action is what the recorded tokens decode to, in the step's regime
        toks, lps = r.metadata["action_tokens"], r.metadata["action_logprobs"]
        assert len(toks) == len(lps) >= 2 and all(lp <= 0 for lp in lps)
        (action, regime), = decode_actions(config, np.asarray([toks]))
        assert int(regime) == int(r.is_gui_open)
        assert {k: int(v) for k, v in action.items() if k != "camera"} == \
            {k: int(v) for k, v in r.action.items() if k != "camera"}
        np.testing.assert_allclose(action["camera"], r.action["camera"], atol=1e-5)
    assert len(recs) - 1 == pol["mean_steps"] <= 15
    assert len(summary["reports"]) == 2 and all(os.path.exists(p) for p in summary["reports"])
    on_disk = json.load(open(tmp_path / "eval" / "summary.json"))
    assert on_disk["headline"]["tasks"] == 1 and on_disk["headline"]["expert_mean"] == 1.0
    assert "place_dirt" in format_table(summary)


@pytest.mark.game
def test_after_success_the_evaluated_agent_plays_on_and_every_later_frame_is_complete(tmp_path):
    """``after_success=4`` reaches each fleet episode: the expert's records go on four steps past the frame
    where the game's check first holds, all of them labelled complete (the detector's rollout positives)."""
    spec = EvalSpec(tasks=("place_dirt",), episodes=2, seed=1000, agents=("expert",), instances=1,
                    after_success=4, out_dir=str(tmp_path / "eval"), reports=0, progress_bar=False)
    summary = evaluate(spec)
    assert summary["results"]["expert"]["place_dirt"]["successes"] == 2 and summary["after_success"] == 4
    episodes: dict[str, list] = {}
    for p in records_lib.shard_paths(tmp_path / "eval" / "records" / "expert"):
        for r in records_lib.read_shard(p):
            episodes.setdefault(r.episode_id, []).append(r)
    assert len(episodes) == 2
    for recs in episodes.values():
        completed = [r.completed for r in recs]
        first = completed.index(1)
        assert completed == [0] * first + [1] * 5  # the first complete frame, four steps on
        assert recs[-1].events["place_block"] == {"default:dirt": 1}


@pytest.mark.game
def test_the_detectors_policy_rollouts_are_the_evaluation_on_their_own_seeds(run_dir, tmp_path):
    """``experiments.detector.policy_rollouts``: the policy's episodes of the record tasks on the rollout
    seeds (per task: ``rollout_episodes`` or its exception, 0 none), played by ``experiments.evaluate`` with
    the rollout fields, written where the detector reads them; a second call reuses the finished sets;
    without a policy run it is one clear error."""
    from experiments.configs.detector import get_config
    from experiments.detector import policy_rollouts, source_records

    cfg = get_config("tiny")
    d = cfg.detector
    d.policy, d.record_tasks, d.eval_records = run_dir, ("place_dirt", "mine_dirt", "mine_log"), ""
    d.rollout_episodes, d.rollout_task_episodes = 1, "place_dirt=2,mine_log=0"
    d.rollout_seed, d.rollout_max_steps, d.rollout_after_success = 5000, 4, 3
    d.rollout_temperature, d.rollout_top_p = 0.5, 0.8
    d.records = str(tmp_path / "expert")  # given expert records: nothing recorded here
    os.makedirs(d.records)
    work = str(tmp_path / "det")
    dirs = source_records(cfg, work)
    sets = [os.path.join(work, "rollouts", f"{n}_per_task") for n in (1, 2)]
    assert dirs == [d.records] + [os.path.join(s, "records", "policy") for s in sets]
    episodes = {r.episode_id.rsplit("-", 1)[0] for x in dirs[1:] for p in records_lib.shard_paths(x)
                for r in records_lib.read_shard(p) if r.kind == "eval"}
    assert episodes == {"mine_dirt-5000", "place_dirt-5000", "place_dirt-5001"}
    summaries = [json.load(open(os.path.join(s, "summary.json"))) for s in sets]
    assert [s["tasks"] for s in summaries] == [["mine_dirt"], ["place_dirt"]]
    assert summaries[1]["seeds"] == [5000, 5001] and summaries[1]["after_success"] == 3
    assert summaries[1]["sampling"] == {"greedy": False, "temperature": 0.5, "top_p": 0.8}
    written = [os.path.getmtime(os.path.join(s, "summary.json")) for s in sets]
    assert policy_rollouts(cfg, work) == dirs[1:]
    assert [os.path.getmtime(os.path.join(s, "summary.json")) for s in sets] == written
    d.rollout_task_episodes = "place_dirt:2"
    with pytest.raises(ValueError, match="detector.rollout_task_episodes: 'place_dirt:2' is not task="):
        policy_rollouts(cfg, work)
    d.rollout_task_episodes, d.policy = "", ""
    with pytest.raises(ValueError, match="rollout_episodes needs detector.policy"):
        policy_rollouts(cfg, str(tmp_path / "other"))
