"""The two Minecraft suites on our MineStudio backend: their episode runner and per-task summary.

* ``minestudio_bench``: MineStudio Bench tasks (the installed package's ``task_configs/{simple,hard}``), each
  episode played to its step budget (600 by default) and rated afterwards by the VLM judge (``vlm_judge``)
  from frames of the episode; without a configured judge the episodes run and are reported unjudged.
* ``openha``: OpenHA-style tasks with reward events; success = any reward > 0 (``MinecraftBenchTask``),
  the episode stopping there, 400 steps by default.

Episodes go through ``eval.rollout.run_episode`` on ``envs.make("minestudio")``, one game for the whole run.
Each is written in the record schema (``kind="eval"``, ``<out>/records/<split>/<task>/``) with an HTML report
(video and timeline, ``<out>/reports/``). An exception out of the game interrupts the episode: it is retried
on a fresh game with the same seed up to ``retries`` times, then counted as interrupted (no verdict).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from histeve_jax.eval.rollout import AgentFactory, EpisodeResult, run_episode
from histeve_jax.eval.suites.minecraft_tasks import (
    BENCH_MAX_STEPS,
    OPENHA_MAX_STEPS,
    SPLITS,
    MinecraftBenchTask,
    list_bench_tasks,
    list_openha_tasks,
    load_bench_task,
    load_openha_task,
)
from histeve_jax.eval.suites.vlm_judge import Judgement, JudgeSpec, VLMJudge, judgement_dict, mean_scores

log = logging.getLogger(__name__)
SUITES = ("minestudio_bench", "openha")


@dataclasses.dataclass(frozen=True)
class SuiteSpec:
    """One suite run. ``tasks``: Bench entries are a split, ``split/name`` or a name in one split; OpenHA
    entries are shipped names or YAML paths; empty means every task of the suite."""

    suite: str
    tasks: tuple[str, ...] = ()
    episodes: int = 1
    seed: int = 1000  # held-out seeds seed, seed + 1, ... (the recorder's training seeds start at 0)
    max_steps: int = 0  # 0: the task's (Bench 600, OpenHA 400)
    obs_size: tuple[int, int] = (224, 224)
    out_dir: str = "/tmp/histeve_runs/minecraft_bench"
    reports: bool = True
    retries: int = 1
    judge: JudgeSpec = JudgeSpec()

    def __post_init__(self) -> None:
        if self.suite not in SUITES:
            raise ValueError(f"suite: unknown suite {self.suite!r}; expected one of {list(SUITES)}")
        if self.episodes < 1 or self.max_steps < 0 or self.retries < 0:
            raise ValueError(f"episodes ({self.episodes}) must be >= 1, max_steps ({self.max_steps}) and "
                             f"retries ({self.retries}) >= 0")

    @classmethod
    def from_config(cls, c: Mapping[str, Any]) -> SuiteSpec:
        """The spec from an ``experiments/configs/minecraft_bench.py`` config (its keys are these fields)."""
        judge = JudgeSpec(**{f.name: c["judge"][f.name] for f in dataclasses.fields(JudgeSpec)
                             if f.name in c["judge"]})
        names = [f.name for f in dataclasses.fields(cls) if f.name != "judge" and f.name in c]
        kw = {n: c[n] for n in names}
        kw["tasks"] = tuple(kw.get("tasks", ()))
        kw["obs_size"] = tuple(int(v) for v in kw.get("obs_size", (224, 224)))
        return cls(judge=judge, **kw)


def resolve_tasks(spec: SuiteSpec) -> list[MinecraftBenchTask]:
    """The spec's tasks, loaded and checked (TaskError naming the bad one), with ``max_steps`` applied."""
    if spec.suite == "minestudio_bench":
        entries = list(spec.tasks) or list(SPLITS)
        tasks = []
        for e in entries:
            names = [f"{e}/{n}" for n in list_bench_tasks(e)] if e in SPLITS else [e]
            tasks += [load_bench_task(n, max_steps=BENCH_MAX_STEPS) for n in names]
    else:
        tasks = [load_openha_task(n, max_steps=OPENHA_MAX_STEPS) for n in (list(spec.tasks) or
                                                                          list_openha_tasks())]
    if spec.max_steps:
        tasks = [dataclasses.replace(t, max_steps=spec.max_steps) for t in tasks]
    return tasks


@dataclasses.dataclass
class SuiteEpisode:
    """One episode's verdict: OpenHA's success, or Bench's judgement (None when unjudged)."""

    task: str  # the task's key (split/name)
    seed: int
    agent: str
    episode_id: str
    steps: int
    success: bool
    interrupted: bool
    error: str
    rewards_paid: list[str]
    judgement: Judgement | None = None
    report: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "judgement": judgement_dict(self.judgement)}


def episode_verdict(task: MinecraftBenchTask, result: EpisodeResult) -> SuiteEpisode:
    """The suite's reading of a finished episode (before judging)."""
    success, error = result.success, result.error
    # the last record holds the info after the last action; its events are the counters since reset
    paid = task.rewards_paid(result.records[-1].events) if task.rewards and result.records else []
    if success and task.rewards and result.steps == 0:
        # the counters start at 0 after reset; a reward before any action means the init paid it (or the
        # game kept counting from an earlier episode), which is no success of the agent's
        success = False
        error = (f"reward events {paid} already paid at reset, before any action: the init commands gave "
                 "the item or the game's counters did not restart")
    return SuiteEpisode(task=task.key, seed=result.seed, agent=result.agent, episode_id=result.episode_id,
                        steps=result.steps, success=bool(success), interrupted=result.interrupted,
                        error=error, rewards_paid=paid)


def summarize(suite: str, episodes: Sequence[SuiteEpisode]) -> dict[str, dict[str, Any]]:
    """Per task: counts (episodes, interrupted) and OpenHA's success rate or Bench's judged mean scores."""
    out: dict[str, dict[str, Any]] = {}
    for key in dict.fromkeys(e.task for e in episodes):
        eps = [e for e in episodes if e.task == key]
        done = [e for e in eps if not e.interrupted]
        row: dict[str, Any] = {"episodes": len(eps), "interrupted": len(eps) - len(done),
                               "mean_steps": float(np.mean([e.steps for e in done])) if done else None}
        if suite == "openha":
            k = sum(e.success for e in done)
            row.update(successes=k, success_rate=k / len(done) if done else None)
        else:
            js = [e.judgement for e in done if e.judgement is not None]
            ok = [j for j in js if j.ok]
            row.update(judged=len(ok), judge_errors=len(js) - len(ok), unjudged=len(done) - len(js),
                       score=float(np.mean([j.score for j in ok])) if ok else None,
                       criteria=mean_scores(ok))
        out[key] = row
    return out


def format_table(suite: str, per_task: Mapping[str, Mapping[str, Any]]) -> str:
    """A plain-text table of ``summarize``'s rows."""
    fmt = lambda v: "-" if v is None else (f"{v:.2f}" if isinstance(v, float) else str(v))
    cols = (["episodes", "interrupted", "successes", "success_rate", "mean_steps"] if suite == "openha" else
            ["episodes", "interrupted", "judged", "judge_errors", "unjudged", "score", "mean_steps"])
    width = max([len(k) for k in per_task] + [4])
    row = lambda name, cells: f"{name:<{width}}  " + "  ".join(f"{c:>12}" for c in cells)
    body = [row(k, [fmt(r.get(c)) for c in cols]) for k, r in per_task.items()]
    return "\n".join([row("task", cols), *body])


# ---------------------------------------------------------------------------------------------- the run


def _write_outputs(spec: SuiteSpec, task: MinecraftBenchTask, result: EpisodeResult,
                   ep: SuiteEpisode) -> None:
    from histeve_jax.data.records import write_episodes
    from histeve_jax.eval.report import write_report

    write_episodes(os.path.join(spec.out_dir, "records", task.key), [result.records], prefix=ep.episode_id)
    if not spec.reports:
        return
    j = ep.judgement
    summary = {"suite": spec.suite, "seed": ep.seed, "success": ep.success, "rewards_paid": ep.rewards_paid,
               "score": None if j is None else j.score, "judge_error": "" if j is None else j.error}
    events = [] if j is None or not j.ok else [
        {"step": len(result.records) - 1, "kind": "judge", "title": f"VLM rating {j.score:.2f}",
         "payload": {"scores": j.scores, "evidence": j.evidence}}]
    path = os.path.join(spec.out_dir, "reports", task.key, f"{ep.episode_id}.html")
    ep.report = write_report(result.records, path, title=f"{spec.suite}: {task.key} seed {ep.seed}",
                             summary=summary, events=events)


def finish_episode(spec: SuiteSpec, task: MinecraftBenchTask, result: EpisodeResult,
                   judge: VLMJudge | None) -> SuiteEpisode:
    """The verdict on a played episode, its judgement (Bench, with a judge), its records and report."""
    ep = episode_verdict(task, result)
    if judge is not None and not ep.interrupted:
        ep.judgement = judge.rate(task.name, [r.frame for r in result.records])
    if result.records:
        _write_outputs(spec, task, result, ep)
    return ep


def _play(env: Any, make_env: Callable[[], Any], task: MinecraftBenchTask, seed: int,
          make_agent: AgentFactory, retries: int) -> tuple[Any, EpisodeResult]:
    """One episode, retried on a fresh game (same seed) while the game fails; returns (the game, result)."""
    for attempt in range(retries + 1):
        try:
            result = run_episode(env, task.for_seed(seed), seed, make_agent(task.name, seed), kind="eval",
                                 backend="minestudio")
        except Exception as e:  # the game died under us (MinecraftSim raises its own errors): no verdict
            log.warning("%s seed %d: the game failed (attempt %d): %s", task.key, seed, attempt + 1, e,
                        exc_info=True)
            result = EpisodeResult(task=task.name, seed=seed, agent="", episode_id="", success=False, steps=0,
                                   interrupted=True, error=f"{type(e).__name__}: {e}", progress=0.0,
                                   records=[], seconds=0.0)
        if not result.interrupted:
            break
        try:
            env.close()
        except Exception as e:  # a crashed game may not close cleanly; a fresh one replaces it anyway
            log.warning("closing the failed game: %s", e)
        env = make_env()
    return env, result


def _line(suite: str, ep: SuiteEpisode) -> str:
    if ep.interrupted:
        return f"{ep.task} seed {ep.seed}: interrupted ({ep.error})"
    if suite == "openha":
        return f"{ep.task} seed {ep.seed}: success={ep.success} steps={ep.steps}"
    j = ep.judgement
    verdict = "unjudged" if j is None else (f"score={j.score:.2f}" if j.ok else f"judge error: {j.error}")
    return f"{ep.task} seed {ep.seed}: steps={ep.steps} {verdict}"


def run_suite(spec: SuiteSpec, make_agent: AgentFactory, make_env: Callable[[], Any],
              tasks: Sequence[MinecraftBenchTask] | None = None,
              progress: Callable[[str], None] = print) -> dict[str, Any]:
    """Run every task's episodes on one game from ``make_env()`` (rebuilt after a crash); returns the
    summary, also written to ``<out_dir>/summary.json``."""
    tasks = list(tasks) if tasks is not None else resolve_tasks(spec)
    judge, judge_note = None, ""
    if spec.suite == "minestudio_bench":
        judge_note = spec.judge.missing()
        if judge_note:
            progress(f"VLM judge skipped: {judge_note}")
        else:
            judge = VLMJudge(spec.judge)
    os.makedirs(spec.out_dir, exist_ok=True)
    env = make_env()
    episodes: list[SuiteEpisode] = []
    try:
        for task in tasks:
            for seed in range(spec.seed, spec.seed + spec.episodes):
                env, result = _play(env, make_env, task, seed, make_agent, spec.retries)
                ep = finish_episode(spec, task, result, judge)
                episodes.append(ep)
                progress(_line(spec.suite, ep))
    finally:
        env.close()
    summary = {"suite": spec.suite, "judge": judge_note if judge is None else f"{judge.spec.model} at "
               f"{judge.where}", "seeds": list(range(spec.seed, spec.seed + spec.episodes)),
               "tasks": summarize(spec.suite, episodes), "episodes": [e.as_dict() for e in episodes],
               "out_dir": spec.out_dir}
    with open(os.path.join(spec.out_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1, default=str)
    return summary
