"""The Minecraft suites: MineStudio Bench (judged by a VLM) or OpenHA-style (success = a reward event).

    python -m experiments.minecraft_bench --config=experiments/configs/minecraft_bench.py[:openha]

Minecraft needs MineStudio's engine and Java 8; without them this says so in one line and stops.
"""

from __future__ import annotations

import functools
import os

from absl import app, flags

from experiments.config_cli import define_config

define_config(os.path.join(os.path.dirname(__file__), "configs", "minecraft_bench.py"),
              "Minecraft suite config.")


def _agent_factory(c):
    """``make_agent(task_name, seed)`` for the config's agent, and a close() for what it started."""
    from histeve_jax.eval.rollout import random_agent

    if c.agent == "random":
        return functools.partial(random_agent, codebook=c.codebook), lambda: None
    if c.agent != "policy":
        raise ValueError(f"agent: unknown agent {c.agent!r}; expected 'random' or 'policy'")
    if not c.policy:
        raise ValueError("agent 'policy' needs --config.policy=<a run's workdir>")
    import ray

    from histeve_jax.eval.policy_agent import PolicyAgentFactory, PolicyServer

    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    server = ray.remote(num_cpus=0)(PolicyServer).remote(c.policy, None if c.step < 0 else c.step,
                                                         greedy=c.greedy, temperature=c.temperature)
    layout, _ = ray.get(server.layout.remote())
    return PolicyAgentFactory(server, layout), ray.shutdown


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    from histeve_jax.envs import make
    from histeve_jax.envs.minestudio import MineStudioUnavailable

    c = flags.FLAGS.config
    make_env = functools.partial(make, "minestudio", obs_size=tuple(c.obs_size))
    try:
        make_env().close()  # the backend's own check (engine, Java 8, the simulator's imports); no game yet
    except MineStudioUnavailable as e:
        raise SystemExit(f"error: {e}") from None
    from histeve_jax.eval.suites.minecraft import SuiteSpec, format_table, resolve_tasks, run_suite

    try:
        spec = SuiteSpec.from_config(c)
        tasks = resolve_tasks(spec)
        make_agent, close_agent = _agent_factory(c)
    except (ValueError, FileNotFoundError) as e:  # bad input: one line naming it, before any game starts
        raise SystemExit(f"error: {e}") from None
    try:
        summary = run_suite(spec, make_agent, make_env, tasks)
    finally:
        close_agent()
    print(format_table(spec.suite, summary["tasks"]))
    print(f"results: {spec.out_dir}/summary.json; episode reports: {spec.out_dir}/reports/")
    rows = summary["tasks"].values()
    if spec.suite == "openha":
        done = sum(r["episodes"] - r["interrupted"] for r in rows)
        print(f"suite=openha tasks={len(rows)} episodes={done} successes={sum(r['successes'] for r in rows)}")
    else:
        scores = [r["score"] for r in rows if r["score"] is not None]
        mean = f"{sum(scores) / len(scores):.2f}" if scores else "-"
        print(f"suite=minestudio_bench tasks={len(rows)} judged={sum(r['judged'] for r in rows)} "
              f"judge_errors={sum(r['judge_errors'] for r in rows)} mean_score={mean}")


if __name__ == "__main__":
    app.run(main)
