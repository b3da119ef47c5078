"""Stage 1, world-knowledge injection: Minecraft VQA and captions (targets: the answer tokens).

``python -m experiments.world_knowledge --config=experiments/configs/world_knowledge.py:tiny`` or
``:qwen7b``; its workdir is then the ``init_from`` of stage 2 (imitation).
"""

from __future__ import annotations

import ml_collections

from experiments.configs.common import base_config


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    variant = arg or "tiny"
    c = base_config("world_knowledge", variant)
    c.data.kind = "world_knowledge"
    c.data.history = 0
    c.data.max_len = 64
    c.model.max_targets = 24  # answers are a sentence, plus <|im_end|>
    c.synthetic.train_size = 256
    c.synthetic.eval_size = 32
    c.num_train_steps = 200
    c.eval_every = 100
    c.checkpoint_every = 100
    if variant == "qwen7b":
        c.data.max_len = 144 + 256
        c.model.max_targets = 256
        c.num_train_steps = 5_000
        c.eval_every = 500
        c.checkpoint_every = 500
    return c
