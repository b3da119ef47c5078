"""The long-horizon suite: the harness on long-horizon Luanti tasks with injected failures, per executor
(the scripted experts, the harness's upper bound, and a trained policy), plus the policy given only the
final goal as the baseline; final-goal success and diagnostic progress (fraction of the task's subgoals
verified; 1 on success).

``run_suite(spec, planner)`` writes per episode ``episodes/<executor>/<task>-<seed>.json`` (the result,
the harness's counts, the memory JSON, the events, the injections that fired), an HTML report (with the
planner calls, verifications and memory snapshots as events and the completion signal as a series) for
the first ``reports`` episodes of each task and executor, the procedural memory shared across episodes
(``procedural.json``) and ``summary.json``. An episode whose game failed is retried once on a fresh game.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from histeve_jax.envs.tasks import load_task
from histeve_jax.eval.rollout import EpisodeResult, run_episode
from histeve_jax.harness.controller import HarnessAgent, HarnessSpec
from histeve_jax.harness.inject import FailureInjector, standard_injections
from histeve_jax.harness.memory import ProceduralMemory
from histeve_jax.harness.schemas import load_schemas

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class SuiteSpec:
    """What to run."""

    tasks: tuple[str, ...]
    episodes: int
    seed: int
    executors: tuple[str, ...] = ("expert",)  # expert | policy
    policy: str = ""  # a run's workdir, for the policy executor
    step: int | None = None
    greedy: bool = False
    temperature: float = 1.0
    inject: bool = True
    max_steps: int = 0  # per episode; 0: the task's budget
    policy_max_steps: int = 2000
    obs_size: tuple[int, int] = (56, 56)
    out_dir: str = "/tmp/histeve_runs/longhorizon"
    reports: int = 1
    env: dict[str, Any] = dataclasses.field(default_factory=dict)
    harness: HarnessSpec = HarnessSpec()


def check(spec: SuiteSpec) -> None:
    """Raise ValueError/FileNotFoundError naming bad input before any game starts."""
    for t in spec.tasks:
        if load_task(t).category != "long_horizon":
            raise ValueError(f"task {t!r} is not a long-horizon task")
    bad = set(spec.executors) - {"expert", "policy"}
    if bad:
        raise ValueError(f"executors: unknown {sorted(bad)}; choose expert and/or policy")
    if "policy" in spec.executors and not spec.policy:
        raise ValueError("the policy executor needs policy=<a run's workdir>")
    if spec.episodes < 1:
        raise ValueError(f"episodes must be >= 1, got {spec.episodes}")


def _episode_json(res: EpisodeResult, agent: Any, fired: list) -> dict[str, Any]:
    out = {k: v for k, v in dataclasses.asdict(res).items() if k != "records"}
    if isinstance(agent, HarnessAgent):
        out.update(harness=agent.summary(), memory=agent.memory.to_json(), events=agent.events)
    out["injected"] = fired
    return out


def _run(env: FailureInjector, task: Any, seed: int, agent: Any, max_steps: int,
         inject: bool) -> EpisodeResult:
    env.set_injections(standard_injections(task, seed) if inject else [])
    res = run_episode(env, task, seed, agent, max_steps=max_steps)
    if res.interrupted:  # the game failed: once more on a fresh game (the next reset restarts it)
        log.warning("%s seed %d interrupted (%s); retrying", task.name, seed, res.error)
        res = run_episode(env, task, seed, agent, max_steps=max_steps)
    return res


def run_suite(spec: SuiteSpec, planner: Any, on_episode: Callable[[dict[str, Any]], None] | None = None
              ) -> dict[str, Any]:
    """Run every (executor, task, seed) episode; returns the summary (see the module docstring).
    ``on_episode`` is called with each episode's summary row as it finishes."""
    from histeve_jax.envs import make
    from histeve_jax.eval.report import write_report

    check(spec)
    os.makedirs(spec.out_dir, exist_ok=True)
    schemas = load_schemas()
    proc_path = os.path.join(spec.out_dir, "procedural.json")
    procedural = ProceduralMemory.load(proc_path)
    executors: dict[str, Any] = {}
    if "expert" in spec.executors:
        from histeve_jax.harness.executors import ExpertExecutor

        executors["expert"] = ExpertExecutor()
    if "policy" in spec.executors:
        from histeve_jax.eval.policy_agent import load_run
        from histeve_jax.harness.executors import PolicyExecutor

        executors["policy"] = PolicyExecutor(load_run(spec.policy, spec.step), greedy=spec.greedy,
                                             temperature=spec.temperature)
    env = FailureInjector(make("luanti", obs_size=tuple(spec.obs_size), **spec.env), [])
    rows: list[dict[str, Any]] = []
    try:
        for ex_name, executor in executors.items():
            runs = [(ex_name, HarnessAgent(planner, executor, schemas, spec.harness, procedural))]
            if ex_name == "policy":
                from histeve_jax.harness.executors import GoalOnlyAgent

                runs.append(("policy_goal_only", GoalOnlyAgent(executor)))
            for task_name in spec.tasks:
                task = load_task(task_name)
                budget = spec.max_steps or (task.max_steps if ex_name == "expert" else spec.policy_max_steps)
                for i in range(spec.episodes):
                    for label, agent in runs:
                        res = _run(env, task, spec.seed + i, agent, budget, spec.inject)
                        row = _episode_json(res, agent, env.fired)
                        row["executor"] = label
                        d = os.path.join(spec.out_dir, "episodes", label)
                        os.makedirs(d, exist_ok=True)
                        with open(os.path.join(d, f"{task_name}-{spec.seed + i}.json"), "w") as f:
                            json.dump(row, f, indent=1, default=str)
                        if i < spec.reports and res.records:
                            is_h = isinstance(agent, HarnessAgent)
                            write_report(res.records, os.path.join(spec.out_dir, "reports", label,
                                                                   f"{task_name}-{spec.seed + i}.html"),
                                         title=f"{task_name} seed {spec.seed + i}: {agent.name}",
                                         summary={"success": res.success, "progress": res.progress,
                                                  "steps": res.steps, **(agent.summary() if is_h else {})},
                                         series=agent.series if is_h else None,
                                         thresholds={"completion": spec.harness.threshold} if is_h else None,
                                         events=agent.events if is_h else ())
                        rows.append({"executor": label, "task": task_name, "seed": spec.seed + i,
                                     "success": res.success, "progress": res.progress, "steps": res.steps,
                                     "seconds": round(res.seconds, 1), "interrupted": res.interrupted,
                                     "error": res.error, **(row.get("harness") or {})})
                        if on_episode is not None:
                            on_episode(rows[-1])
                procedural.save(proc_path)
    finally:
        env.close()
    summary = {"rows": rows, "by_executor": summarize(rows), "out_dir": spec.out_dir}
    with open(os.path.join(spec.out_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    return summary


def summarize(rows: Sequence[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per executor: goal success and mean progress over the episodes that were not interrupted."""
    out = {}
    for ex in sorted({r["executor"] for r in rows}):
        ok = [r for r in rows if r["executor"] == ex and not r["interrupted"]]
        cut = sum(r["executor"] == ex and r["interrupted"] for r in rows)
        out[ex] = {"episodes": len(ok), "interrupted": cut,
                   "goal_success": float(np.mean([r["success"] for r in ok])) if ok else float("nan"),
                   "progress": float(np.mean([r["progress"] for r in ok])) if ok else float("nan")}
    return out
