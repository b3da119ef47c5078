"""Stage 3 end to end on one machine: the learner in its own process, the actors (a Ray fleet of games
and batching ``RLPolicyServer`` replicas, ``rl.serving``) in this one, the evaluation before and after on
the same held-out seeds.

``learner_config`` derives the learner's train config from the start run's ``config.json`` (the same policy
shape, so its params initialise the learner and are the frozen reference) with RL's overrides;
``run_learner`` is the learner process (``train.loop.train`` with ``learner.rl_stage``); ``weakest_task``
picks the task; ``run_rl`` does the rest and returns the summary the entry point prints.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import time
from collections.abc import Callable, Mapping
from typing import Any

import ml_collections
import numpy as np

from histeve_jax.rl.order import DONE_FILE
from histeve_jax.rl.spec import RLSpec
from histeve_jax.rl.stream import STATUS_FILE


def learner_config(start_run: str, overrides: Mapping[str, Any], rl: RLSpec, workdir: str,
                   distributed: Any = "auto") -> Any:
    """The learner's train config: the start run's, with init_from=start, RL's batch and loop fields and
    ``distributed`` (the learner's jax.distributed mode: its hosts are not the start run's)."""
    path = os.path.join(start_run, "config.json")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{start_run}: no config.json (not a run's workdir)")
    with open(path) as f:
        d = json.load(f)
    d.pop("eval", None)
    o = dict(overrides)
    d.update(stage="rl", workdir=workdir, init_from=start_run, eval_every=0, progress_bar=False,
             distributed=distributed,
             stop_at_step=o.pop("stop_at_step", -1), num_train_steps=o.pop("num_train_steps"),
             checkpoint_every=o.pop("checkpoint_every"), keep_checkpoints=o.pop("keep_checkpoints"),
             log_every=o.pop("log_every"), microbatches=o.pop("microbatches", 1))
    d["data"].update(train_dirs=rl.rollout_dir, eval_dirs="", batch_size=rl.batch_size)
    d["optimizer"].update(learning_rate=o.pop("learning_rate"), warmup_steps=o.pop("warmup_steps"),
                          total_steps=d["num_train_steps"])
    if o:
        raise ValueError(f"config.learner: unknown field(s) {sorted(o)}")
    return ml_collections.ConfigDict(d)


def run_learner(config_json: str, rl: RLSpec) -> dict[int, dict[str, float]]:
    """The learner process: the shared train loop with the RL stage until the stream ends; returns the
    logged metrics by step."""
    from absl import logging

    from histeve_jax.rl.learner import rl_stage
    from histeve_jax.train.loop import train
    from histeve_jax.train.specs import RunSpec

    spec = RunSpec.from_config(ml_collections.ConfigDict(json.loads(config_json)))
    try:
        return train(spec, rl_stage(spec, rl))
    except StopIteration:  # the actors are done and every group was read: the last checkpoint is final
        logging.info("rl learner: the stream ended")
        return {}


def weakest_task(summary: Mapping[str, Any]) -> str:
    """The atomic task (not long-horizon) with the lowest policy success rate above 0 in an evaluation
    summary; the lowest overall when every task is at 0. A task the policy never completes gives branch
    groups no spread (every branch times out with one score: 15 of 16 groups skipped when craft_planks at 0/10
    was picked), so group-relative RL has nothing to learn from it."""
    from histeve_jax.envs.tasks import load_task

    rows = summary["results"]["policy"]
    atomic = [t for t in summary["tasks"] if load_task(t).category != "long_horizon"]
    if not atomic:
        raise ValueError("the start run's evaluation has no atomic task")
    some = [t for t in atomic if rows[t]["success_rate"] > 0] or atomic
    return min(some, key=lambda t: rows[t]["success_rate"])  # ties: the first in the evaluation's order


def eval_spec(c: Any, policy: str, task: str, out_dir: str, image_size: Any) -> Any:
    """The before/after evaluation of ``policy`` on ``task``: the games render at the policy's
    ``image_size``, as the actors' do (at EvalSpec's default 56x56 a 112x196 policy saw upscaled frames,
    and crafted in 1 of 20 episodes where its own evaluation had 16)."""
    from histeve_jax.eval.evaluate import EvalSpec

    return EvalSpec(tasks=(task,), episodes=c.eval.episodes, seed=c.eval.seed, agents=("policy",),
                    policy=policy, max_steps=c.eval.max_steps, instances=c.instances, out_dir=out_dir,
                    temperature=c.eval.temperature, greedy=c.eval.greedy, progress_bar=False,
                    obs_size=tuple(int(v) for v in image_size), env=dict(c.env), ray_address=c.ray_address)


def _evaluate(c: Any, policy: str, task: str, out_dir: str, image_size: Any) -> dict[str, Any]:
    from histeve_jax.eval.evaluate import evaluate

    return evaluate(eval_spec(c, policy, task, out_dir, image_size))["results"]["policy"][task]


def resolve(c: Any) -> tuple[RLSpec, str, str, Any]:
    """(RLSpec with its paths filled in, the task, the learner's workdir, the learner's train config)."""
    workdir = c.workdir
    rl_fields = c.rl.to_dict()
    rl_fields["rollout_dir"] = rl_fields["rollout_dir"] or os.path.join(workdir, "rollouts")
    rl_fields["reference"] = rl_fields["reference"] or c.start_run
    rl_fields["replay_dirs"] = rl_fields["replay_dirs"] or os.path.join(c.start_run, "data", "train")
    rl = RLSpec.from_config(rl_fields)
    task = c.task
    if not task:
        with open(os.path.join(c.start_run, "eval", "summary.json")) as f:
            task = weakest_task(json.load(f))
    learner_dir = os.path.join(workdir, "learner")
    cfg = learner_config(c.start_run, c.learner.to_dict(), rl, learner_dir, c.get("distributed", "auto"))
    return rl, task, learner_dir, cfg


def run_actors(c: Any, rl: RLSpec, task: str, learner_dir: str, image_size: Any, deadline: float, *,
               until: Callable[[Any], bool] | None = None,
               on_start: Callable[[Any, Any], None] | None = None) -> dict:
    """The actors until ``deadline`` (time.monotonic) or ``until(runner)`` holds: a Ray fleet of
    ``c.instances`` games acting through ``c.server``'s policy server replicas (``rl.serving``) that follow
    the learner; writes ``DONE`` when they stop. ``on_start(runner, pool)`` is called once both exist (the
    rehearsal's fault injection). Returns the runner's summary with each replica's act calls/s while its
    games play (``_rate``)."""
    import ray

    from histeve_jax.eval.fleet import Fleet
    from histeve_jax.eval.policy_agent import frame_codec
    from histeve_jax.rl.actors import GroupRunner
    from histeve_jax.rl.serving import ServerPool, ServerSpec

    os.makedirs(rl.rollout_dir, exist_ok=True)
    server_spec = ServerSpec.from_config(c.server)
    if not ray.is_initialized():
        ray.init(include_dashboard=False, logging_level="ERROR", log_to_driver=False,
                 **({"address": c.ray_address} if c.ray_address else {"num_cpus": os.cpu_count()}))
    try:
        pool = ServerPool(server_spec, c.start_run, learner_dir, games=c.instances,
                          temperature=rl.temperature)
        # The rollouts' frames in the policy's own codec: the learner must see exactly what the actor saw
        # (JPEG's loss alone moves the tiny policy's log-probs by ~0.05, so the ratio to the recorded ones
        # would not start at 1), and a JPEG run acts on each frame's JPEG round trip, the bytes stored.
        fmt, quality = frame_codec(c.start_run)
        with Fleet(c.instances, {"obs_size": tuple(image_size), **dict(c.env)}, max_attempts=1,
                   run_kwargs={"kind": "rl", "frame_format": fmt, "jpeg_quality": quality}) as fleet:
            runner = GroupRunner(fleet, pool, pool.factory(), rl, task, seed=c.group_seed)
            if on_start is not None:
                on_start(runner, pool)
            summary = runner.run(deadline=deadline, until=until)
        summary["act_calls_per_s"] = [_rate(t) for t in pool.request_times()]
        pool.close()
    finally:
        with open(os.path.join(rl.rollout_dir, DONE_FILE), "w") as f:
            f.write("actors done\n")
        ray.shutdown()
    return summary


def _rate(times: list[float], gap_s: float = 1.0) -> float:
    """Calls per second while calls come: over the stretches of ``times`` with no pause longer than
    ``gap_s`` (between waves the games wait for the learner or a restart; that is not the server's rate)."""
    t = np.asarray(times, float)
    if len(t) < 2:
        return 0.0
    d = np.diff(t)
    busy = d[d <= gap_s]
    return float(len(busy) / busy.sum()) if busy.size and busy.sum() > 0 else 0.0


def run_rl(c: Any) -> dict[str, Any]:
    """Evaluate the start run on the task, train with RL for ``c.train_minutes``, evaluate the result."""
    from histeve_jax.rl.weights import latest_step

    rl, task, learner_dir, cfg = resolve(c)
    os.makedirs(rl.rollout_dir, exist_ok=True)
    if os.path.exists(os.path.join(rl.rollout_dir, DONE_FILE)):
        os.remove(os.path.join(rl.rollout_dir, DONE_FILE))  # a rerun continues the stream

    image_size = cfg.data.image_size
    before = _evaluate(c, c.start_run, task, os.path.join(c.workdir, "eval_before"), image_size)
    learner = multiprocessing.get_context("spawn").Process(
        target=run_learner, args=(cfg.to_json_best_effort(), rl), name="rl-learner")
    learner.start()
    t0 = time.monotonic()
    try:
        actors = run_actors(c, rl, task, learner_dir, image_size, t0 + 60.0 * c.train_minutes)
    finally:
        learner.join(timeout=900)  # it drains the groups written, then saves its last step
        if learner.is_alive():
            learner.terminate()
            learner.join(timeout=60)
    step = latest_step(learner_dir)
    status = _learner_status(rl.rollout_dir)
    after = (_evaluate(c, learner_dir, task, os.path.join(c.workdir, "eval_after"), image_size) if step
             else before)
    summary = {"task": task, "before": before, "after": after, "actors": actors, "learner_step": step,
               "learner": status, "train_s": time.monotonic() - t0}
    with open(os.path.join(c.workdir, "rl_summary.json"), "w") as f:
        json.dump(summary, f, indent=2, default=str)
    return summary


def _learner_status(rollout_dir: str) -> dict[str, Any]:
    """The learner stream's last report (steps, groups read, stale/bad counts, the largest policy lag)."""
    try:
        with open(os.path.join(rollout_dir, STATUS_FILE)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}
