"""The scripted experts' success rates: N seeded episodes of every atomic task, and of the steel pickaxe, in
the Luanti game (the README quotes these figures).

    python -m experiments.benchmarks.experts [--episodes=10] [--steel_episodes=4] [--instances=2]

Episodes run through ``histeve_jax.eval.evaluate.evaluate`` with ``agents=("expert",)`` on a fleet of
``--instances`` games (episode i of a task resets with seed ``--seed + i``); interrupted episodes (a crashed
or hung game, after the fleet's retries) are left out of the rates and counted apart. The last line is
``atomic=<successes>/<episodes> steel_pickaxe=<successes>/<episodes> interrupted=<n>``.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time


def run(tasks: tuple[str, ...], episodes: int, seed: int, instances: int, obs_size: tuple[int, int],
        out_dir: str) -> dict:
    """The expert's per-task results (``evaluate``'s rows) for ``episodes`` seeded episodes of each task."""
    from histeve_jax.eval.evaluate import EvalSpec, evaluate

    spec = EvalSpec(tasks=tasks, episodes=episodes, seed=seed, agents=("expert",), instances=instances,
                    obs_size=obs_size, out_dir=out_dir, reports=0, progress_bar=False)
    return evaluate(spec)["results"]["expert"]


def main() -> None:
    from histeve_jax.envs.experts import EXPERT_TASKS
    from histeve_jax.envs.luanti import minetest_available

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--episodes", type=int, default=10, help="per atomic task")
    ap.add_argument("--steel_episodes", type=int, default=4, help="of the steel pickaxe (0: skip it)")
    ap.add_argument("--tasks", default=",".join(EXPERT_TASKS), help="comma-separated atomic tasks")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--instances", type=int, default=2)
    ap.add_argument("--obs_size", default="64,64", help="H,W")
    args = ap.parse_args()
    if not minetest_available():
        raise SystemExit("error: the Luanti game is not installed (apt-get install minetest xvfb)")
    obs = tuple(int(x) for x in args.obs_size.split(","))
    tasks = tuple(t for t in args.tasks.split(",") if t)
    rows: dict[str, dict] = {}
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="histeve_experts_") as d:
        if tasks:
            rows.update(run(tasks, args.episodes, args.seed, args.instances, obs, os.path.join(d, "atomic")))
        if args.steel_episodes:
            rows.update(run(("steel_pickaxe",), args.steel_episodes, args.seed, args.instances, obs,
                            os.path.join(d, "steel")))
    print(f"{'task':24s} {'success':>9s} {'rate':>5s} {'steps':>6s} {'interrupted':>11s}  failed seeds")
    for task, r in rows.items():
        failed = [s for s, ok in r["success_by_seed"].items() if not ok]
        print(f"{task:24s} {r['successes']:>4d}/{r['episodes']:<4d} {r['success_rate']:5.2f} "
              f"{r['mean_steps']:6.0f} {r['interrupted']:>11d}  {','.join(failed) or '-'}")
    atomic = [r for t, r in rows.items() if t != "steel_pickaxe"]
    steel = rows.get("steel_pickaxe", {"successes": 0, "episodes": 0})
    print(f"obs_size={obs[0]}x{obs[1]} instances={args.instances} seeds from {args.seed}, "
          f"wall {time.time() - t0:.0f} s")
    print(f"atomic={sum(r['successes'] for r in atomic)}/{sum(r['episodes'] for r in atomic)} "
          f"steel_pickaxe={steel['successes']}/{steel['episodes']} "
          f"interrupted={sum(r['interrupted'] for r in rows.values())}")


if __name__ == "__main__":
    main()
