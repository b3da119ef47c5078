"""The paper's ablation on Luanti: shared representation vs RS-Norm vs Dual-Mouse vs both, then + world
knowledge and + RL; the same data, steps and held-out seeds for every row.

``python -m experiments.ablation`` (fields below; ``imitation`` overrides the main job's config for every
row, ``eval`` is ``experiments/configs/evaluate.py``'s fields).
"""

from __future__ import annotations

import ml_collections

from experiments.configs.evaluate import eval_fields

# (name, rs_norm, dual_mouse): the representation rows, in the paper's order.
ROWS = (("shared", False, False), ("rs_norm", True, False), ("dual_mouse", False, True), ("full", True, True))


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.workdir = "/tmp/histeve_runs/ablation"  # when --workdir is not given
    c.rows = tuple(name for name, *_ in ROWS)
    # The world-knowledge row: stage 1's run (trained first when absent) initialises the full model.
    c.world_knowledge = True
    c.world_knowledge_run = ""  # "": <workdir>/world_knowledge (python -m experiments.world_knowledge)
    # The RL row: stage 3 on the GUI task from the full row, for this many minutes (0: no RL row).
    c.rl_minutes = 20.0
    c.rl_task = "craft_planks"
    # Overrides of experiments.rl's config for the RL row ("key=value", as `imitation`). At rl.py's defaults
    # (1e-4, 4 replayed demonstrations a batch) stage 3 undid the full row's crafting twice (0.60 -> 0.25 on
    # 2026-12-04, 0.85 -> 0.30 on 2026-12-07); at 3e-5 with 8 it went 0.70 -> 0.90 (README, "Stage 3").
    c.rl = ("learner.learning_rate=3e-5", "rl.replay_rows=8")
    # Overrides of the imitation main job's config (experiments/configs/imitation.py:tiny) for every row, as
    # "key=value" strings handed to it on its command line.
    c.imitation = ()
    c.eval = eval_fields()
    c.eval.agents = ("policy",)  # the expert's rate on the same seeds comes from the full row's evaluation
    c.eval.episodes = 20
    if arg not in (None, "", "tiny"):
        raise ValueError(f"unknown ablation config variant {arg!r}; choose tiny")
    return c
