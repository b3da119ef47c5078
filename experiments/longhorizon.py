"""The harness on long-horizon Luanti tasks (steel pickaxe from scratch and more) with injected failures:
final-goal success and diagnostic progress for the expert executors and a trained policy (beside the same
policy given only the final goal).

    python -m experiments.longhorizon [--config=experiments/configs/longhorizon.py:tiny]
        [--config.policy=<workdir> [--config.detector=<detector run>]] [--config.planner=rules|endpoint|local]

With a detector run the policy's invocations end by the trained detector (queried every
``detector_every`` steps, two consecutive queries at or over its run's loop threshold);
``--config.completion=privileged`` ends them by the privileged check instead, ``both`` plays a row each.
``--config.records=True`` also writes each episode's records, a harness row's labelled per invocation
(``HarnessAgent.label_records``), and ``--config.privileged_after=k`` lets the policy act k steps past each
subtask's completion before the privileged check ends it: the completion detector's harness episodes
(``experiments.detector --config.detector.harness_episodes``).

The last line: ``goal_success_expert=<a> progress_expert=<b> goal_success_policy=<c> progress_policy=<d>``.
"""

from __future__ import annotations

import os

from absl import app, flags

from experiments.config_cli import define_config


def _fmt(summary: dict, ex: str, key: str) -> str:
    v = summary["by_executor"].get(ex, {}).get(key)
    return "n/a" if v is None or v != v else f"{v:.2f}"


def _row(r: dict) -> str:
    keys = ("planner_calls", "planner_retries", "recoveries", "replans")
    extra = " ".join(f"{k}={r[k]}" for k in keys if k in r)
    return (f"{r['executor']:18s} {r['task']:15s} seed {r['seed']}: success={r['success']} "
            f"progress={r['progress']:.2f} steps={r['steps']} ({r['seconds']:.0f} s) {extra} {r['error']}")


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    from histeve_jax.harness.controller import HarnessSpec
    from histeve_jax.harness.planners import make_planner
    from histeve_jax.harness.suite import SuiteSpec, run_suite

    c = flags.FLAGS.config
    executors = tuple(e for e in c.executors if e != "policy" or c.policy)
    try:
        spec = SuiteSpec(tasks=tuple(c.tasks), episodes=c.episodes, seed=c.seed, executors=executors,
                         policy=c.policy, step=None if c.step < 0 else c.step, greedy=c.greedy,
                         temperature=c.temperature, top_p=c.top_p, inject=c.inject, max_steps=c.max_steps,
                         policy_max_steps=c.policy_max_steps, obs_size=tuple(c.obs_size), out_dir=c.out_dir,
                         reports=c.reports, env=dict(c.env), harness=HarnessSpec(**dict(c.harness)),
                         detector=c.detector, detector_every=c.detector_every,
                         detector_threshold=c.detector_threshold, completion=c.completion,
                         goal_only=c.goal_only, resume=c.resume, records=c.records,
                         privileged_after=c.privileged_after)
        planner = make_planner(c)
        summary = run_suite(spec, planner, on_episode=lambda r: print(_row(r), flush=True))
    except (ValueError, FileNotFoundError) as e:  # bad input: one line naming it
        raise SystemExit(f"error: {e}") from None
    for ex, s in summary["by_executor"].items():
        print(f"{ex}: goal_success={s['goal_success']:.2f} progress={s['progress']:.2f} over {s['episodes']} "
              f"episodes ({s['interrupted']} interrupted)")
    print(f"results: {summary['out_dir']}/summary.json")
    print(f"goal_success_expert={_fmt(summary, 'expert', 'goal_success')} "
          f"progress_expert={_fmt(summary, 'expert', 'progress')} "
          f"goal_success_policy={_fmt(summary, 'policy', 'goal_success')} "
          f"progress_policy={_fmt(summary, 'policy', 'progress')}")


if __name__ == "__main__":
    define_config(os.path.join(os.path.dirname(__file__), "configs", "longhorizon.py:tiny"), "Suite config.")
    app.run(main)
