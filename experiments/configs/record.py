"""Recording scripted-expert demonstrations (and detector labels) from a game backend.

    python -m experiments.record --config=experiments/configs/record.py --workdir=/tmp/demos \\
        --config.tasks="('mine_log','craft_planks')" --config.episodes=20 --config.obs_size="(128, 128)"
"""

from __future__ import annotations

import ml_collections

from histeve_jax.envs.experts import EXPERT_TASKS

# record.py:pickaxe's starts beyond its tasks' own (task variants) and its episodes per task and variant
PICKAXE_VARIANTS = ("mine_log[beside=1]", "mine_log[against=1]", "mine_dirt[dug=1]")
PICKAXE_TASK_EPISODES = ("mine_log=128,craft_planks=48,craft_sticks=48,craft_wooden_pickaxe=112,"
                         "mine_log[beside=1]=64,mine_log[against=1]=48,mine_dirt[dug=1]=48")


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    """Fields: backend, tasks, episodes (per task, with per-task exceptions), obs size, frame format,
    output dir, env knobs."""
    c = ml_collections.ConfigDict()
    c.backend = "luanti"
    c.tasks = tuple(EXPERT_TASKS)  # on the command line: --config.tasks="('mine_log','craft_planks')"
    c.episodes = 10  # per task
    c.task_episodes = ""  # per-task exceptions to `episodes`: "mine_log=48,craft_sticks=20"
    c.seed = 0  # episode i of a task resets with seed + i
    c.randomize_init = True  # start pose drawn from the seed within the task's init.vary
    c.obs_size = (224, 224)  # (H, W) of the stored frames
    c.frame_format = "jpeg"
    c.jpeg_quality = 95
    c.output_dir = ""  # "": <workdir>/records
    c.records_per_shard = 2048
    c.after_success = 0  # steps played on after success (the completion detector's positives; rollout)
    c.keep_failed = False  # drop episodes whose expert did not succeed (they are still counted)
    # The chance, at each of the mining expert's aims at a side face (a log, stone), that it first looks off
    # the target and attacks there, and once in its dig that the view is thrown off (Expert.aim_off, jolt):
    # those steps are recorded with subtask "perturb", which training never imitates, so the expert's steps
    # after them demonstrate the way back. The same chance per craft, as the inventory opens and before each
    # pick and the output (its hand empty), that it first clicks where nothing happens (Expert.click_astray),
    # then moves on.
    c.perturb = 0.0
    c.progress_bar = True
    c.instances = 1  # games run in parallel (> 1: on a Ray fleet, eval.fleet)
    c.env = ml_collections.ConfigDict()
    c.env.fps_max = 30
    c.env.viewing_range = 40
    if arg == "tiny":  # a smoke run: two tasks, two short episodes each, small frames
        c.tasks = ("craft_planks", "place_dirt")
        c.episodes = 2
        c.obs_size = (64, 64)
    elif arg == "main":  # the main job's demonstrations: four atomic tasks, two games in parallel
        from experiments.configs.evaluate import MAIN_TASKS

        c.tasks = MAIN_TASKS
        c.episodes = 16
        c.obs_size = (112, 196)  # the main job's frames (imitation.py:tiny's data.image_size)
        c.instances = 2
    elif arg == "pickaxe":  # imitation.py:pickaxe's: the main four and the rest of wooden_pickaxe's subtasks
        from experiments.configs.evaluate import PICKAXE_TASKS

        # and the starts the long-horizon agent's episodes showed the policy stuck at, each a variant of its
        # task's start (tasks.load_task's "name[key=value]"), recorded after the task's own starts on the
        # seeds after them: the player beside a trunk it chopped once (the second log), pressed against a
        # trunk (bark filling the view, or looking up into its gap), and where dirt_wall's earlier digs
        # left it (README "The pickaxe variant": the fifth to seventh fine-tunes, recorded here from nothing)
        c.tasks = PICKAXE_TASKS + PICKAXE_VARIANTS
        c.episodes = 16
        # mine_log starts anywhere in the arena (its task's init.vary): every wooden_pickaxe episode needs
        # it twice, from wherever the harness left the player; half its aims first look off the log
        # (perturb), so the demonstrations show the way back to it. The crafts: as many as the fine-tunes
        # had (48 each, the pickaxe craft 64 more: its output click is the one it missed most)
        c.task_episodes = PICKAXE_TASK_EPISODES
        c.perturb = 0.5
        c.obs_size = (112, 196)
        c.instances = 2
    elif arg:
        raise ValueError(f"unknown record config variant {arg!r}; choose '', 'tiny', 'main' or 'pickaxe'")
    return c
