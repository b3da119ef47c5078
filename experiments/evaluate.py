"""Closed-loop evaluation of a trained run: per task the success rate (95% Wilson interval) and mean steps
of the policy, the scripted expert and a random policy on the same held-out seeds.

    python -m experiments.evaluate --config=experiments/configs/evaluate.py:tiny --config.policy=<workdir>
"""

from __future__ import annotations

import os

from absl import app, flags

from experiments.config_cli import define_config

define_config(os.path.join(os.path.dirname(__file__), "configs", "evaluate.py:tiny"), "Evaluation config.")


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    from absl import logging

    from histeve_jax.eval.evaluate import EvalSpec, evaluate, print_report

    logging.set_verbosity(logging.WARNING)  # orbax's restore chatter would bury the table
    c = flags.FLAGS.config
    out_dir = c.out_dir or (os.path.join(c.policy, "eval") if c.policy else "/tmp/histeve_runs/evaluate")
    try:
        spec = EvalSpec.from_config(c, out_dir=out_dir)
        summary = evaluate(spec)
    except (ValueError, FileNotFoundError) as e:  # bad input: one line naming it, before any game starts
        raise SystemExit(f"error: {e}") from None
    print_report(summary)


if __name__ == "__main__":
    app.run(main)
