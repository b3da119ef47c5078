"""Record scripted-expert episodes into the project's record format (ArrayRecord shards of StepRecords).

    python -m experiments.record --config=experiments/configs/record.py --workdir=DIR [--config.x=y ...]

Each step stores the frame the expert saw, the env-format action it took, the regime (``is_gui_open``), the
cursor, the cumulative event counters, the expert's subtask name (boundaries are where it changes), the
instruction and the task id; ``completed`` is 1 on frames where the task's success check already holds (the
completion detector's label). The episode ends with the frame after the last action, stored with a no-op
action and ``done=True``. Writes ``summary.json`` (per-task expert success rates) and ``config.json``.
"""

from __future__ import annotations

import json
import os
import uuid

import numpy as np
from absl import app, flags, logging
from tqdm import tqdm

from experiments.config_cli import define_config
from histeve_jax.data.records import ShardWriter, StepRecord, encode_frame
from histeve_jax.envs import load_task, make, noop_action
from histeve_jax.envs.base import EVENT_KEYS
from histeve_jax.envs.experts import expert_for

_CONFIGS = os.path.join(os.path.dirname(__file__), "configs")
define_config(os.path.join(_CONFIGS, "record.py"), "Recorder config.")
_WORKDIR = flags.DEFINE_string("workdir", None, "Output directory (records/, summary.json, config.json).")


def _jsonable_action(a: dict) -> dict:
    return {k: ([float(x) for x in np.asarray(v).reshape(2)] if k == "camera" else int(v))
            for k, v in a.items()}


def _record(task, episode_id: str, step: int, obs, info, action, subtask: str, reward: float, done: bool,
            cfg, seed: int) -> StepRecord:
    return StepRecord(
        episode_id=episode_id, step=step, task_id=task.name, kind="demo", instruction=task.text,
        frame=encode_frame(obs["image"], cfg.frame_format, cfg.jpeg_quality), frame_format=cfg.frame_format,
        action=_jsonable_action(action), is_gui_open=bool(info["is_gui_open"]),
        cursor=None if info["cursor"] is None else [float(v) for v in info["cursor"]], subtask=subtask,
        events={k: dict(info[k]) for k in EVENT_KEYS},
        reward=float(reward), done=done, completed=int(task.is_success(info)),
        metadata={"backend": cfg.backend, "seed": seed, "pos": [float(v) for v in info["pos"]],
                  "yaw": float(info["yaw"]), "pitch": float(info["pitch"]),
                  "inventory": dict(info["inventory"])},
    )


def record_episode(env, task, seed: int, cfg) -> tuple[list[StepRecord], bool]:
    """Run the task's expert once from (seed, task); returns the episode's records and its success."""
    obs, info = env.reset(seed=seed, options={"task": task})
    expert = expert_for(task)
    expert.reset(info)
    episode_id = f"{task.name}-{seed}-{uuid.uuid4().hex[:8]}"
    records: list[StepRecord] = []
    for t in range(task.max_steps):
        try:
            action, subtask = expert.act(info)
        except RuntimeError as e:  # the expert gave up (e.g. the GUI did not open): a failed episode
            logging.warning("%s seed %d: expert gave up at step %d: %s", task.name, seed, t, e)
            break
        next_obs, reward, terminated, truncated, next_info = env.step(action)
        records.append(_record(task, episode_id, t, obs, info, action, subtask, reward, False, cfg, seed))
        obs, info = next_obs, next_info
        if terminated or truncated or subtask == "done":
            break
    records.append(_record(task, episode_id, len(records), obs, info, noop_action(), "done", 0.0, True, cfg,
                           seed))
    return records, bool(info["success"])


def run(cfg, workdir: str) -> dict:
    """Record cfg.episodes episodes of each of cfg.tasks; returns the summary written to summary.json."""
    os.makedirs(workdir, exist_ok=True)
    out_dir = cfg.output_dir or os.path.join(workdir, "records")
    with open(os.path.join(workdir, "config.json"), "w") as f:
        f.write(cfg.to_json_best_effort(indent=2))
    tasks = [load_task(n) for n in cfg.tasks]
    for t in tasks:
        expert_for(t)  # fail before starting the game if a task has no expert
    env = make(cfg.backend, obs_size=tuple(cfg.obs_size), randomize_init=cfg.randomize_init,
               fps_max=cfg.env.fps_max, viewing_range=cfg.env.viewing_range)
    summary: dict = {"tasks": {}, "output_dir": out_dir}
    bar = tqdm(total=len(tasks) * cfg.episodes, disable=not cfg.progress_bar, desc="episodes")
    try:
        with ShardWriter(out_dir, prefix=f"{cfg.backend}-demo", records_per_shard=cfg.records_per_shard) as w:
            for task in tasks:
                ok, steps, kept = 0, [], 0
                for i in range(cfg.episodes):
                    records, success = record_episode(env, task, cfg.seed + i, cfg)
                    ok += success
                    steps.append(len(records))
                    if success or cfg.keep_failed:
                        w.write_episode(records)
                        kept += 1
                    bar.update(1)
                    bar.set_postfix(task=task.name, success=f"{ok}/{i + 1}")
                summary["tasks"][task.name] = {"episodes": cfg.episodes, "successes": ok, "kept": kept,
                                               "success_rate": ok / max(cfg.episodes, 1),
                                               "mean_steps": float(np.mean(steps)) if steps else 0.0}
                logging.info("%s: %d/%d expert successes", task.name, ok, cfg.episodes)
        summary["shards"] = w.paths
    finally:
        bar.close()
        env.close()
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
