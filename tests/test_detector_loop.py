"""The detector in the rollout loop: a tiny coupled detector (random weights) wrapped around the scripted
expert in the real game ends the invocation on two consecutive queries over threshold, or on its budget, at
exactly the step the rule says; its probability series lines up with the episode's records and the episode
report draws it with the threshold against the privileged completion."""

import numpy as np
import pytest
from flax import nnx

from histeve_jax.detector.config import tiny_config
from histeve_jax.detector.coupled import CoupledDetector
from histeve_jax.detector.inputs import QueryInputs
from histeve_jax.detector.model import Detector
from histeve_jax.detector.monitor import (
    CompletionMonitor,
    MonitoredAgent,
    MonitorOptions,
    episode_series,
    first_signal,
    write_episode_report,
)
from histeve_jax.envs import load_task, make
from histeve_jax.eval.rollout import ExpertAgent, run_episode
from histeve_jax.policy import Policy
from histeve_jax.policy import tiny_config as policy_tiny

POLICY = policy_tiny(history_frames=1)
TASK = "place_dirt"


@pytest.fixture(scope="module")
def coupled():
    return CoupledDetector(Policy(POLICY, rngs=nnx.Rngs(0)), Detector(tiny_config(POLICY), rngs=nnx.Rngs(1)))


@pytest.fixture(scope="module")
def env():
    e = make("luanti", obs_size=tuple(POLICY.image_size), task=TASK, hang_timeout_s=4.0)
    yield e
    e.close()


def _episode(env, coupled, options: MonitorOptions):
    agent = MonitoredAgent(ExpertAgent(), CompletionMonitor(coupled, QueryInputs(coupled.config, POLICY),
                                                            options))
    return agent, run_episode(env, load_task(TASK), 0, agent)


def _check_series(agent: MonitoredAgent, records, every: int) -> list[float | None]:
    """The series has one value per act (every record but the final frame), a float exactly on query steps,
    equal to the monitor's curve; the padded series adds the records' privileged completion."""
    probs = agent.series["completion_prob"]
    assert len(probs) == len(records) - 1
    assert [i for i, p in enumerate(probs) if p is not None] == [i for i in range(len(probs))
                                                                 if i % every == every - 1]
    assert [(i, p) for i, p in enumerate(probs) if p is not None] == agent.monitor.curve
    assert all(0.0 <= p <= 1.0 for _, p in agent.monitor.curve)
    padded = episode_series(agent.series, records)
    assert {k: len(v) for k, v in padded.items()} == {"completion_prob": len(records),
                                                      "privileged_completion": len(records)}
    assert padded["completion_prob"][-1] is None
    assert padded["privileged_completion"] == [float(r.completed) for r in records]
    return probs


@pytest.mark.game
def test_the_detector_ends_the_invocation_on_two_consecutive_queries(env, coupled, tmp_path):
    every = 2
    agent, res = _episode(env, coupled, MonitorOptions(threshold=0.0, every=every, consecutive=2))
    recs = res.records
    assert not res.interrupted and res.error == ""
    # Queries at steps 1 and 3; every probability is >= 0, so the second query fires: step 3 by hand.
    stop = agent.stopped
    assert stop is not None and stop.reason == "detector" and stop.step == 3 == 2 * every - 1
    curve = agent.monitor.curve
    assert curve[first_signal([p for _, p in curve], 0.0, 2)][0] == stop.step
    # run_episode stops there: the expert acted on steps 0..2, step 3 is the monitor's no-op "done", then
    # the frame after it; the expert had not placed the dirt yet (the detector stopped it early).
    assert len(recs) == stop.step + 2 and res.steps == stop.step + 1 and not res.success
    assert recs[stop.step].subtask == "done" and recs[stop.step].action["camera"] == [0.0, 0.0]
    assert not any(v for k, v in recs[stop.step].action.items() if k != "camera")
    assert all(r.subtask != "done" for r in recs[:stop.step])
    assert all(r.completed == 0 for r in recs)
    _check_series(agent, recs, every)

    page = open(write_episode_report(recs, tmp_path / "fired.html", agent)).read()
    assert 'data-series="completion_prob"' in page and 'data-series="privileged_completion"' in page
    assert "<title>threshold 0</title>" in page
    assert "invocation ends: detector" in page and f"step {stop.step} (detector)" in page
    for step, p in curve:  # each query is a point of the curve at its step
        assert f"<title>step {step}: {p:.4g}</title>" in page
    assert page.count('<line class="threshold"') == 1  # on the probability chart only


@pytest.mark.game
def test_a_detector_that_never_fires_ends_on_the_budget_or_the_privileged_check(env, coupled, tmp_path):
    every, budget = 2, 4
    agent, res = _episode(env, coupled, MonitorOptions(threshold=1.01, every=every, budget=budget))
    recs = res.records
    stop = agent.stopped
    # The budget-th observation (step budget - 1) gives control back: budget steps in all, then the frame.
    assert stop is not None and stop.reason == "budget" and stop.step == budget - 1
    assert len(recs) == budget + 1 and res.steps == budget and recs[budget - 1].subtask == "done"
    assert [s for s, _ in agent.monitor.curve] == [1, 3]
    _check_series(agent, recs, every)

    # With no budget the expert finishes: the privileged check ends the episode, the detector never fired,
    # and the report shows the completion flipping to 1 at the last record, under a flat curve.
    agent, res = _episode(env, coupled, MonitorOptions(threshold=1.01, every=every))
    recs = res.records
    assert res.success and agent.stopped is None and len(recs) > 2 * every
    probs = _check_series(agent, recs, every)
    assert recs[-1].completed == 1 and all(r.completed == 0 for r in recs[:-1])
    assert sum(p is not None for p in probs) == (len(recs) - 1) // every
    page = open(write_episode_report(recs, tmp_path / "done.html", agent)).read()
    assert "stopped</th><td>no" in page and f"step {len(recs) - 1}" in page
    assert "invocation ends" not in page and "<title>threshold 1.01</title>" in page
    ones = np.flatnonzero(episode_series(agent.series, recs)["privileged_completion"])
    assert ones.tolist() == [len(recs) - 1]
