"""RL throughput: what the actors supply and what the learner demands, in samples (= env steps) per second.

    python -m experiments.benchmarks.rl_throughput [--policy=<run workdir>] [--learner_steps=20]

1. Actors: env steps/s of 2 games with the tiny policy in the loop behind one batching policy server
   (``experiments.benchmarks.rollout.steps_per_second``), per core of this machine.
2. Learner: RL train steps/s of the tiny policy (the shared loop with ``rl.learner.rl_stage``, reference
   forward included) on branch groups in the record schema (grammar-sampled actions, random PNG frames),
   compile excluded; samples/s = steps/s x batch rows.
3. 7B: the learner's demand on one v5p host (4 chips at ``MFU`` of bf16 peak; per sample 6 N T for the step
   plus 2 N T for the reference forward, N the policy's parameters counted from its abstract shape, T the
   qwen7b sample length) against one CPU actor host (``ACTOR_HOST_VCPUS`` vCPUs, half a vCPU per game as
   the fleet budgets, each game at the measured per-game rate; the 7B policy itself is served elsewhere).

4. The pod topology rehearsed here (``--rehearsal``: a finished rehearsal's ``rehearsal.json``,
   ``python -m experiments.rl --config=experiments/configs/rl.py:rehearsal``): learner samples/s with 1 and
   2 JAX processes on the same shards, act calls/s per policy server replica.
5. One v5p-128 learner (16 hosts) at the 7B: its demand (3. x 16) against one actor host's games and one
   inference host's acting (``rl.plan.act_plan``: the act program compiled per chip at ``ACT_BATCH`` rows,
   its FLOPs at ``MFU``, ``PLAN_CHIPS_PER_HOST`` chips), so how many actor and inference hosts it needs.

Last line: ``actor_steps_per_s_per_core=<x> learner_samples_per_s=<y> actor_hosts_per_learner_host=<z>
rehearsal_samples_per_s_1=<a> rehearsal_samples_per_s_2=<b> act_calls_per_s_per_replica=<c>
v5p128_actor_hosts=<n> v5p128_inference_hosts=<m>``.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import numpy as np

MFU = 0.4  # assumed model FLOPs utilisation of the 7B RL step on v5p (not measured here)
V5P_CHIPS_PER_HOST, V5P_BF16_FLOPS = 4, 459e12
ACTOR_HOST_VCPUS, VCPU_PER_GAME = 32, 0.5
LEARNER_HOSTS = 16  # v5p-128
ACT_BATCH = 32  # rows per chip of the act program compiled for the inference hosts
V5P_HBM_BYTES_PER_S = 2.765e12


def _groups(directory: str, n: int, length: int = 40, k: int = 4) -> None:
    """``n`` branch groups of ``k`` x ``length`` steps in the record schema (half the branches succeed)."""
    from histeve_jax.actions.tokens import ActionVocab
    from histeve_jax.data.records import ShardWriter, StepRecord, encode_frame
    from histeve_jax.eval.rollout import RandomAgent, jsonable_action

    agent = RandomAgent(vocab=ActionVocab.contiguous("vpt", 320))
    rng = np.random.default_rng(0)
    for g in range(n):
        with ShardWriter(directory, prefix=f"group-{g:06d}-bench", records_per_shard=1 << 30) as w:
            for b in range(k):
                eps = []
                for t in range(length + 1):
                    tokens, logprobs = agent.sample_tokens(int(t > length // 2))
                    meta = {"group_id": str(g), "branch": b, "advantage": 1.0 if b % 2 else -1.0,
                            "success": bool(b % 2), "policy_step": 0}
                    if t < length:
                        meta.update(action_tokens=tokens, action_logprobs=logprobs)
                    eps.append(StepRecord(
                        episode_id=f"{g}-{b}", step=t, task_id="craft_planks", kind="rl", instruction="craft",
                        frame=encode_frame(rng.integers(0, 256, (56, 56, 3), dtype=np.uint8), "png"),
                        frame_format="png", action=jsonable_action(agent.vocab.decode(tokens)[0]),
                        is_gui_open=t > length // 2, metadata=meta))
                w.write_episode(eps)


def learner_samples_per_second(workdir: str, root: str, steps: int) -> float:
    """Samples/s of the tiny RL learner step after compile (the loop's own steps_per_sec)."""
    from experiments.configs.rl import get_config
    from histeve_jax.rl.driver import learner_config
    from histeve_jax.rl.learner import rl_stage
    from histeve_jax.rl.order import DONE_FILE
    from histeve_jax.rl.spec import RLSpec
    from histeve_jax.train.loop import train
    from histeve_jax.train.specs import RunSpec

    c = get_config("tiny")
    fields = c.rl.to_dict()
    fields.update(rollout_dir=os.path.join(root, "rollouts"), reference=workdir, replay_rows=4,
                  replay_dirs=os.path.join(root, "replay"), max_policy_lag=10**6)
    rl = RLSpec.from_config(fields)
    _groups(rl.rollout_dir, 2 + steps * rl.rl_rows // (4 * 40))
    _groups(os.path.join(root, "replay"), 1)
    open(os.path.join(rl.rollout_dir, DONE_FILE), "w").close()
    over = {**c.learner.to_dict(), "num_train_steps": steps + 1, "log_every": steps,
            "checkpoint_every": 10**6}
    spec = RunSpec.from_config(learner_config(workdir, over, rl, os.path.join(root, "learner")))
    history = train(spec, rl_stage(spec, rl))
    # logged at step 1 (after the compile) and at step `steps`: the rate over steps 2..steps
    return float(history[steps]["steps_per_sec"]) * rl.batch_size


def demand_7b() -> tuple[float, int, int]:
    """(samples/s one v5p host's learner takes, parameters, tokens per sample) for the qwen7b RL step."""
    import math

    import jax
    from flax import nnx

    from experiments.configs import imitation
    from histeve_jax.policy import Policy
    from histeve_jax.train import setup
    from histeve_jax.train.specs import RunSpec

    c = imitation.get_config("qwen7b")
    spec = RunSpec.from_config(c, "/tmp/unused")
    cfg = setup.policy_config(spec, named_base=True)
    shapes = jax.eval_shape(lambda: nnx.state(Policy(cfg, rngs=nnx.Rngs(0)), nnx.Param))
    n = sum(math.prod(x.shape) for x in jax.tree.leaves(shapes))
    T = spec.data.max_len
    per_sample = (6.0 + 2.0) * n * T
    return V5P_CHIPS_PER_HOST * V5P_BF16_FLOPS * MFU / per_sample, n, T


def inference_host_actions_per_s() -> tuple[float, dict[str, float]]:
    """(actions/s one v5p inference host serves, the act plan): the 7B act program compiled per chip at
    ``ACT_BATCH`` rows, timed by ``rl.plan.act_time`` at ``MFU``, on its 4 chips."""
    import dataclasses

    from experiments.configs import imitation
    from histeve_jax.rl.plan import act_plan, act_time
    from histeve_jax.train import setup
    from histeve_jax.train.specs import RunSpec

    spec = RunSpec.from_config(imitation.get_config("qwen7b"), "/tmp/unused")
    cfg = setup.policy_config(spec, named_base=True)
    cfg = dataclasses.replace(cfg, base=cfg.base.replace(scan_layers=True, layer_loop="scan"))
    plan = act_plan(cfg, ACT_BATCH, spec.data.max_len)
    t = act_time(plan, plan["weight_bytes"], chips=1, peak_flops=V5P_BF16_FLOPS,
                 hbm_bytes_per_s=V5P_HBM_BYTES_PER_S, mfu=MFU)  # 2 FLOPs x (bytes / 2) params per row
    plan["call_s"] = t
    return V5P_CHIPS_PER_HOST * ACT_BATCH / t, plan


def rehearsal_figures(path: str) -> dict[str, float]:
    """The rehearsal's learner samples/s (1 and 2 processes) and mean act calls/s per server replica."""
    import json

    with open(path) as f:
        r = json.load(f)
    calls = [x for x in r["act_calls_per_s_per_replica"] if x > 0]
    return {"samples_1": r["learner_samples_per_s_1"], "samples_2": r["learner_samples_per_s_2"],
            "act_per_replica": float(np.mean(calls)) if calls else 0.0}


def main() -> None:
    from experiments.benchmarks.rollout import _tiny_run, steps_per_second

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--policy", default="", help="a run's workdir (default: a tiny run trained here)")
    p.add_argument("--learner_steps", type=int, default=20)
    p.add_argument("--rehearsal", default="/tmp/histeve_runs/rl_rehearsal/rehearsal.json",
                   help="a finished rehearsal's rehearsal.json")
    args = p.parse_args()
    root = tempfile.mkdtemp(prefix="rl_throughput_")
    workdir = args.policy or _tiny_run(os.path.join(root, "start"))
    cores = os.cpu_count() or 1
    each = steps_per_second(workdir, 2)
    actor_per_core = 2 * each / cores
    print(f"actors: 2 games x {each:.2f} steps/s with the tiny policy in the loop on {cores} cores")
    learner = learner_samples_per_second(workdir, root, args.learner_steps)
    print(f"learner: tiny RL step, {learner:.1f} samples/s (reference forward included)")
    demand, n, T = demand_7b()
    supply = ACTOR_HOST_VCPUS / VCPU_PER_GAME * each
    games = ACTOR_HOST_VCPUS / VCPU_PER_GAME
    print(f"7B: {n / 1e9:.2f}B params x {T} tokens/sample, v5p host at MFU {MFU}: {demand:.1f} samples/s; "
          f"one {ACTOR_HOST_VCPUS}-vCPU actor host ({games:.0f} games x {each:.2f} steps/s): {supply:.0f} "
          "steps/s")
    r = rehearsal_figures(args.rehearsal) if os.path.exists(args.rehearsal) else {
        "samples_1": float("nan"), "samples_2": float("nan"), "act_per_replica": float("nan")}
    print(f"rehearsal ({args.rehearsal}): learner {r['samples_1']:.1f} samples/s with 1 process, "
          f"{r['samples_2']:.1f} with 2 (gloo on one machine); {r['act_per_replica']:.1f} act calls/s per "
          "policy server replica (bound by its games' 20 Hz)")
    per_host, plan = inference_host_actions_per_s()
    total = LEARNER_HOSTS * demand
    actor_hosts = int(np.ceil(total / supply))
    inference_hosts = int(np.ceil(total / per_host))
    print(f"v5p-128 learner ({LEARNER_HOSTS} hosts): {total:.0f} samples/s; one actor host {supply:.0f} "
          f"steps/s -> {actor_hosts} actor hosts; act at {ACT_BATCH} rows per chip: "
          f"{plan['flops'] / ACT_BATCH:.3g} FLOPs per action, {1e3 * plan['call_s']:.0f} ms per call, "
          f"{per_host:.0f} actions/s per 4-chip host -> {inference_hosts} inference hosts")
    print(f"actor_steps_per_s_per_core={actor_per_core:.2f} learner_samples_per_s={learner:.1f} "
          f"actor_hosts_per_learner_host={demand / supply:.3f} "
          f"rehearsal_samples_per_s_1={r['samples_1']:.1f} rehearsal_samples_per_s_2={r['samples_2']:.1f} "
          f"act_calls_per_s_per_replica={r['act_per_replica']:.1f} "
          f"v5p128_actor_hosts={actor_hosts} v5p128_inference_hosts={inference_hosts}")


if __name__ == "__main__":
    main()
