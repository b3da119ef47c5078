"""The controller: plan a subtask, hand it to the executor in a bounded invocation, verify, then advance,
recover or replan; as a ``rollout.Agent`` so ``run_episode`` records it like any agent.

Handoff: an invocation runs until the completion signal fires (probability at or over its ``threshold`` on
``consecutive`` queries in a row, the paper's detector rule; with ``rearm``, a subtask whose last stop by the
signal was early is not stopped by it again until one of its queries reads under the threshold), one of the
subtask's unrecoverable failure conditions holds for ``failure_patience`` steps (its inputs are gone: a
policy would otherwise spend the whole budget on it), the subtask's step budget is spent, the executor stops
or gives up, the visual state jumps (``verify.ChangeMonitor``), or (``stall_patience``) the player
stands still. Between invocations the harness may act on its own: after a stall it backs off and turns
(``unstick_actions``); with ``walk_back``, when the planner has nothing executable because a resource went
out of sight, it walks back to one its world memory saw (``WalkBack``). The completion signal is
a hook (``CompletionSignal``): ``harness.completion.DetectorCompletion`` is the trained detector coupled to
the policy (queried every k steps on the subtask's instruction, at its run's loop threshold);
``PrivilegedCompletion`` reports the subtask's privileged completion check as probability 0 or 1 at every
step (the ablation's upper bound, and what the scripted experts run with). After each invocation the
harness verifies (``verify.verify``: privileged, whatever ended it), writes the episodic entry, learns
procedural dependencies from a success, refreshes world and working memory, and decides
(``verify.decide``).

Everything the harness did is kept: ``trace`` (per step acted: the invocation, its subtask, the instruction
the executor was told, and whether its check held on that step's frame; ``label_records`` writes it into
the episode's records for the completion detector) and, for the report, ``events`` (planner calls, the
completion signal's stops, verifications, memory snapshots, each at its step) and ``series["completion"]``
(the completion signal's probability at each step it was queried, None between queries). A planner that fails
``max_planner_failures`` times in a row ends the episode as a failure, with its record.
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from histeve_jax.data.records import StepRecord
from histeve_jax.envs.base import noop_action
from histeve_jax.envs.experts.core import MAX_TURN, Expert
from histeve_jax.envs.tasks import Task
from histeve_jax.eval.rollout import Decision
from histeve_jax.harness.executors import closes_gui
from histeve_jax.harness.memory import EpisodicEntry, Memory, ProceduralMemory
from histeve_jax.harness.planners.base import Planner, PlanningContext
from histeve_jax.harness.schemas import Subtask, SubtaskSchema, evaluate_condition
from histeve_jax.harness.verify import VISUAL_JUMP, ChangeMonitor, StallMonitor, decide, verify

UNSTICK_BACK = 6  # steps walked backwards after a stall (about a block) ...
UNSTICK_TURN = (30.0, 90.0)  # ... then the view levelled and turned this many degrees, either way ...
UNSTICK_MAX_TURN = MAX_TURN  # ... at most this many degrees a step (the experts' turn rate)
WALK_BACK_REACH = 4.0  # the walk back to a remembered resource ends this many blocks from it ...
WALK_BACK_MAX_STEPS = 300  # ... or after this many steps of walking


class WalkBack(Expert):
    """The harness's own walk back to a landmark its world memory remembers (``HarnessSpec.walk_back``), made
    of the experts' shared motions: a GUI left open closed first (``close_inventory``), then ``walk_to``
    within ``WALK_BACK_REACH`` blocks of the node's centre (turning at the experts' rate with the view
    levelled, walking while it is within 30 degrees ahead, jumping when stuck; at most
    ``WALK_BACK_MAX_STEPS``), then ``turn_to`` it at eye level. ``act`` -> (action, "done" once finished)."""

    def __init__(self, target: Sequence[float]):
        super().__init__(None)
        self.target = [float(v) for v in target]

    def plan(self):
        x, _, z = self.target
        centre = (x + 0.5, z + 0.5)
        yield from self.walk_to(centre, WALK_BACK_REACH, "walk_back", max_steps=WALK_BACK_MAX_STEPS)
        yield from self.turn_to((x + 0.5, self.eye()[1], z + 0.5), "walk_back", tol=5.0)


def unstick_actions(info: Mapping[str, Any], rng: np.random.Generator) -> list[dict[str, Any]]:
    """The harness's own motion after a stall: walk back ``UNSTICK_BACK`` steps, then level the view and
    turn by a yaw drawn from ``UNSTICK_TURN`` either way, so the executor is asked again from a state that is
    not its fixed point (env-format actions)."""
    dpitch = -float(info.get("pitch") or 0.0)
    dyaw = float(rng.choice((-1.0, 1.0)) * rng.uniform(*UNSTICK_TURN))
    n = max(1, int(np.ceil(max(abs(dpitch), abs(dyaw)) / UNSTICK_MAX_TURN)))
    back = [{**noop_action(), "back": 1} for _ in range(UNSTICK_BACK)]
    turn = [{**noop_action(), "camera": np.array([dpitch / n, dyaw / n], np.float32)} for _ in range(n)]
    return back + turn


class CompletionSignal(Protocol):
    """The completion detector's interface: at the start of an invocation ``reset`` (with its first frame);
    then, on each later frame, the probability that the subtask is done, or None on a step it is not
    queried. The harness ends the invocation once ``consecutive`` queries in a row are >= ``threshold``."""

    name: str
    threshold: float

    def reset(self, subtask: Subtask, obs: dict, info: dict) -> None: ...

    def probability(self, obs: dict, info: dict) -> float | None: ...

    def restart(self, obs: dict, info: dict) -> None:
        """The same invocation watched again from this step (its subtask and instruction kept): where the
        executor's own steps begin after it closed a GUI left open."""


class PrivilegedCompletion:
    """The subtask's completion check on the privileged info, as 0 or 1 at every step.

    ``after``: the check must have held for more than ``after`` steps in a row before it reads 1, so the
    executor goes on acting that long past completion: how the harness's own invocations are recorded for
    the completion detector (``SuiteSpec.privileged_after``), whose positives are then the executor's own
    frames once its subtask is done, as the detector meets them in the loop. 0: the plain check."""

    name = "privileged"
    threshold = 0.5

    def __init__(self, after: int = 0):
        if after < 0:
            raise ValueError(f"PrivilegedCompletion: after must be >= 0, got {after}")
        self.after = int(after)

    def reset(self, subtask: Subtask, obs: dict, info: dict) -> None:
        self.subtask, self.held = subtask, 0

    def probability(self, obs: dict, info: dict) -> float:
        self.held = self.held + 1 if self.subtask.is_complete(info) else 0
        return float(self.held > self.after)

    def restart(self, obs: dict, info: dict) -> None:
        """Nothing to restart: the check reads each step's own info."""


@dataclasses.dataclass(frozen=True)
class HarnessSpec:
    """The controller's knobs."""

    max_recoveries: int = 2  # local retries of one subtask before replanning
    max_planner_failures: int = 3  # consecutive planning steps without an executable subtask
    max_invocations: int = 60
    consecutive: int = 2  # queries at or over the signal's threshold that return control (the paper's rule)
    recent_frames: int = 4  # O_j: frames the planner sees
    failure_patience: int = 20  # steps an unrecoverable failure condition must hold to end an invocation
    visual_jump: float = VISUAL_JUMP
    # After an early handoff (the signal stopped a subtask whose check did not hold), that subtask's next
    # invocations may be stopped by the signal only after one of its queries reads under the threshold.
    # The view that fooled the detector is usually still there (a chopped trunk after the log was taken):
    # without this, each retry was stopped at its second query, 3 steps in (24 of 28 invocations in one
    # wooden_pickaxe episode), and the episode's steps ran out in replanning. False: the paper's bare rule.
    rearm: bool = True
    # Steps the player may stand still outside the GUI before the invocation ends as a stall (above a hand's
    # 70-step dig of a log); the harness then backs off and turns (``unstick_actions``) before the next
    # invocation. 0: off (the paper's harness).
    stall_patience: int = 0
    # When the planner gives no executable subtask and a schema is out of reach only because its resource is
    # out of sight (``applicable: {nearby: ...}``: the executor wandered off, in wooden_pickaxe out of the
    # arena), the harness walks back toward the nearest such resource its world memory saw (``WalkBack``),
    # once per run of planner failures, then plans again. False: those planner failures end the episode.
    walk_back: bool = False
    # The completion signal's invocation begins where the policy's own does: after the executor's closing of
    # a GUI the last invocation left open (``executors.closes_gui`` steps: not queried; the signal restarted
    # on the policy's first step, as its frame history is). Otherwise the detector's history holds the last
    # craft's finished screen and it was queried on it: replaying the privileged row's invocations (seeds
    # 6100-6109, 6200-6209), stop 48's detector fired before the check held in 76 of 109 crafts, nearly all
    # at the second query (3 steps in), against 33 of 106 begun with the policy. False: from the first step.
    completion_after_close: bool = True


class HarnessAgent:
    """The harness as an Agent: ``reset`` then ``act`` per step (see the module docstring)."""

    def __init__(self, planner: Planner, executor: Any, schemas: Mapping[str, SubtaskSchema],
                 spec: HarnessSpec = HarnessSpec(), procedural: ProceduralMemory | None = None,
                 completion: CompletionSignal | None = None):
        self.planner, self.executor, self.schemas, self.spec = planner, executor, dict(schemas), spec
        self.procedural = procedural if procedural is not None else ProceduralMemory()
        self.completion = completion or PrivilegedCompletion()
        self.name = f"harness[{planner.name}+{executor.name}+{self.completion.name}]"

    # ------------------------------------------------------------------------------------------ episode

    def reset(self, task: Task, obs: dict, info: dict, seed: int) -> None:
        self.task, self.seed = task, int(seed)
        self.memory = Memory(task.text, self.procedural)
        self.events: list[dict[str, Any]] = []
        self.series: dict[str, list[float | None]] = {"completion": []}
        self.t = 0  # steps acted so far (= the record index of the next step)
        self.trace: list[dict[str, Any]] = []  # per step acted (``label_records``)
        self.frames: deque[np.ndarray] = deque(maxlen=self.spec.recent_frames)
        self.current: Subtask | None = None
        self.closing = False  # the executor is closing a GUI left open (HarnessSpec.completion_after_close)
        self.recoveries = 0
        self.planner_failures = 0
        self.invocations = 0
        self.counts = {"planner_calls": 0, "planner_retries": 0, "planner_failures": 0, "recoveries": 0,
                       "replans": 0, "advances": 0, "early_handoffs": 0}
        self.planner_cost = {"seconds": 0.0, "prompt_tokens": 0, "completion_tokens": 0}
        self.handoff_delays: list[int] = []  # steps from the check holding to the signal's stop
        self.disarmed: set[str] = set()  # subtask labels whose last stop by the signal was early (``rearm``)
        self.unstick: deque[dict[str, Any]] = deque()  # the harness's own actions after a stall, to play
        self.resume: Subtask | None = None  # the subtask to recover once they are played
        self.walk: WalkBack | None = None  # the harness's walk back to a remembered resource, under way
        self.walked = False  # whether it walked back since the planner last gave a subtask
        self.memory.world.observe(info, 0)
        self._observe(info)

    def _unresolved(self, info: Mapping[str, Any]) -> list[str]:
        out = []
        for key, clause in self.task.success.items():
            if isinstance(clause, Mapping):
                out += [f"{key} {item} {cond}" for item, cond in clause.items()
                        if not evaluate_condition({key: {item: cond}}, info)]
        return out

    def _observe(self, info: Mapping[str, Any]) -> None:
        self.memory.working.observe(info, self._unresolved(info))

    def _event(self, kind: str, title: str, payload: Any) -> None:
        self.events.append({"step": self.t, "kind": kind, "title": title, "payload": payload})

    # ------------------------------------------------------------------------------------------ planning

    def admissible(self, info: Mapping[str, Any]) -> dict[str, SubtaskSchema]:
        """S_j: the schemas whose applicability conditions hold on ``info``."""
        return {n: s for n, s in self.schemas.items() if evaluate_condition(s.applicable, info)}

    def _plan(self, obs: dict, info: dict) -> None:
        admissible = self.admissible(info)
        ctx = PlanningContext(
            goal=self.task.text, goal_check=self.task.success, subgoals=self.task.subgoals,
            frames=list(self.frames), info=info, working=self.memory.working.snapshot(),
            admissible=admissible,
            retrieved=self.memory.retrieve(admissible, info), schemas=self.schemas)
        result = self.planner.plan(ctx)
        self.counts["planner_calls"] += 1
        self.planner_cost["seconds"] += result.seconds
        self.planner_cost["prompt_tokens"] += result.prompt_tokens
        self.planner_cost["completion_tokens"] += result.completion_tokens
        self.counts["planner_retries"] += max(0, result.attempts - 1)
        chosen = result.subtask.label if result.subtask else "no subtask"
        self._event("planner", f"{result.planner}: {chosen}",
                    {**result.event(), "admissible": sorted(admissible)})
        if result.subtask is None:
            self.counts["planner_failures"] += 1
            self.planner_failures += 1
            if self._walk_back(info):
                return
            if self.planner_failures >= self.spec.max_planner_failures:
                raise RuntimeError(f"the planner gave no executable subtask {self.planner_failures} times "
                                   f"in a row; last: {result.error}")
            return
        self.planner_failures = 0
        self.recoveries = 0
        self.walked = False
        self._start(result.subtask, obs, info)

    def _walk_back(self, info: Mapping[str, Any]) -> bool:
        """Start a ``WalkBack`` to the nearest remembered resource that the inadmissible schemas lack only
        for being out of sight (``HarnessSpec.walk_back``); whether one started."""
        if not self.spec.walk_back or self.walked or info.get("pos") is None:
            return False
        kinds = set()
        for s in self.schemas.values():
            rest = {k: v for k, v in s.applicable.items() if k != "nearby"}
            if s.applicable.get("nearby") and not evaluate_condition(s.applicable, info) \
                    and evaluate_condition(rest, info):
                kinds |= set(s.applicable["nearby"])
        marks = [(n, m["pos"]) for n in sorted(kinds) for m in self.memory.world.landmarks.get(n, [])]
        if not marks:
            return False
        pos = info["pos"]
        name, target = min(marks, key=lambda nm: math.hypot(nm[1][0] - pos[0], nm[1][2] - pos[2]))
        self.walk, self.walked = WalkBack(target), True
        self._event("walk_back", f"the harness walks back to the {name} it saw at {target}", {
            "step": self.t, "kind": name, "target": target,
            "distance": round(math.hypot(target[0] - pos[0], target[2] - pos[2]), 1)})
        return True

    def _start(self, subtask: Subtask, obs: dict, info: dict) -> None:
        self.invocations += 1
        if self.invocations > self.spec.max_invocations:
            raise RuntimeError(f"more than {self.spec.max_invocations} invocations")
        self.current = subtask
        self.instruction = subtask.instruction_at(info)  # what the executor and the detector are told
        self.memory.working.current = subtask.label
        self.inv_start, self.inv_info, self.inv_steps, self.over = self.t, dict(info), 0, 0
        self.complete = subtask.is_complete(info)  # whether its check holds on this step's frame
        self.done_at: int | None = 0 if self.complete else None  # inv step its check first held
        self.failing_for = 0  # steps an unrecoverable failure condition has held in a row
        self.last_action = None
        self.before = self.memory.working.snapshot()
        self.monitor = ChangeMonitor(self.spec.visual_jump)
        self.monitor.push(obs["image"], info)
        self.stall = StallMonitor(self.spec.stall_patience) if self.spec.stall_patience > 0 else None
        if self.stall is not None:
            self.stall.push(info)
        self.completion.reset(subtask, obs, info)
        self.closing = False
        self.executor.start(subtask, obs, info)

    # ------------------------------------------------------------------------------------------ handoff

    def _end(self, obs: dict, info: dict, ended_by: str, error: str = "") -> None:
        sub = self.current
        if ended_by == "detector":  # early: the check does not hold; late: it held steps before the stop
            early = self.done_at is None or not sub.is_complete(info)
            if early:
                self.counts["early_handoffs"] += 1
                if self.spec.rearm:
                    self.disarmed.add(sub.label)
            else:
                self.handoff_delays.append(self.inv_steps - self.done_at)
            self._event("completion", f"{self.completion.name} stops {sub.label}", {
                "step": self.t, "threshold": self.completion.threshold, "consecutive": self.spec.consecutive,
                "check_held_since": None if self.done_at is None else self.inv_start + self.done_at,
                "check_holds": bool(sub.is_complete(info)),
                "disarmed_until_under_threshold": bool(early and self.spec.rearm)})
        if ended_by == "stall":
            error = f"the player stood still for {self.stall.still} steps"
        verdict = verify(sub, self.inv_info, info, ended_by=ended_by, monitor=self.monitor, error=error)
        decision = decide(verdict, self.recoveries, self.spec.max_recoveries)
        self.memory.world.observe(info, self.t, label=sub.label)
        if verdict.outcome == "success":
            self.memory.working.verified.append(sub.label)
            self.memory.procedural.learn(sub.label, sub.name, sub.params, self.inv_info, info, self.inv_steps)
        else:
            self.memory.working.fail(sub.label, verdict.outcome, verdict.reasons)
        self._observe(info)
        self.memory.episodic.append(EpisodicEntry(
            index=len(self.memory.episodic), subtask=sub.label, name=sub.name, params=dict(sub.params),
            start_step=self.inv_start, cost=self.inv_steps, outcome=verdict.outcome, decision=decision,
            before=self.before, after=self.memory.working.snapshot(), diagnostics=verdict.to_json()))
        self.counts[{"advance": "advances", "recover": "recoveries", "replan": "replans"}[decision]] += 1
        self._event("verify", f"{sub.label}: {verdict.outcome} -> {decision}", verdict.to_json())
        self._event("memory", f"memory after {sub.label}", {
            "working": self.memory.working.snapshot(),
            "retrieved": self.memory.retrieve(self.schemas, info)})
        self.current = None
        if ended_by == "stall":
            rng = np.random.default_rng((self.seed, self.invocations))
            self.unstick.extend(unstick_actions(info, rng))
            self._event("unstick", f"the harness backs off and turns after {sub.label} stalled", {
                "step": self.t, "actions": len(self.unstick),
                "turn": [round(float(x), 2) for x in np.sum([a["camera"] for a in self.unstick], axis=0)]})
        if decision == "recover":
            self.recoveries += 1
            if self.unstick:
                self.resume = sub  # asked again after the harness's own motion (``act``)
            else:
                self._start(sub, obs, info)

    def _failing(self, info: dict) -> bool:
        """Whether an unrecoverable failure condition of the subtask has held for ``failure_patience`` steps
        in a row, counting the crafting grid's items as held: a craft takes its inputs out of the inventory
        onto the pointer and into the grid, and its output is on the pointer a few steps before it is
        stored, so only a condition that outlasts that is a failure."""
        sub = self.current
        held = dict(info.get("inventory") or {})
        for g in info.get("craft_grid") or []:
            if g.get("type") not in (None, "", "air"):
                held[g["type"]] = held.get(g["type"], 0) + int(g.get("quantity", 1))
        seen = {**info, "inventory": held}
        bad = not sub.is_complete(seen) and any(not rec for _, rec in sub.failures(seen))
        self.failing_for = self.failing_for + 1 if bad else 0
        return self.failing_for >= self.spec.failure_patience

    def _ended(self, obs: dict, info: dict) -> str:
        """Why the current invocation should end before this step ("" to go on)."""
        self.complete = self.current.is_complete(info)
        if self.done_at is None and self.complete:
            self.done_at = self.inv_steps
        p = None if self.closing else self.completion.probability(obs, info)
        self.series["completion"].append(None if p is None else float(p))
        if p is not None:
            under = p < self.completion.threshold
            armed = self.current.label not in self.disarmed  # whether the signal may stop this invocation
            if not armed and under:  # the view no longer reads as done: the rule applies again
                self.disarmed.discard(self.current.label)
                self._event("rearm", f"{self.completion.name} rearmed for {self.current.label}", {
                    "step": self.t, "probability": float(p), "threshold": self.completion.threshold})
            self.over = 0 if under or not armed else self.over + 1
        if self.over >= self.spec.consecutive:
            return "detector"
        if self._failing(info):
            return "failure_condition"  # e.g. the recipe's inputs were taken: no step can finish it now
        if self.monitor.push(obs["image"], info, self.last_action):
            return "visual_change"
        if self.stall is not None and self.stall.push(info):
            return "stall"
        if self.inv_steps >= self.current.budget:
            return "budget"
        return ""

    def act(self, obs: dict, info: dict) -> Decision:
        self.frames.append(np.asarray(obs["image"]))
        queried = False
        for _ in range(4 * self.spec.max_invocations):  # ends, plans and restarts within one step
            if self.unstick:  # the harness's own motion after a stall, between invocations
                return self._own(self.unstick.popleft(), "unstick")
            if self.walk is not None:  # its walk back to a remembered resource, before it plans again
                action, phase = self.walk.act(info)
                if phase != "done":
                    return self._own(action, "walk_back")
                self.walk = None
            if self.resume is not None:
                sub, self.resume = self.resume, None
                self._start(sub, obs, info)
            if self.current is None:
                self._plan(obs, info)
                continue
            if not queried or self.inv_steps == 0:
                queried = True
                why = self._ended(obs, info) if self.inv_steps > 0 else ""
                if why:
                    self._end(obs, info, why)
                    continue
            try:
                decision = self.executor.act(obs, info)
            except RuntimeError as e:
                self._end(obs, info, "gave_up", str(e))
                continue
            if decision.subtask == "done":
                self._end(obs, info, "executor_done")
                continue
            if self.spec.completion_after_close:
                closing = closes_gui(decision.subtask)
                if self.closing and not closing:  # the policy's first step: the signal starts here too
                    self.completion.restart(obs, info)
                    self.over = 0
                self.closing = closing
            self.trace.append({"invocation": self.invocations, "subtask": self.current.label,
                               "task": self.current.task, "instruction": self.instruction,
                               "check": int(self.complete)})  # this step's (``_start`` or ``_ended``)
            self.inv_steps += 1
            self.t += 1
            self.last_action = decision.action
            if len(self.series["completion"]) < self.t:
                self.series["completion"].append(None)
            return decision
        raise RuntimeError("the harness ended and restarted invocations without acting")

    def _own(self, action: dict[str, Any], what: str) -> Decision:
        """One step of the harness's own motion (``what``: unstick, walk_back): in the trace as invocation
        -1 (no detector unit)."""
        self.trace.append({"invocation": -1, "subtask": what, "task": "", "instruction": "", "check": 0})
        self.t += 1
        if len(self.series["completion"]) < self.t:  # (a stall's step has its query already)
            self.series["completion"].append(None)
        return Decision(action=action, subtask=what, text=what)

    def label_records(self, records: Sequence[StepRecord]) -> list[StepRecord]:
        """The episode's records with ``metadata["harness"]`` on each step the harness acted (the last
        record, the frame after the last action, has none): the invocation's number in the episode, its
        subtask's label and atomic task, the instruction the executor was told at its start, and ``check``,
        1 where the subtask's completion check held on that record's frame. ``detector.data`` makes one
        completion unit of each invocation, from its own first frame."""
        if len(records) < len(self.trace):
            raise ValueError(f"label_records: {len(records)} records for {len(self.trace)} steps acted (not "
                             f"this episode's records?)")
        return [dataclasses.replace(r, metadata={**r.metadata, "harness": dict(self.trace[i])})
                if i < len(self.trace) else r for i, r in enumerate(records)]

    def summary(self) -> dict[str, Any]:
        """Counts of planner calls (their seconds and tokens), retries, failures, recoveries, replans,
        advances, invocations, and the completion signal's handoffs: ``early_handoffs`` (it ended an
        invocation whose check did not hold) and ``handoff_delay`` (the mean steps from the check first
        holding to the signal's stop, over the rest)."""
        d, cost = self.handoff_delays, self.planner_cost
        return dict(self.counts, invocations=self.invocations,
                    handoff_delay=round(float(np.mean(d)), 2) if d else 0.0,
                    planner_seconds=round(cost["seconds"], 3), planner_prompt_tokens=cost["prompt_tokens"],
                    planner_completion_tokens=cost["completion_tokens"])
