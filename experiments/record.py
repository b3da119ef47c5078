"""Record scripted-expert episodes into the project's record format (ArrayRecord shards of StepRecords).

    python -m experiments.record --config=experiments/configs/record.py --workdir=DIR [--config.x=y ...]

Each step stores the frame the expert saw, the env-format action it took, the regime (``is_gui_open``), the
cursor, the cumulative event counters, the expert's subtask name (boundaries are where it changes), the
instruction and the task id; ``completed`` is 1 on frames where the task's success check already holds (the
completion detector's label). The episode ends with the frame after the last action, stored with a no-op
action and ``done=True`` (the records are ``eval.rollout``'s, with kind "demo"). Writes ``summary.json``
(per-task expert success rates) and ``config.json``. With ``--config.instances=N > 1`` the episodes run on N
games in parallel (``eval.fleet``, on a local Ray), and are written in the same order as with one game.
``--config.perturb=p``: the mining expert looks off its target first at a chance p per aim, and throws its
view off once in a dig (``Expert.aim_off``, ``jolt``); the crafting expert, as the inventory opens and before
each pick and the output, clicks where nothing happens first (``Expert.click_astray``); those steps are
recorded with subtask "perturb" and never imitated, so what follows them demonstrates the way back.
"""

from __future__ import annotations

import functools
import json
import os

import numpy as np
from absl import app, flags, logging
from tqdm import tqdm

from experiments.config_cli import define_config, task_counts
from histeve_jax.data.records import ShardWriter, StepRecord
from histeve_jax.envs import load_task, make
from histeve_jax.envs.experts import expert_for
from histeve_jax.eval.rollout import EpisodeResult, ExpertAgent, expert_agent, run_episode

_CONFIGS = os.path.join(os.path.dirname(__file__), "configs")
define_config(os.path.join(_CONFIGS, "record.py"), "Recorder config.")
_WORKDIR = flags.DEFINE_string("workdir", None, "Output directory (records/, summary.json, config.json).")
MAX_ATTEMPTS = 3  # tries of an episode whose game crashed or hung


def _env_kwargs(cfg) -> dict:
    return {"obs_size": tuple(cfg.obs_size), "randomize_init": cfg.randomize_init,
            "fps_max": cfg.env.fps_max, "viewing_range": cfg.env.viewing_range}


def _run_kwargs(cfg) -> dict:
    return {"kind": "demo", "frame_format": cfg.frame_format, "jpeg_quality": cfg.jpeg_quality,
            "after_success": cfg.after_success}


def record_episode(env, task, seed: int, cfg) -> EpisodeResult:
    """Run the task's expert once from (seed, task) in ``env``; retried while the game crashes or hangs."""
    for _ in range(MAX_ATTEMPTS):
        result = run_episode(env, task, seed, ExpertAgent(cfg.perturb), backend=cfg.backend,
                             **_run_kwargs(cfg))
        if not result.interrupted:
            break
        logging.warning("%s seed %d: the game failed (%s); retrying", task.name, seed, result.error)
    return result


def _results(cfg, specs):
    """(task, seed) -> EpisodeResult for every spec, yielded in the order of ``specs`` whichever finished
    first: one game in this process, or ``cfg.instances`` games on a Ray fleet."""
    if cfg.instances <= 1:
        env = make(cfg.backend, **_env_kwargs(cfg))
        try:
            for task, seed in specs:
                yield record_episode(env, load_task(task), seed, cfg)
        finally:
            env.close()
        return
    from histeve_jax.eval.fleet import EpisodeSpec, Fleet

    with Fleet(cfg.instances, _env_kwargs(cfg), backend=cfg.backend, max_attempts=MAX_ATTEMPTS,
               run_kwargs=_run_kwargs(cfg)) as fleet:
        done: dict[tuple[str, int], EpisodeResult] = {}
        names = {t: load_task(t).name for t, _ in specs}  # a task given by its file's path
        order = iter((names[t], s) for t, s in specs)
        want = next(order, None)
        agents = functools.partial(expert_agent, perturb=cfg.perturb)
        for result in fleet.run([EpisodeSpec(t, s) for t, s in specs], agents):
            done[(result.task, result.seed)] = result
            while want is not None and want in done:  # write in spec order, holding only the out-of-order
                yield done.pop(want)
                want = next(order, None)


def episodes_by_task(cfg) -> dict[str, int]:
    """Episodes per task of cfg.tasks: cfg.episodes, except where cfg.task_episodes ("task=n,...") says."""
    return task_counts(cfg.tasks, cfg.episodes, cfg.get("task_episodes", ""), "--config.task_episodes")


def run(cfg, workdir: str) -> dict:
    """Record cfg.episodes episodes of each of cfg.tasks; returns the summary written to summary.json.

    Episodes are written in task order, then seed order, with one game or ``cfg.instances`` in parallel.
    Entry i of a task resets with seed ``cfg.seed + i``, counted on across entries of one name (a variant
    ``"mine_log[against=1]"`` or a task file's path after ``"mine_log"``).
    """
    os.makedirs(workdir, exist_ok=True)
    out_dir = cfg.output_dir or os.path.join(workdir, "records")
    with open(os.path.join(workdir, "config.json"), "w") as f:
        f.write(cfg.to_json_best_effort(indent=2))
    tasks = [load_task(n) for n in cfg.tasks]  # shipped names, or task files' paths
    for t in tasks:
        expert_for(t)  # fail before starting the game if a task has no expert
    episodes = episodes_by_task(cfg)  # by cfg.tasks' entries; the summary goes by task name, summing the
    counts: dict[str, int] = {}  # entries of one name (a shipped task and task files that vary its start)
    for entry, t in zip(cfg.tasks, tasks, strict=True):
        counts[t.name] = counts.get(t.name, 0) + episodes[entry]
    # the entries of one name take consecutive seeds (a variant's go on after the task's own): no seed of a
    # name is played twice
    specs, first = [], dict.fromkeys(counts, cfg.seed)
    for entry, t in zip(cfg.tasks, tasks, strict=True):
        specs += [(entry, first[t.name] + i) for i in range(episodes[entry])]
        first[t.name] += episodes[entry]
    stats = {t.name: {"ok": 0, "steps": [], "kept": 0, "interrupted": 0} for t in tasks}
    summary: dict = {"tasks": {}, "output_dir": out_dir}
    bar = tqdm(total=len(specs), disable=not cfg.progress_bar, desc="episodes")
    try:
        with ShardWriter(out_dir, prefix=f"{cfg.backend}-demo", records_per_shard=cfg.records_per_shard) as w:
            for result in _results(cfg, specs):
                s = stats[result.task]
                records: list[StepRecord] = result.records
                s["ok"] += result.success
                s["interrupted"] += result.interrupted
                s["steps"].append(len(records))
                if records and (result.success or cfg.keep_failed):
                    w.write_episode(records)
                    s["kept"] += 1
                bar.update(1)
                bar.set_postfix(task=result.task, success=f"{s['ok']}/{len(s['steps'])}")
        for name, s in stats.items():
            summary["tasks"][name] = {"episodes": counts[name], "successes": s["ok"], "kept": s["kept"],
                                      "interrupted": s["interrupted"],
                                      "success_rate": s["ok"] / max(counts[name], 1),
                                      "mean_steps": float(np.mean(s["steps"])) if s["steps"] else 0.0}
            logging.info("%s: %d/%d expert successes", name, s["ok"], counts[name])
        summary["shards"] = w.paths
    finally:
        bar.close()
    with open(os.path.join(workdir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    for name, s in summary["tasks"].items():
        print(f"{name}: success_rate={s['success_rate']:.2f} ({s['successes']}/{s['episodes']}) "
              f"mean_steps={s['mean_steps']:.0f}")
    return summary


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    cfg = flags.FLAGS.config
    run(cfg, _WORKDIR.value or "/tmp/histeve_runs/record")


if __name__ == "__main__":
    app.run(main)
