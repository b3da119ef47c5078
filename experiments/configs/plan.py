"""The ahead-of-time plan: which train step to compile for which pod, and the budget it must fit.

``:qwen7b`` (default) is the imitation stage's 7B step on a v5p-128 (64 chips, pure FSDP); ``:tiny`` is
the tiny policy on 8 simulated devices, for tests. The stage's own config lives under ``train``, so the
plan compiles exactly what ``experiments.imitation`` runs (override e.g. ``--config.train.model.remat=none``).
"""

from __future__ import annotations

import ml_collections

from experiments.configs import imitation

V5P_HBM_BYTES = 95e9  # per chip
V5P_BF16_FLOPS = 459e12  # per chip, peak


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    variant = arg or "qwen7b"
    c = ml_collections.ConfigDict()
    c.variant = variant
    c.train = imitation.get_config(variant)
    c.num_devices = 64 if variant == "qwen7b" else 8  # simulated CPU devices = chips of the target slice
    c.mesh = ml_collections.ConfigDict({"ici": {"data": 1, "fsdp": -1, "tensor": 1}})
    c.hbm_bytes = V5P_HBM_BYTES
    c.hbm_budget = 0.6  # the step must fit in this fraction of one chip's HBM
    c.peak_flops = V5P_BF16_FLOPS
    c.flops_tolerance = 1.05  # compiled / analytic FLOPs without remat
    # "unrolled_layers": add the decoder layers a scanned body hides from cost analysis (it counts a loop
    # body once), measured on 1- and 2-layer unrolled text-only copies; "scanned": the program's own count.
    c.flops_from = "unrolled_layers"
    return c
