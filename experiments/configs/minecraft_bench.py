"""The Minecraft suites on the MineStudio backend: MineStudio Bench (VLM-judged) or OpenHA-style (reward).

    python -m experiments.minecraft_bench --config=experiments/configs/minecraft_bench.py
    python -m experiments.minecraft_bench --config=experiments/configs/minecraft_bench.py:openha \
        --config.agent=policy --config.policy=<workdir>

Fields are ``histeve_jax.eval.suites.minecraft.SuiteSpec``'s (``judge``: ``vlm_judge.JudgeSpec``'s) plus the
agent's. ``tasks``: for Bench a split (``simple``, ``hard``), ``split/name`` or a name found in one split;
for OpenHA the shipped names (``histeve_jax/eval/suites/openha_tasks``) or YAML paths; empty = all. The judge
reads OPENAI_API_KEY / OPENAI_BASE_URL when ``judge.api_key`` / ``judge.base_url`` are empty; without a key
the Bench episodes run unjudged.
"""

from __future__ import annotations

import ml_collections

HELD_OUT_SEED = 1000  # as experiments/configs/evaluate.py: training episodes use seeds 0, 1, ...


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    variant = arg or "minestudio_bench"
    if variant not in ("minestudio_bench", "openha"):
        raise ValueError(f"unknown minecraft_bench variant {variant!r}; choose minestudio_bench or openha")
    c = ml_collections.ConfigDict()
    c.suite = variant
    c.tasks = ("simple",) if variant == "minestudio_bench" else ()
    c.episodes = 1
    c.seed = HELD_OUT_SEED
    c.max_steps = 0  # 0: the task's (Bench 600, OpenHA 400)
    c.obs_size = (224, 224)  # also the judge's frames
    c.out_dir = f"/tmp/histeve_runs/{variant}"
    c.reports = True
    c.retries = 1
    c.agent = "random"  # or "policy" (a run's workdir in `policy`)
    c.policy = ""
    c.step = -1  # the policy's checkpoint; -1: the latest
    c.greedy = False
    c.temperature = 1.0
    c.codebook = "vpt"  # the random agent's action grammar
    c.judge = ml_collections.ConfigDict({
        "base_url": "", "model": "gpt-4o", "api_key": "", "timeout_s": 120.0, "max_attempts": 3,
        "connection_retries": 2, "max_images": 16, "temperature": 0.5})
    return c
