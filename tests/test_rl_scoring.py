"""Stage 3's trajectory score and group verdicts against hand-computed values (no game, no model)."""

import dataclasses

import numpy as np
import pytest

from histeve_jax.data.records import StepRecord
from histeve_jax.envs.tasks import load_task
from histeve_jax.eval.rollout import EpisodeResult
from histeve_jax.losses.rl import RLLossConfig
from histeve_jax.rl import scoring
from histeve_jax.rl.samples import group_records
from histeve_jax.rl.spec import RLSpec


def _result(success=False, steps=10, progress=0.0, gui_end=False, health=20.0, error="", interrupted=False,
            grid=0):
    recs = [StepRecord(episode_id="e", step=t, task_id="t", kind="eval", instruction="i", frame=b"x",
                       action={"camera": [0.0, 0.0]}, is_gui_open=gui_end and t == steps,
                       metadata={"health": health if t == steps // 2 else 20.0, "action_tokens": [1],
                                 "craft_grid": grid if t == steps - 1 else 0})
            for t in range(steps + 1)]
    return EpisodeResult(task="t", seed=0, agent="policy", episode_id="e", success=success, steps=steps,
                         interrupted=interrupted, error=error, progress=progress, records=recs, seconds=0.0)


def test_score_terms_by_hand():
    mine = load_task("mine_dirt")  # a non-GUI task
    craft = load_task("craft_planks")
    cfg = scoring.ScoreConfig()
    # a success in 30 of 120 steps: 1 + 0.5 * 1 - 0.1 * 0.25
    s = scoring.trajectory_score(_result(success=True, steps=30), mine, 120, cfg)
    assert s.total == pytest.approx(1.5 - 0.025) and s.success and not s.timed_out
    # a failure that ran out the budget with half the subgoals, a GUI left open and a death
    s = scoring.trajectory_score(_result(steps=120, progress=0.5, gui_end=True, health=0.0), mine, 120, cfg)
    assert (s.timed_out, s.gui_left_open, s.died) == (True, True, True)
    assert s.total == pytest.approx(0.5 * 0.5 - 0.1 - 0.5 - 0.05 - 0.1)
    # a craft task ends inside its GUI: no penalty for that
    s = scoring.trajectory_score(_result(steps=120, gui_end=True), craft, 120, cfg)
    assert not s.gui_left_open and s.total == pytest.approx(-0.1 - 0.05)
    # the log once lay in the crafting grid: half way (a craft without subgoals)
    s = scoring.trajectory_score(_result(steps=120, gui_end=True, grid=1), craft, 120, cfg)
    assert s.progress == 0.5 and s.total == pytest.approx(0.25 - 0.1 - 0.05)
    assert scoring.trajectory_score(_result(steps=120, grid=1), mine, 120, cfg).progress == 0.0
    # the agent gave up early: not a timeout
    s = scoring.trajectory_score(_result(steps=40, error="gave up"), mine, 120, cfg)
    assert not s.timed_out and s.total == pytest.approx(-0.1 * 40 / 120)
    # weights are config: only completion counts
    only = scoring.ScoreConfig(progress=0, steps=0, death=0, timeout=0, gui_open=0)
    assert scoring.trajectory_score(_result(steps=120, progress=0.9), mine, 120, only).total == 0.0
    with pytest.raises(ValueError, match="interrupted"):
        scoring.trajectory_score(_result(interrupted=True), mine, 120, cfg)
    with pytest.raises(ValueError, match="ScoreConfig.death"):
        scoring.ScoreConfig(death=-1)


def test_group_verdict_advantages_and_zero_spread():
    v = scoring.group_verdict([1.0, 0.0, 0.0, 1.0])
    std = np.std([1, 0, 0, 1], ddof=1)
    np.testing.assert_allclose(v.advantages, (np.array([1, 0, 0, 1]) - 0.5) / (std + 1e-4), rtol=1e-6)
    assert v.informative and v.mean == pytest.approx(0.5)
    flat = scoring.group_verdict([0.3, 0.3, 0.3])
    assert not flat.informative and not flat.advantages.any()
    # a spread under min_reward_std (speed only) is uninformative by config
    near = [1.47, 1.475, 1.48]
    assert scoring.group_verdict(near).informative
    assert not scoring.group_verdict(near, RLLossConfig(min_reward_std=0.01)).informative


def test_group_records_carry_the_group_fields():
    task = load_task("mine_dirt")
    rs = [_result(success=True, steps=3), _result(steps=3)]
    scores = [scoring.trajectory_score(r, task, 120) for r in rs]
    eps = group_records(rs, "g7", scores, np.array([0.7, -0.7]), policy_step=42)
    assert [len(e) for e in eps] == [4, 4]
    m = eps[1][2].metadata
    assert (m["group_id"], m["branch"], m["advantage"], m["policy_step"], m["success"]) == (
        "g7", 1, pytest.approx(-0.7), 42, False)
    assert m["score"] == pytest.approx(scores[1].total) and eps[0][0].kind == "rl"
    assert m["action_tokens"] == [1]  # what the rollout recorded stays


def test_rl_spec_batch_layout_and_errors():
    spec = RLSpec.from_config({"rollout_dir": "/r", "reference": "/s", "replay_dirs": "/a,/b",
                               "loss": {"dpo_window": 4}, "score": {"death": 1.0}})
    assert spec.replay_dirs == ("/a", "/b") and spec.pair_rows == 8
    assert spec.batch_size == 16 + 8 + 4 and spec.score.death == 1.0
    with pytest.raises(ValueError, match="unknown field"):
        RLSpec.from_config({"rollout_dir": "/r", "reference": "/s", "rl_rowz": 3})
    with pytest.raises(ValueError, match="replay_dirs"):
        dataclasses.replace(spec, replay_dirs=())


def test_the_weakest_task_is_the_weakest_with_some_success_and_never_long_horizon():
    from histeve_jax.rl.driver import weakest_task

    def summary(rates):
        rows = {t: {"success_rate": r} for t, r in rates.items()}
        return {"tasks": list(rates), "results": {"policy": rows}}

    # craft_planks at 0 gives groups no spread: the weakest task with successes is taken (ties: first)
    assert weakest_task(summary({"place_dirt": 0.7, "mine_dirt": 0.7, "build_wall": 0.9,
                                 "craft_planks": 0.0})) == "place_dirt"
    assert weakest_task(summary({"place_dirt": 0.9, "mine_dirt": 0.3, "craft_planks": 0.0})) == "mine_dirt"
    # all at 0: the first of the weakest; a long-horizon task is never picked
    assert weakest_task(summary({"wooden_pickaxe": 0.0, "place_dirt": 0.0, "mine_dirt": 0.0})) == "place_dirt"
    assert weakest_task(summary({"wooden_pickaxe": 0.1, "place_dirt": 0.5})) == "place_dirt"
