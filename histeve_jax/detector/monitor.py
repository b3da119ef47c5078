"""The detector in the loop: a bounded invocation ends on two consecutive queries over threshold, or on its
budget.

``CompletionMonitor`` keeps the invocation's rolling frame history; every ``every`` steps it queries the
coupled detector on the frames of its slots (each frame's image embeddings computed once, by the policy's
vision tower, when a query first needs it, then reused by later queries and by both models; so is the
embedding of its detail crop, ``DetectorConfig.detail``, for the frames that have one) and records
the probability. It signals a candidate completion when ``consecutive`` queries in a row are over the
threshold (``first_signal`` is the rule on a probability sequence), and returns control when the budget
of steps is spent. ``loop_stops`` counts how replayed episodes would end under the rule at a threshold, and
``loop_threshold`` picks the loop's threshold from them (the lowest that ends few enough early, or the one
that ends the fewest early or missed); ``loop_thresholds`` picks one per task.
``MonitoredAgent`` wraps any rollout ``Agent`` with a monitor: the step it fires, the
agent answers a no-op with ``subtask="done"``, which ``eval.rollout.run_episode`` already treats as the
end of the episode (so the hook works with the rollout as it is). Its ``series["completion_prob"]`` holds
the probability of each step it was asked to act on (None between queries), indexed like ``run_episode``'s
records (record i is the frame the agent saw at its i-th ``act``); ``write_episode_report`` draws it with
the threshold against the privileged completion (the records' ``completed``), so a reader sees where the
detector fired against where the task really completed. The rollout's ``Decision`` carries no metadata, so
the probabilities live in the agent's series, not in the step records.
"""

from __future__ import annotations

import collections
import dataclasses
import os
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from histeve_jax.detector.config import ANCHOR_OFFSET
from histeve_jax.detector.coupled import CoupledDetector
from histeve_jax.detector.inputs import QueryInputs
from histeve_jax.detector.loss import completion_probability


@dataclasses.dataclass(frozen=True)
class MonitorOptions:
    """Query every ``every`` steps; fire after ``consecutive`` queries at or over ``threshold``; give control
    back after ``budget`` steps (0: no budget)."""

    threshold: float = 0.5
    every: int = 4
    consecutive: int = 2
    budget: int = 0

    def __post_init__(self):
        if self.every < 1 or self.consecutive < 1 or self.budget < 0:
            raise ValueError(f"MonitorOptions: every={self.every} and consecutive={self.consecutive} must be "
                             f">= 1, budget={self.budget} >= 0")


def first_signal(probabilities: Sequence[float], threshold: float, consecutive: int = 2) -> int | None:
    """Index of the query at which ``consecutive`` queries in a row are >= ``threshold`` (None: never)."""
    run = 0
    for i, p in enumerate(probabilities):
        run = run + 1 if p >= threshold else 0
        if run >= consecutive:
            return i
    return None


Curve = tuple[Sequence[int], Sequence[float], int | None]


def loop_stops(curves: Sequence[Curve], threshold: float, consecutive: int = 2) -> dict[str, Any]:
    """How invocations end under the stop rule at ``threshold``, over episodes' curves (query steps, their
    probabilities, the first step whose privileged check holds or None): early (before the check holds, or
    at all in an episode where it never does), missed (the check holds, the detector never fires: the
    budget ends it), and the steps from the check holding to the stop."""
    early = missed = 0
    delays = []
    for steps, probs, done in curves:
        i = first_signal(probs, threshold, consecutive)
        stop = None if i is None else steps[i]
        early += stop is not None and (done is None or stop < done)
        missed += done is not None and stop is None
        if stop is not None and done is not None and stop >= done:
            delays.append(stop - done)
    return {"episodes": len(curves), "early": early, "missed": missed, "delays": delays}


LOOP_RULES = ("max_early", "balanced")


def loop_threshold(curves: Sequence[Curve], consecutive: int = 2, max_early: float = 0.05,
                   rule: str = "max_early", early_cost: float = 1.0) -> float:
    """The loop's threshold from replayed episodes' curves, by ``rule``:

    * ``max_early``: the lowest threshold whose stop rule ends at most ``max_early`` of the episodes early
      (the early count only falls as the threshold rises); above every probability (never firing) when
      none does;
    * ``balanced``: the lowest threshold minimising ``early_cost * early + missed``: an early stop hands an
      unfinished subtask on, a missed one runs the invocation to its budget, and on the policy's own
      rollouts (played on past success) both happen; ``max_early`` never weighs the second.
    """
    if rule not in LOOP_RULES:
        raise ValueError(f"loop threshold rule {rule!r} unknown; choose one of {LOOP_RULES}")
    probs = sorted({p for _, ps, _ in curves for p in ps})
    never = float(probs[-1] + 1e-6) if probs else 1.0
    if rule == "balanced":
        cost = lambda m: early_cost * m["early"] + m["missed"]
        return float(min(probs + [never], key=lambda t: (cost(loop_stops(curves, t, consecutive)), t)))
    for t in probs:
        if loop_stops(curves, t, consecutive)["early"] <= max_early * len(curves):
            return float(t)
    return never


def loop_thresholds(curves: Sequence[Curve], tasks: Sequence[str], consecutive: int = 2,
                    max_early: float = 0.05, rule: str = "max_early",
                    early_cost: float = 1.0) -> dict[str, float]:
    """``loop_threshold`` per task, each from its own replays (``tasks[i]`` is curve i's task): a subtask
    the detector reads well keeps a low threshold while one it confuses (mine_dirt begun with dirt held)
    gets its own high one."""
    if len(curves) != len(tasks):
        raise ValueError(f"loop_thresholds: {len(curves)} curves, {len(tasks)} task names")
    return {t: loop_threshold([c for c, k in zip(curves, tasks, strict=True) if k == t], consecutive,
                              max_early, rule, early_cost) for t in sorted(set(tasks))}


@dataclasses.dataclass(frozen=True)
class MonitorStep:
    """What the monitor says after one frame: the query's probability (None between queries), whether the
    invocation ends, and why ("detector" or "budget"; "" while it goes on)."""

    step: int
    probability: float | None
    stop: bool
    reason: str


@nnx.jit(static_argnames="detail")
def _embed_frame(coupled: CoupledDetector, pixels: jax.Array, detail: bool = False) -> jax.Array:
    return coupled.frame_embeds(pixels, 1, detail=detail)[0]


@nnx.jit
def _query(coupled: CoupledDetector, embeds: jax.Array, batch: dict[str, jax.Array],
           detail: jax.Array | None) -> jax.Array:
    return completion_probability(coupled.logits_from_embeds(embeds, batch, detail))[0]


class CompletionMonitor:
    """The detector of one bounded invocation (module docstring). ``curve`` holds (step, probability)."""

    def __init__(self, coupled: CoupledDetector, inputs: QueryInputs, options: MonitorOptions):
        self.coupled, self.inputs, self.options = coupled, inputs, options
        self.offsets = inputs.slots[0]
        self.reset("")

    def reset(self, instruction: str, regime: int = 0) -> None:
        """A new invocation of ``instruction``."""
        self.instruction, self.regime = instruction, int(regime)
        self.step = -1
        # The recent frames the slots reach back to, and the invocation's first (the anchor slot's, and
        # where every offset clamps): (frame, {detail crop?: its embeddings} once computed).
        recent = [o for o in self.offsets if o != ANCHOR_OFFSET]
        self._frames: collections.deque[tuple[np.ndarray, dict[bool, Any]]] = collections.deque(
            maxlen=max(recent, default=0) + 1)
        self._first: tuple[np.ndarray, dict[bool, Any]] | None = None
        self._run = 0
        self.curve: list[tuple[int, float]] = []
        self.stopped: MonitorStep | None = None

    def _embeds(self, back: int, detail: bool = False) -> jax.Array:
        """The image embeddings of the frame ``back`` steps ago (clamped to the invocation's first frame;
        ``detail``: of its detail crop), computed once."""
        i = len(self._frames) - 1 - back
        frame, cache = self._frames[i] if i >= 0 else self._first
        if detail not in cache:
            pixels = (self.inputs.detail_pixels if detail else self.inputs.pixels)([frame])
            cache[detail] = _embed_frame(self.coupled, jnp.asarray(pixels), detail=detail)
        return cache[detail]

    def probability(self) -> float:
        """The detector's completion probability on the current history (one query)."""
        embeds = jnp.stack([self._embeds(o) for o in self.offsets])[None]
        detail = None
        if self.inputs.detail_slots:
            detail = jnp.stack([self._embeds(self.offsets[i], detail=True)
                                for i in self.inputs.detail_slots])[None]
        arrays = self.inputs.prompts(self.instruction, self.regime)
        batch = {k: jnp.asarray(v)[None] for k, v in arrays.items()}
        return float(_query(self.coupled, embeds, batch, detail))

    def observe(self, frame: np.ndarray, info: dict | None = None) -> MonitorStep:
        """Add the frame of the next step; query if it is a query step; say whether the invocation ends."""
        if self.stopped is not None:
            return self.stopped
        self.step += 1
        if info is not None and "is_gui_open" in info:
            self.regime = int(bool(info["is_gui_open"]))
        self._frames.append((np.asarray(frame), {}))
        if self._first is None:
            self._first = self._frames[0]
        o = self.options
        prob = None
        if self.step % o.every == o.every - 1:
            prob = self.probability()
            self.curve.append((self.step, prob))
            self._run = self._run + 1 if prob >= o.threshold else 0
        reason = ""
        if self._run >= o.consecutive:
            reason = "detector"
        elif o.budget and self.step + 1 >= o.budget:
            reason = "budget"
        out = MonitorStep(self.step, prob, bool(reason), reason)
        if reason:
            self.stopped = out
        return out


class MonitoredAgent:
    """A rollout ``Agent`` whose invocation the detector ends: after each observation the monitor decides;
    when it fires, the agent answers a no-op with ``subtask="done"`` (``run_episode`` stops there).
    ``series["completion_prob"][i]`` is the probability queried on the i-th observation (None: no query);
    ``stopped`` is the monitor's step that ended the invocation (its ``step`` and ``reason``), or None."""

    SERIES = "completion_prob"

    def __init__(self, agent: Any, monitor: CompletionMonitor):
        self.agent, self.monitor = agent, monitor
        self.name = f"{getattr(agent, 'name', type(agent).__name__)}+detector"
        self.series: dict[str, list[float | None]] = {self.SERIES: []}

    @property
    def stopped(self) -> MonitorStep | None:
        """The monitor step that ended the invocation (``.step``, ``.reason``: detector/budget), or None."""
        return self.monitor.stopped

    def reset(self, task: Any, obs: dict, info: dict, seed: int) -> None:
        self.agent.reset(task, obs, info, seed)
        self.monitor.reset(task.instruction(info), int(bool(info.get("is_gui_open", False))))
        self.series = {self.SERIES: []}

    def act(self, obs: dict, info: dict) -> Any:
        from histeve_jax.envs.base import noop_action
        from histeve_jax.eval.rollout import Decision

        # Asked again after it stopped (a caller that ignores "done"): no new query on this step.
        was_stopped = self.monitor.stopped is not None
        m = self.monitor.observe(obs["image"], info)
        self.series[self.SERIES].append(None if was_stopped else m.probability)
        if m.stop:
            return Decision(action=noop_action(), subtask="done", text=f"detector: {m.reason}")
        return self.agent.act(obs, info)


def episode_series(series: Mapping[str, Sequence[float | None]], records: Sequence[Any]) -> dict[str, list]:
    """The agent's per-act ``series`` padded with None to one value per record (the last record, the frame
    after the last action, has no act), plus ``privileged_completion``: each record's ``completed`` (0/1)."""
    n = len(records)
    out: dict[str, list] = {}
    for name, values in series.items():
        if len(values) > n:
            raise ValueError(f"episode_series: series {name!r} has {len(values)} values for {n} records")
        out[name] = list(values) + [None] * (n - len(values))
    out["privileged_completion"] = [float(r.completed) for r in records]
    return out


def write_episode_report(records: Sequence[Any], path: str | os.PathLike, agent: MonitoredAgent, *,
                         title: str = "", summary: Mapping[str, Any] | None = None,
                         events: Sequence[Mapping[str, Any]] = ()) -> str:
    """``eval.report.write_report`` of a monitored episode: the detector's probability curve with its
    threshold, the privileged completion as a second series, and the stop (step, reason) as an event."""
    from histeve_jax.eval.report import write_report

    o, stop = agent.monitor.options, agent.stopped
    done = [r.step for r in records if r.completed]
    facts = {"detector": f"every {o.every} steps, {o.consecutive} consecutive >= {o.threshold:.4g}, "
                         f"budget {o.budget or 'none'}",
             "stopped": f"step {stop.step} ({stop.reason})" if stop else "no",
             "privileged check first holds": f"step {done[0]}" if done else "never", **(summary or {})}
    evs = list(events)
    if stop is not None:
        evs.append({"step": stop.step, "kind": "detector", "title": f"invocation ends: {stop.reason}",
                    "payload": {"step": stop.step, "reason": stop.reason, "probability": stop.probability}})
    return write_report(records, path, title=title, summary=facts,
                        series=episode_series(agent.series, records), thresholds={agent.SERIES: o.threshold},
                        events=evs)
