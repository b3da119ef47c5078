"""The learner's grain source over a growing set of group shards: new shards picked up as they appear, an
exact iterator state, DPO pairs from the first divergence, the staleness bound, bad shards skipped and
counted, and RL samples whose targets are the sampled tokens with the recorded log-probs."""

import dataclasses
import os
import threading
import time

import numpy as np
import pytest

from histeve_jax.data import pipeline
from histeve_jax.data.records import RecordError, encode_frame
from histeve_jax.losses.rl import RLLossConfig
from histeve_jax.rl.order import DONE_FILE
from histeve_jax.rl.stream import FeaturizePlan, GroupStream
from tests import rl_helpers

LOSS = RLLossConfig(dpo_window=2)


def _stream(d, **kw):
    opts = dict(rl_rows=4, pair_units=1, history=1, stride=2, loss=LOSS, max_policy_lag=1000, poll_s=0.02,
                timeout_s=30.0)
    return GroupStream(str(d), **{**opts, **kw})


def _sig(plan):
    """What a plan holds: (episode, step) of every row, pair ids and sides."""
    rows = [None if w is None else (w["record"]["metadata"]["group_id"], w["record"]["metadata"]["branch"],
                                    hash(w["frames"][-1])) for w in plan["rl"] + plan["pair"]]
    return rows, plan["pair_id"].tolist(), plan["chosen"].tolist(), plan["lag"]


def test_new_shards_are_picked_up_and_a_restored_state_continues_exactly(tmp_path):
    d = tmp_path / "rollouts"
    rl_helpers.write_group(str(d), rl_helpers.group("mine_dirt", 1, [True, False, False]), "000000-a")
    (d / "group-000009-a-00000.array_record.tmp").write_bytes(b"half a group")  # a writer still busy
    s = _stream(d)
    first = [_sig(next(s)) for _ in range(3)]  # 3 x 6 steps / 4 rows = 5 plans in group 0
    saved = s.get_state()

    def late_writer():  # group 1 appears while the learner waits for it
        time.sleep(0.3)
        rl_helpers.write_group(str(d), rl_helpers.group("mine_dirt", 2, [False, True]), "000001-a")

    t = threading.Thread(target=late_writer)
    t.start()
    rest = [_sig(next(s)) for _ in range(5)]  # 2 more of group 0, then 3 of group 1 (12 steps / 4)
    t.join()
    (d / DONE_FILE).write_text("done")
    with pytest.raises(StopIteration):
        next(s)
    assert s.get_state()["shards"] == [f"group-00000{i}-a-00000.array_record" for i in (0, 1)]
    assert s.counts["groups"] == 2 and s.step == 8
    # a new iterator from the saved state sees exactly the same continuation (group 1 now on disk)
    again = _stream(d)
    again.set_state(saved)
    assert [_sig(next(again)) for _ in range(5)] == rest
    # and an uninterrupted one the same whole sequence
    whole = _stream(d)
    assert [_sig(next(whole)) for _ in range(8)] == first + rest


def test_pairs_are_a_success_and_a_failure_from_their_first_divergence(tmp_path):
    d = tmp_path / "r"
    eps = rl_helpers.group("mine_dirt", 3, [False, True, False], length=6, diverge=2)
    rl_helpers.write_group(str(d), eps, "000000-a")
    plans = [next(_stream(d, pair_units=2)) for _ in range(1)]
    p = plans[0]
    # two failures, each paired with the one success, each side the 2 steps from step 2
    assert p["pair_id"].tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    assert p["chosen"].tolist() == [True, True, False, False] * 2
    meta = [w["record"]["metadata"] for w in p["pair"]]
    assert [m["branch"] for m in meta] == [1, 1, 0, 0, 1, 1, 2, 2]
    steps = [[r.frame for r in eps[m["branch"]]].index(w["frames"][-1]) for m, w in
             zip(meta, p["pair"], strict=True)]
    assert steps == [2, 3, 2, 3, 2, 3, 2, 3]
    # all failures or all successes: no pair (padding rows, pair id -1)
    d2 = tmp_path / "r2"
    rl_helpers.write_group(str(d2), rl_helpers.group("mine_dirt", 4, [False, False], length=3), "000000-a")
    assert (next(_stream(d2))["pair_id"] == -1).all()


def test_stale_groups_are_dropped_and_bad_shards_skipped_and_counted(tmp_path):
    d = tmp_path / "r"
    rl_helpers.write_group(str(d), rl_helpers.group("mine_dirt", 1, [True, False], policy_step=0), "000000-a")
    (d / "group-000001-a-00000.array_record").write_bytes(b"\x00not an array record" * 50)
    rl_helpers.write_group(str(d), rl_helpers.group("mine_dirt", 2, [True, False], policy_step=3), "000002-a")
    (d / DONE_FILE).write_text("done")
    s = _stream(d, max_policy_lag=1)
    lags = []
    with pytest.raises(StopIteration):
        while True:
            lags.append(next(s)["lag"])
    # group 0 (weights of step 0): plans at lags 0, 1, then its third plan would lag 2 > 1: dropped;
    # the bad shard is skipped; group 2 (step 3) is read at learner step 2: lags -1, 0, 1
    assert lags == [0, 1, -1, 0, 1]
    assert s.counts["stale_groups"] == 1 and s.counts["stale_plans"] == 1 and s.counts["bad_shards"] == 1
    assert s.max_lag == 1 and s.counts["groups"] == 2


def test_rl_samples_target_the_sampled_tokens_with_their_recorded_log_probs(tmp_path):
    d = tmp_path / "r"
    eps = rl_helpers.group("mine_dirt", 5, [True, False], length=4)
    eps[0][1] = dataclasses.replace(eps[0][1], frame=b"not a jpeg")  # one bad frame: a padding row
    rl_helpers.write_group(str(d), eps, "000000-a")
    spec = pipeline.FeatureSpec(history=1, stride=2, max_len=80,
                                compact_vocab=pipeline.CompactVocab(action_base=rl_helpers.TINY_ACTION_BASE))
    plan = next(_stream(d, rl_rows=8, pair_units=0))
    out = FeaturizePlan(spec).map(plan)
    rl = out["rl"]
    # the bad frame is the current frame of step 1 and a history frame (stride 2) of step 3 of branch 0
    assert out["n_bad"] == 2 and out["rl_real"].sum() == 6
    checked = 0
    for i, w in enumerate(plan["rl"]):
        if w is None or not out["rl_real"][i]:
            assert rl["loss_mask"][i].sum() == 0
            continue
        m = w["record"]["metadata"]
        pos = np.flatnonzero(rl["loss_mask"][i])
        assert rl["targets"][i][pos].tolist() == m["action_tokens"]  # the sampled ids, END included
        np.testing.assert_allclose(rl["behaviour_logp"][i][pos], m["action_logprobs"], rtol=1e-6)
        assert rl["behaviour_logp"][i].sum() == pytest.approx(sum(m["action_logprobs"]), rel=1e-5)
        assert float(rl["advantage"][i]) == pytest.approx(m["advantage"])
        assert rl["regime"][i] == int(w["record"]["is_gui_open"])
        checked += 1
    assert checked == 6
    assert encode_frame(np.zeros((56, 56, 3), np.uint8))  # the helper's frames are real JPEGs
    assert os.path.basename(str(d))


def test_a_host_featurizes_only_its_rows_of_the_global_batch(tmp_path):
    d = tmp_path / "r"
    rl_helpers.write_group(str(d), rl_helpers.group("mine_dirt", 6, [True, False], length=4, diverge=2),
                           "000000-a")
    spec = pipeline.FeatureSpec(history=1, stride=2, max_len=80,
                                compact_vocab=pipeline.CompactVocab(action_base=rl_helpers.TINY_ACTION_BASE))
    plan = next(_stream(d))  # 4 GRPO rows | 4 pair rows (one pair, window 2)
    whole = FeaturizePlan(spec).map(plan)
    calls = []
    host = FeaturizePlan(spec, rows=slice(2, 6))  # the last 2 GRPO rows and the first 2 pair rows
    featurize = host.featurize.map
    host.featurize.map = lambda w: calls.append(w) or featurize(w)
    mine = host.map(plan)
    assert len(calls) == 4  # the other hosts' rows are never featurized here
    assert mine["rl_real"].tolist() == whole["rl_real"][2:].tolist() and len(mine["rl_real"]) == 2
    assert mine["pair_id"].tolist() == whole["pair_id"][:2].tolist() == [0, 0]
    assert mine["chosen"].tolist() == whole["chosen"][:2].tolist() == [True, True]
    for k, v in whole["rl"].items():
        np.testing.assert_array_equal(mine["rl"][k], v[2:])
        np.testing.assert_array_equal(mine["pair"][k], whole["pair"][k][:2])
    other = FeaturizePlan(spec, rows=slice(6, 8)).map(plan)  # a host holding pair rows only
    assert len(other["rl_real"]) == 0 and other["rl"]["input_ids"].shape == (0, 80)
    assert other["pair_id"].tolist() == [0, 0] and other["chosen"].tolist() == [False, False]


def test_the_smallest_new_name_comes_next_and_a_restore_continues_or_says_why_not(tmp_path):
    d = tmp_path / "r"
    rl_helpers.write_group(str(d), rl_helpers.group("mine_dirt", 1, [True, False], length=2), "000001-a")
    s = _stream(d)
    first = _sig(next(s))  # takes group 1, the only one
    saved = s.get_state()
    # a group whose name sorts first appears later: it comes after the one taken, in every stream
    rl_helpers.write_group(str(d), rl_helpers.group("mine_dirt", 0, [True, False], length=2), "000000-a")
    (d / DONE_FILE).write_text("done")
    rest = [_sig(next(s)) for _ in range(1)]
    with pytest.raises(StopIteration):
        next(s)
    assert s.shards == ["group-000001-a-00000.array_record", "group-000000-a-00000.array_record"]
    again = _stream(d)
    again.set_state(saved)
    assert [_sig(next(again)) for _ in range(1)] == rest and again.shards == s.shards
    assert first != rest[0]
    # a checkpoint's current group that no longer reads cannot be continued exactly: it says so
    (d / "group-000001-a-00000.array_record").write_bytes(b"\x00gone" * 50)
    with pytest.raises(RecordError, match="does not read now"):
        _stream(d).set_state(saved)


def test_the_learners_windows_are_the_pipelines_within_a_regime_too(tmp_path):
    """``data.history_in_regime``: an RL row's window (``stream._window``) equals the training pipeline's
    window of the same record, across an inventory opening and closing, with and without the switch."""
    from histeve_jax.data import records as R
    from histeve_jax.rl.stream import _window

    gui = [False] * 4 + [True] * 5 + [False] * 3
    frames = [encode_frame(np.full((8, 8, 3), 10 * t, np.uint8), "png") for t in range(len(gui))]
    episode = [R.StepRecord(episode_id="e", step=t, task_id="craft_planks", kind="demo", instruction="craft",
                            frame=frames[t], frame_format="png", action={"attack": 0, "camera": [0.0, 0.0]},
                            is_gui_open=g) for t, g in enumerate(gui)]
    R.write_episodes(tmp_path, [episode])
    for in_regime in (False, True):
        shards = pipeline.open_shards(str(tmp_path))
        src = pipeline.WindowSource(shards, history=2, stride=2, in_regime=in_regime)
        for t in range(len(episode)):
            assert _window(episode, t, 2, 2, in_regime)["frames"] == src[t]["frames"], (in_regime, t)
    assert _window(episode, 4, 2, 2, True)["frames"] == [frames[4]] * 3  # just opened: no world view
    assert _window(episode, 6, 2, 2, True)["frames"] == [frames[4], frames[4], frames[6]]
    assert _window(episode, 6, 2, 2, False)["frames"] == [frames[2], frames[4], frames[6]]
    assert _window(episode, 10, 2, 2, True)["frames"] == [frames[9], frames[9], frames[10]]  # closed at 9
