"""The long-horizon suite: the harness on long-horizon Luanti tasks with injected failures, per executor
(the scripted experts, the harness's upper bound, and a trained policy), plus the policy given only the
final goal as the baseline; final-goal success and diagnostic progress (fraction of the task's subgoals
verified; 1 on success).

``run_suite(spec, planner)`` writes per episode ``episodes/<executor>/<task>-<seed>.json`` (the result,
the harness's counts, the memory JSON, the events, the injections that fired), an HTML report (with the
planner calls, verifications and memory snapshots as events and the completion signal as a series) for
the first ``reports`` episodes of each task and executor, the procedural memory shared across episodes
(``procedural.json``) and ``summary.json`` (per row, and per row and task: goal success with its Wilson
interval, progress, and the harness's means: invocations, replans, early handoffs, handoff delay, planner
seconds and tokens). An episode whose game failed is retried once on the same seed on a fresh game, the
procedural memory it wrote discarded. The policy's invocations end by the trained detector when
``detector`` names a run (``harness.completion``), by the privileged check otherwise, or both as two rows
(``completion``); ``resume`` reads back the episodes an earlier run of the same ``out_dir`` played (one
whose game failed twice, a policy row's episode played at another sampling, or the detector row's with
another detector run, is played again). With ``records`` each episode's records are written too
(``records/<row>/<task>-<seed>-00000.array_record``), a harness row's labelled per invocation
(``HarnessAgent.label_records``); with ``privileged_after`` the policy's invocations the privileged check
ends run that many steps past completion: together, the completion detector's harness episodes.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from histeve_jax.envs.tasks import load_task
from histeve_jax.eval.evaluate import sampling_settings
from histeve_jax.eval.rollout import EpisodeResult, run_episode
from histeve_jax.harness.controller import HarnessAgent, HarnessSpec, PrivilegedCompletion
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
    top_p: float = 1.0  # the policy's nucleus (1: the whole distribution)
    inject: bool = True
    max_steps: int = 0  # per episode; 0: the task's budget
    policy_max_steps: int = 2000
    obs_size: tuple[int, ...] = ()  # (H, W) of the frames; (): the policy run's image size, else 56x56
    out_dir: str = "/tmp/histeve_runs/longhorizon"
    reports: int = 1
    env: dict[str, Any] = dataclasses.field(default_factory=dict)
    harness: HarnessSpec = HarnessSpec()
    # How the policy's invocations end (``harness.completion``): "auto" (the detector when one is given, else
    # the privileged check), "detector", "privileged", or "both" (a row each: "policy" with the detector,
    # "policy_privileged" with the check). The experts' invocations end on the privileged check.
    detector: str = ""  # a detector run trained beside ``policy`` (experiments.detector's run_x<n>)
    detector_every: int = 2  # query the detector every k steps
    # The detector's threshold for every subtask: 0 (default), its run's loop threshold (and per-task ones)
    detector_threshold: float = 0.0
    completion: str = "auto"
    goal_only: bool = True  # also the policy given only the final goal ("policy_goal_only")
    resume: bool = False  # an episode already played under out_dir is read back, not played again
    # Also write each episode's records (``records/<row>/<task>-<seed>-00000.array_record``; a harness
    # row's labelled by ``HarnessAgent.label_records``: the completion detector's invocation units)
    records: bool = False
    # The policy rows' privileged check reads 1 only once it has held this many steps more
    # (``PrivilegedCompletion.after``): the policy acts on past each subtask's completion, as recorded
    privileged_after: int = 0


COMPLETIONS = ("auto", "detector", "privileged", "both")


def policy_completion(spec: SuiteSpec) -> str:
    """The policy rows' completion signal, "auto" resolved."""
    return ("detector" if spec.detector else "privileged") if spec.completion == "auto" else spec.completion


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
    if spec.completion not in COMPLETIONS:
        raise ValueError(f"completion: unknown {spec.completion!r}; choose one of {COMPLETIONS}")
    if policy_completion(spec) in ("detector", "both"):
        if "policy" not in spec.executors:
            raise ValueError("a detector reads the policy: it needs the policy executor")
        if not spec.detector:
            raise ValueError(f"completion={spec.completion!r} needs detector=<a detector run>")
        if not os.path.isdir(spec.detector):
            raise FileNotFoundError(f"detector={spec.detector}: no such directory")
    if spec.detector_every < 1:
        raise ValueError(f"detector_every must be >= 1, got {spec.detector_every}")
    if not 0.0 <= spec.detector_threshold < 1.0:
        raise ValueError(f"detector_threshold must be in [0, 1) (0: the run's loop threshold), got "
                         f"{spec.detector_threshold}")
    if spec.privileged_after < 0:
        raise ValueError(f"privileged_after must be >= 0, got {spec.privileged_after}")
    sampling_settings(spec.greedy, spec.temperature, spec.top_p, "long-horizon suite")


def _episode_json(res: EpisodeResult, agent: Any, fired: list) -> dict[str, Any]:
    out = {k: v for k, v in dataclasses.asdict(res).items() if k != "records"}
    if isinstance(agent, HarnessAgent):
        out.update(harness=agent.summary(), memory=agent.memory.to_json(), events=agent.events)
    out["injected"] = fired
    return out


def _run(env: FailureInjector, task: Any, seed: int, agent: Any, max_steps: int, inject: bool,
         procedural: ProceduralMemory | None = None) -> EpisodeResult:
    """One episode; a game that failed mid-episode is retried once on the same seed (a fresh game), and
    what the interrupted attempt wrote into the shared procedural memory is discarded, not merged."""
    kept = copy.deepcopy(procedural.entries) if procedural is not None else None
    for attempt in range(2):
        env.set_injections(standard_injections(task, seed) if inject else [])
        res = run_episode(env, task, seed, agent, max_steps=max_steps)
        if not res.interrupted:
            break
        if procedural is not None:
            procedural.entries = copy.deepcopy(kept)
        if attempt == 0:  # the next reset restarts the game
            log.warning("%s seed %d interrupted (%s); retrying", task.name, seed, res.error)
    return res


# What an episode file written before a provenance key existed was played with: the default sampling, no
# time past completion, the detector watching from the invocation's first step (before stop 52); a file
# without its policy or detector run is played again.
LEGACY_PROVENANCE = {"sampling": sampling_settings(False, 1.0, 1.0, "default"), "privileged_after": 0,
                     "completion_after_close": False}


def provenance(spec: SuiteSpec, label: str) -> dict[str, Any]:
    """What a row's episode was played with, written into its episode file and compared by ``resume``: for
    the policy rows the policy run (its absolute path, ``@step`` where a step is chosen) and the sampling;
    for the row the detector ends its detector run (absolute path) and whether it watched from the policy's
    first step (``HarnessSpec.completion_after_close``); for the rows the privileged check ends
    ``privileged_after``. The experts' rows: nothing."""
    if not label.startswith("policy"):
        return {}
    out: dict[str, Any] = {
        "policy": os.path.abspath(spec.policy) + (f"@{spec.step}" if spec.step is not None else ""),
        "sampling": sampling_settings(spec.greedy, spec.temperature, spec.top_p, "long-horizon suite")}
    completion = policy_completion(spec)
    if label == "policy" and completion in ("detector", "both"):
        out["detector"] = os.path.abspath(spec.detector)
        out["completion_after_close"] = spec.harness.completion_after_close
        if spec.detector_threshold > 0:
            out["detector_threshold"] = spec.detector_threshold
    if label == "policy_privileged" or (label == "policy" and completion == "privileged"):
        out["privileged_after"] = spec.privileged_after
    return out


def _finished(path: str, expected: dict[str, Any]) -> dict[str, Any] | None:
    """The episode JSON at ``path`` if an earlier run played that episode (not one its game cut short) with
    the same ``provenance`` (a key the file lacks reads as ``LEGACY_PROVENANCE`` says, or differs)."""
    if not os.path.exists(path):
        return None
    with open(path) as f:
        row = json.load(f)
    if row.get("interrupted"):
        return None
    if any(row.get(k, LEGACY_PROVENANCE.get(k)) != v for k, v in expected.items()):
        return None
    return row


def episode_shards(out_dir: str, label: str, name: str) -> list[str]:
    """The shards ``write_records`` wrote for episode ``name`` of row ``label`` ([] when none)."""
    from histeve_jax.data import records as R

    d = os.path.join(out_dir, "records", label)
    return R.shard_paths(d, prefix=name) if os.path.isdir(d) else []


def write_records(out_dir: str, label: str, name: str, records: Sequence[Any]) -> str:
    """One episode's records as their own shard ``out_dir/records/<label>/<name>-00000.array_record``,
    replacing that episode's earlier shard (one played again); returns its path."""
    from histeve_jax.data import records as R

    for old in episode_shards(out_dir, label, name):
        os.remove(old)
    return R.write_episodes(os.path.join(out_dir, "records", label), [records], prefix=name)[0]


def _summary_row(row: dict[str, Any], label: str, task: str, seed: int) -> dict[str, Any]:
    """An episode's row of the summary, from its episode JSON."""
    return {"executor": label, "task": task, "seed": seed, "success": bool(row["success"]),
            "progress": float(row["progress"]), "steps": int(row["steps"]),
            "seconds": round(float(row["seconds"]), 1), "interrupted": bool(row["interrupted"]),
            "error": row["error"], **(row.get("harness") or {})}


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
    detector, obs_size = None, tuple(spec.obs_size) or (56, 56)
    if "policy" in spec.executors:
        from histeve_jax.eval.policy_agent import load_run
        from histeve_jax.harness.executors import PolicyExecutor

        loaded = load_run(spec.policy, spec.step)
        executors["policy"] = PolicyExecutor(loaded, greedy=spec.greedy, temperature=spec.temperature,
                                             top_p=spec.top_p)
        obs_size = tuple(spec.obs_size) or tuple(loaded.config.image_size)
        if policy_completion(spec) in ("detector", "both"):
            from histeve_jax.harness.completion import load_detector_completion

            detector = load_detector_completion(spec.detector, loaded, spec.policy, every=spec.detector_every)
            if spec.detector_threshold > 0:
                detector.threshold, detector.thresholds = spec.detector_threshold, {}
    env = FailureInjector(make("luanti", obs_size=obs_size, **spec.env), [])
    rows: list[dict[str, Any]] = []
    try:
        for ex_name, executor in executors.items():
            check_signal = PrivilegedCompletion(spec.privileged_after if ex_name == "policy" else 0)
            runs = [(ex_name, HarnessAgent(planner, executor, schemas, spec.harness, procedural,
                                           completion=detector if ex_name == "policy" and detector
                                           else check_signal))]
            if ex_name == "policy" and policy_completion(spec) == "both":
                runs.append(("policy_privileged", HarnessAgent(planner, executor, schemas, spec.harness,
                                                               procedural, completion=check_signal)))
            if ex_name == "policy" and spec.goal_only:
                from histeve_jax.harness.executors import GoalOnlyAgent

                runs.append(("policy_goal_only", GoalOnlyAgent(executor)))
            for task_name in spec.tasks:
                task = load_task(task_name)
                budget = spec.max_steps or (task.max_steps if ex_name == "expert" else spec.policy_max_steps)
                for i in range(spec.episodes):
                    for label, agent in runs:
                        name = f"{task_name}-{spec.seed + i}"
                        d = os.path.join(spec.out_dir, "episodes", label)
                        path = os.path.join(d, f"{name}.json")
                        played_with = provenance(spec, label)
                        row = _finished(path, played_with) if spec.resume else None
                        if row is not None and spec.records and not episode_shards(spec.out_dir, label, name):
                            row = None  # played without its records: again
                        if row is not None:  # played to the end by an earlier run: read back
                            rows.append(_summary_row(row, label, task_name, spec.seed + i))
                            if on_episode is not None:
                                on_episode(rows[-1])
                            continue
                        res = _run(env, task, spec.seed + i, agent, budget, spec.inject, procedural)
                        if spec.records and res.records:  # before the episode's JSON: resume reads that
                            write_records(spec.out_dir, label, name, agent.label_records(res.records)
                                          if isinstance(agent, HarnessAgent) else res.records)
                        row = _episode_json(res, agent, env.fired)
                        row["executor"] = label
                        row.update(played_with)
                        os.makedirs(d, exist_ok=True)
                        with open(path + ".tmp", "w") as f:
                            json.dump(row, f, indent=1, default=str)
                        os.replace(path + ".tmp", path)
                        if i < spec.reports and res.records:
                            is_h = isinstance(agent, HarnessAgent)
                            write_report(res.records, os.path.join(spec.out_dir, "reports", label,
                                                                   f"{task_name}-{spec.seed + i}.html"),
                                         title=f"{task_name} seed {spec.seed + i}: {agent.name}",
                                         summary={"success": res.success, "progress": res.progress,
                                                  "steps": res.steps, **(agent.summary() if is_h else {})},
                                         series=agent.series if is_h else None,
                                         thresholds={"completion": agent.completion.threshold}
                                         if is_h else None,
                                         events=agent.events if is_h else ())
                        rows.append(_summary_row(row, label, task_name, spec.seed + i))
                        if on_episode is not None:
                            on_episode(rows[-1])
                procedural.save(proc_path)
    finally:
        env.close()
    summary = {"rows": rows, "by_executor": summarize(rows), "by_task": summarize(rows, ("executor", "task")),
               "out_dir": spec.out_dir}
    with open(os.path.join(spec.out_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    return summary


MEANS = ("invocations", "replans", "recoveries", "early_handoffs", "handoff_delay", "planner_calls",
         "planner_seconds", "planner_prompt_tokens", "planner_completion_tokens")


def summarize(rows: Sequence[dict[str, Any]], by: Sequence[str] = ("executor",)) -> dict[str, dict[str, Any]]:
    """Per executor (or per ``by`` fields, joined with "/"), over the episodes that were not interrupted:
    goal success with its Wilson interval, mean progress, and the harness's per-episode means (``MEANS``)."""
    from histeve_jax.eval.evaluate import wilson_interval

    out: dict[str, dict[str, Any]] = {}
    key = lambda r: "/".join(str(r[b]) for b in by)
    for k in sorted({key(r) for r in rows}):
        mine = [r for r in rows if key(r) == k]
        ok = [r for r in mine if not r["interrupted"]]
        wins = sum(bool(r["success"]) for r in ok)
        lo, hi = wilson_interval(wins, len(ok)) if ok else (float("nan"), float("nan"))
        out[k] = {"episodes": len(ok), "interrupted": len(mine) - len(ok), "successes": wins,
                  "goal_success": wins / len(ok) if ok else float("nan"), "wilson": [lo, hi],
                  "progress": float(np.mean([r["progress"] for r in ok])) if ok else float("nan")}
        for m in MEANS:
            vals = [r[m] for r in ok if m in r]
            if vals:
                out[k][m] = float(np.mean(vals))
    return out
