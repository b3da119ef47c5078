"""DAgger from an imitation run: the policy plays, the scripted expert takes over and labels, retrain.

``python -m experiments.dagger --config.start_run=<imitation workdir>`` (default: the main job's run).
Fields are ``histeve_jax.train.dagger.DaggerSpec``'s, plus ``eval`` (the closed-loop evaluation of the last
round, ``experiments/configs/evaluate.py``'s fields; its seeds are the held-out ones, apart from DAgger's).
"""

from __future__ import annotations

import ml_collections

from experiments.configs.evaluate import MAIN_TASKS, eval_fields


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.start_run = "/tmp/histeve_runs/imitation_tiny"
    c.workdir = "/tmp/histeve_runs/dagger_tiny"  # when --workdir is not given
    c.tasks = MAIN_TASKS
    c.rounds = 2
    c.episodes = 16  # per task and round
    c.seed = 2000  # DAgger's own seeds: demonstrations use 0.., validation 500.., evaluation 1000..
    c.min_switch = 0
    c.max_switch = 60
    c.max_steps = 200
    c.train_steps = 500
    c.instances = 2
    c.temperature = 1.0
    c.env = ml_collections.ConfigDict({"randomize_init": True, "fps_max": 30, "viewing_range": 40})
    c.eval = eval_fields()
    c.eval.enabled = True
    if arg not in (None, "", "tiny"):
        raise ValueError(f"unknown dagger config variant {arg!r}; choose tiny")
    return c
