"""Closed-loop evaluation of a trained run in the game, beside the scripted expert and a random policy.

    python -m experiments.evaluate --config=experiments/configs/evaluate.py:tiny --config.policy=<workdir>
    python -m experiments.evaluate --config=experiments/configs/evaluate.py:atomic --config.policy=<workdir>
    python -m experiments.evaluate --config=experiments/configs/evaluate.py:longhorizon --config.policy=W

``tiny``: the main job's four atomic tasks; ``atomic``: the Luanti atomic suite (every atomic task with an
expert, each on its own step budget); ``longhorizon``: the steel pickaxe from scratch (goal success, and the
fraction of its subgoals verified as diagnostic progress).

Fields are ``histeve_jax.eval.evaluate.EvalSpec``'s. Held-out seeds start at 1000 (the recorder's
training episodes use seeds 0, 1, ...), fixed here before any result was looked at.
"""

from __future__ import annotations

import ml_collections

MAIN_TASKS = ("place_dirt", "mine_dirt", "build_wall", "craft_planks")  # the main job's atomic tasks
# imitation.py:pickaxe adds the other subtasks of wooden_pickaxe (a log, sticks, the pickaxe itself)
PICKAXE_TASKS = MAIN_TASKS + ("mine_log", "craft_sticks", "craft_wooden_pickaxe")
HELD_OUT_SEED = 1000


def eval_fields(variant: str = "tiny") -> ml_collections.ConfigDict:
    """The evaluation fields (also the ``eval`` group of the imitation config)."""
    c = ml_collections.ConfigDict()
    c.tasks = MAIN_TASKS
    c.episodes = 10  # per task and agent
    c.seed = HELD_OUT_SEED
    c.agents = ("policy", "expert", "random")
    c.policy = ""  # a run's workdir
    c.step = -1  # its checkpoint; -1: the latest
    c.greedy = False
    c.temperature = 1.0
    c.top_p = 1.0  # < 1: sample each action token from its nucleus
    # Steps per episode: about 3x the expert's longest (craft_planks, 44), so a failure costs 6 s of game
    # time rather than the task's full budget (200-400 steps).
    c.max_steps = 120
    c.after_success = 0  # steps played on past success (the detector's rollouts: what the policy does then)
    c.instances = 2
    c.obs_size = ()  # (H, W); (): the policy run's image size (56x56 for the expert and random alone)
    c.out_dir = ""  # "": <policy workdir>/eval
    c.reports = 1
    c.progress_bar = True
    c.ray_address = ""
    c.env = ml_collections.ConfigDict({"randomize_init": True, "fps_max": 30, "viewing_range": 40})
    c.codebook = "vpt"
    if variant == "atomic":  # the Luanti atomic suite: every atomic task with an expert, its own budget
        from histeve_jax.envs.experts import EXPERT_TASKS

        c.tasks = EXPERT_TASKS
        c.max_steps = 0
    elif variant == "longhorizon":  # the steel pickaxe from scratch: goal success and subgoal progress
        c.tasks = ("steel_pickaxe",)
        c.agents = ("policy", "expert")
        c.episodes = 4
        c.max_steps = 0
        c.instances = 1
    elif variant not in ("tiny", ""):
        raise ValueError(f"unknown evaluate config variant {variant!r}; choose tiny, atomic or longhorizon")
    return c


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    return eval_fields(arg or "tiny")
