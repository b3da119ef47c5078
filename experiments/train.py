"""The training program of every stage (big_vision's one ``train.py``): the config chooses the stage.

    python -m experiments.train --config=experiments/configs/imitation.py:tiny
    python -m experiments.train --config=experiments/configs/world_knowledge.py:qwen7b --workdir=/mnt/wk

``python -m experiments.imitation`` and ``python -m experiments.world_knowledge`` are this program with
their stage's config as the default. The library is ``histeve_jax.train``; this file only reads flags.
"""

from __future__ import annotations

import os
from typing import Any

from absl import app, flags

from experiments.config_cli import define_config

CONFIGS = os.path.join(os.path.dirname(__file__), "configs")


def evaluate_closed_loop(spec: Any) -> dict:
    """Play the trained run in the game on held-out seeds (the config's ``eval`` group) and print the table,
    where the run and its report are, the commands that evaluate or export it, and the headline line."""
    from histeve_jax.eval.evaluate import EvalSpec, evaluate, print_report

    fields = {k: v for k, v in spec.closed_loop.items() if k != "enabled"}
    fields["policy"] = spec.workdir
    fields["out_dir"] = fields.get("out_dir") or os.path.join(spec.workdir, "eval")
    fields["obs_size"] = spec.data.image_size
    summary = evaluate(EvalSpec.from_config(fields))
    print(f"run: {spec.workdir} (config.json, checkpoints/, TensorBoard events)")
    print("evaluate again: python3 -m experiments.evaluate --config=experiments/configs/evaluate.py:tiny "
          f"--config.policy={spec.workdir}")
    print(f"export for PyTorch: python3 -m histeve_jax.export --run={spec.workdir} --out=/tmp/histeve_export")
    print_report(summary)
    return summary


def run(default_config: str) -> None:
    """Define the flags (``--config`` defaulting to ``configs/<default_config>``, ``--workdir``) and train."""
    define_config(os.path.join(CONFIGS, default_config))
    workdir = flags.DEFINE_string("workdir", None, "Run directory (default: config.workdir).")

    def main(argv: list[str]) -> None:
        if len(argv) > 1:
            raise app.UsageError(f"unexpected arguments: {argv[1:]}")
        from histeve_jax.train.loop import train
        from histeve_jax.train.specs import RunSpec

        spec = RunSpec.from_config(flags.FLAGS.config, workdir.value)
        train(spec)
        if spec.closed_loop.get("enabled"):
            evaluate_closed_loop(spec)

    app.run(main)  # grain's worker processes need the program started by absl.app.run


if __name__ == "__main__":
    run("imitation.py:tiny")
