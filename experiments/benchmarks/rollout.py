"""Closed-loop throughput: env steps/s per game with the policy in the loop (1 game, then 2 games behind
one batching policy server), and the batched act of 2 rows against 2 single-row calls.

    python -m experiments.benchmarks.rollout [--policy=<run workdir>]

Without ``--policy`` a tiny run is trained for a few steps on synthetic data first (its weights do not
matter for speed). Steps/s come from the policy server's request times over one long episode per game
(find_gold, which the policy does not finish), so game start and reset are not counted. The game paces
itself at 20 steps/s (50 ms of game time per step), the ceiling. The last line is
``steps_per_s_1=<x> steps_per_s_2_each=<y> batched_act_ms=<a> unbatched_act_ms=<b> ratio=<b/a>``.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import numpy as np

from experiments.benchmarks import timing

STEPS = 200  # per episode
ACT_CALLS = 40


def _tiny_run(root: str) -> str:
    from experiments.configs import imitation
    from histeve_jax.data import synthetic
    from histeve_jax.train.loop import train
    from histeve_jax.train.specs import RunSpec

    synthetic.write_demo_dataset(os.path.join(root, "data"), episodes=4, length=8, seed=0)
    c = imitation.get_config("tiny")
    c.data.train_dirs = os.path.join(root, "data")
    c.data.batch_size, c.num_train_steps, c.optimizer.warmup_steps = 2, 2, 1
    c.eval_every, c.checkpoint_every, c.progress_bar, c.async_checkpoint = 0, 2, False, False
    train(RunSpec.from_config(c, os.path.join(root, "run")))
    return os.path.join(root, "run")


def steps_per_second(workdir: str, instances: int) -> float:
    """Mean env steps/s of each game over one STEPS-step episode per game, the policy served in batches."""
    import ray

    from histeve_jax.eval.fleet import EpisodeSpec, Fleet
    from histeve_jax.eval.policy_agent import PolicyAgentFactory, PolicyServer

    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    try:
        server = ray.remote(num_cpus=0)(PolicyServer).remote(workdir, max_batch=instances)
        layout, _ = ray.get(server.layout.remote())
        with Fleet(instances, {"obs_size": (56, 56)}) as fleet:
            factory = PolicyAgentFactory(server, layout)
            # A short episode first: the games start and the policy compiles outside the timed one.
            list(fleet.run([EpisodeSpec("find_gold", 1000 + i, 5) for i in range(instances)], factory))
            n0 = len(ray.get(server.request_times.remote()))
            list(fleet.run([EpisodeSpec("find_gold", 2000 + i, STEPS) for i in range(instances)], factory))
            times = np.asarray(ray.get(server.request_times.remote())[n0:])
        return (len(times) / instances - 1) / float(times[-1] - times[0])
    finally:
        ray.shutdown()


def act_ms(workdir: str) -> tuple[float, float]:
    """(ms of one 2-row call, ms of two 1-row calls), medians over ACT_CALLS."""
    import jax

    from histeve_jax.eval.policy_agent import load_run

    loaded = load_run(workdir)
    rng = np.random.default_rng(0)
    obs = [([rng.integers(0, 256, (56, 56, 3), dtype=np.uint8) for _ in range(loaded.config.num_frames)],
            "find the gold block and walk up to it") for _ in range(2)]
    key = jax.random.key(0)
    batched = lambda: loaded.sample(obs, [0, 1], key, batch=2)
    single = lambda: [loaded.sample(obs[i : i + 1], [i], key, batch=1) for i in range(2)]

    def median_ms(fn) -> float:
        return timing.median_ms(fn, ACT_CALLS, warmup=2)

    # Where a call's time goes, per row count: preprocessing, the compiled sampling program, token decoding
    # (the rest of `sample` is its fixed Python).
    from histeve_jax.policy import decode_actions
    from histeve_jax.policy.observations import regime_array

    for n in (1, 2):
        o, reg = obs[:n], regime_array(list(range(n)))
        inp = loaded.inputs(o, n)
        program = lambda: loaded.sampler(inp["input_ids"], inp["attention_mask"], inp["pixel_values"], reg,  # noqa: B023
                                         key, temperature=1.0, greedy=False)
        toks = program().tokens
        parts = {"preprocess": median_ms(lambda: loaded.inputs(o, n)), "program": median_ms(program),  # noqa: B023
                 "decode": median_ms(lambda: decode_actions(loaded.config, toks)),  # noqa: B023
                 "sample": median_ms(lambda: loaded.sample(o, list(range(n)), key, batch=n))}  # noqa: B023
        print(f"act, {n} row(s): " + ", ".join(f"{k} {v:.2f} ms" for k, v in parts.items()))
    return median_ms(batched), median_ms(single)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--policy", default="", help="a run's workdir (default: a tiny run trained here)")
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as root:
        workdir = a.policy or _tiny_run(root)
        b_ms, u_ms = act_ms(workdir)
        print(f"act: 2 rows in one call {b_ms:.2f} ms, 2 single-row calls {u_ms:.2f} ms")
        s1 = steps_per_second(workdir, 1)
        s2 = steps_per_second(workdir, 2)
        print(f"env steps/s with the policy in the loop: 1 game {s1:.1f}, 2 games {s2:.1f} each (ceiling 20)")
    print(f"steps_per_s_1={s1:.1f} steps_per_s_2_each={s2:.1f} batched_act_ms={b_ms:.2f} "
          f"unbatched_act_ms={u_ms:.2f} ratio={u_ms / b_ms:.2f}")


if __name__ == "__main__":
    main()
