"""The ahead-of-time plan: which train step to compile for which pod, and the budget it must fit.

``:qwen7b`` (default) is the imitation stage's 7B step on a v5p-128 (64 chips, pure FSDP); ``:tiny`` is
the tiny policy on 8 simulated devices, for tests. The stage's own config lives under ``train``, so the
plan compiles exactly what ``experiments.imitation`` runs (override e.g. ``--config.train.model.remat=none``).

``:rl_qwen7b`` / ``:rl_tiny`` plan the RL learner's step (``histeve_jax.rl.plan``: the policy with its
optimizer state, the frozen reference, the mixed GRPO/DPO/replay batch of ``experiments.rl``'s ``rl`` group):
``train`` is then the learner's train config as ``rl.driver.learner_config`` derives it from the start run
(the imitation config of the same shape, with RL's batch size and the learner's microbatches). They also
plan the policy server's act step on one accelerator host (``act``: the batches compiled, the games it must
serve and their rate, the host's chips; ``histeve_jax.rl.plan.act_plan``), and how many such hosts serve
``act.games`` games at ``act.hz``.
"""

from __future__ import annotations

import ml_collections

from experiments.configs import imitation, rl

V5P_HBM_BYTES = 95e9  # per chip
V5P_BF16_FLOPS = 459e12  # per chip, peak
V5P_HBM_BYTES_PER_S = 2.765e12  # per chip
V5P_CHIPS_PER_HOST = 4


VARIANTS = ("qwen7b", "tiny", "rl_qwen7b", "rl_tiny")


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    variant = arg or "qwen7b"
    if variant not in VARIANTS:
        raise ValueError(f"unknown plan config variant {variant!r}; choose one of {VARIANTS}")
    shape = variant.removeprefix("rl_")
    c = ml_collections.ConfigDict()
    c.variant = variant
    c.train = imitation.get_config(shape)
    if variant.startswith("rl_"):
        run = rl.get_config(shape)
        c.rl = run.rl
        c.rl.reference = run.start_run  # what the driver fills in; the plan reads neither path
        c.rl.replay_dirs = f"{run.start_run}/data/train"
        learner = run.learner
        c.train.stage = "rl"
        c.train.microbatches = learner.microbatches
        from histeve_jax.rl.spec import RLSpec

        c.train.data.batch_size = RLSpec.from_config(c.rl).batch_size  # GRPO + DPO + replay rows
        c.act = ml_collections.ConfigDict()
        c.act.batches = (1, 8, 32, 128) if shape == "qwen7b" else (1, 2)  # rows per compiled act call
        c.act.games = 128  # games to serve ...
        c.act.hz = 20.0  # ... at this rate each
        c.act.chips_per_host = V5P_CHIPS_PER_HOST  # one inference host (a v5p-8 TPU VM)
        c.act.hbm_bytes_per_s = V5P_HBM_BYTES_PER_S
        c.act.mfu = 0.4  # assumed for the act program's FLOPs (not measured)
        c.act.learner_hosts = 16  # the learner slice (v5p-128) the actors feed
    c.num_devices = 64 if shape == "qwen7b" else 8  # simulated CPU devices = chips of the target slice
    if variant == "rl_tiny":
        c.num_devices = 4  # the tiny RL batch, 16 + 8 + 4 = 28 rows, splits 4 ways, not 8
    c.mesh = ml_collections.ConfigDict({"ici": {"data": 1, "fsdp": -1, "tensor": 1}})
    c.hbm_bytes = V5P_HBM_BYTES
    c.hbm_budget = 0.6  # the step must fit in this fraction of one chip's HBM
    c.peak_flops = V5P_BF16_FLOPS
    c.flops_tolerance = 1.05  # compiled / analytic FLOPs without remat
    # "unrolled_layers": add the decoder layers a scanned body hides from cost analysis (it counts a loop
    # body once), measured on 1- and 2-layer unrolled text-only copies; "scanned": the program's own count.
    c.flops_from = "unrolled_layers"
    return c
