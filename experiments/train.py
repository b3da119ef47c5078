"""The training program of every stage (big_vision's one ``train.py``): the config chooses the stage.

    python -m experiments.train --config=experiments/configs/imitation.py:tiny
    python -m experiments.train --config=experiments/configs/world_knowledge.py:qwen7b --workdir=/mnt/wk

``python -m experiments.imitation`` and ``python -m experiments.world_knowledge`` are this program with
their stage's config as the default. The library is ``histeve_jax.train``; this file only reads flags.
"""

from __future__ import annotations

import os

from absl import app, flags

from experiments.config_cli import define_config

CONFIGS = os.path.join(os.path.dirname(__file__), "configs")


def run(default_config: str) -> None:
    """Define the flags (``--config`` defaulting to ``configs/<default_config>``, ``--workdir``) and train."""
    define_config(os.path.join(CONFIGS, default_config))
    workdir = flags.DEFINE_string("workdir", None, "Run directory (default: config.workdir).")

    def main(argv: list[str]) -> None:
        if len(argv) > 1:
            raise app.UsageError(f"unexpected arguments: {argv[1:]}")
        from histeve_jax.train.loop import train
        from histeve_jax.train.specs import RunSpec

        train(RunSpec.from_config(flags.FLAGS.config, workdir.value))

    app.run(main)  # grain's worker processes need the program started by absl.app.run


if __name__ == "__main__":
    run("imitation.py:tiny")
