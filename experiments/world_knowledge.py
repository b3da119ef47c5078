"""Stage 1: world-knowledge injection (VQA and captions); its workdir initialises imitation.

    python -m experiments.world_knowledge                 # tiny, synthetic VQA, a few minutes
    python -m experiments.world_knowledge --config=experiments/configs/world_knowledge.py:qwen7b \\
        --config.model.hf_path=/path/to/Qwen2.5-VL-7B-Instruct --config.data.train_dirs=/mnt/d/a,/mnt/d/b \\
        --workdir=/path/to/wk_run
    python -m experiments.imitation --config.init_from=/path/to/wk_run ...   # then stage 2
"""

from __future__ import annotations

import os

from absl import app, flags

from experiments import train_loop
from experiments.config_cli import define_config

_CONFIGS = os.path.join(os.path.dirname(__file__), "configs")
define_config(os.path.join(_CONFIGS, "world_knowledge.py:tiny"))
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory (default: config.workdir).")


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    train_loop.train(flags.FLAGS.config, _WORKDIR.value)


if __name__ == "__main__":
    app.run(main)  # grain's worker processes need the program started by absl.app.run
