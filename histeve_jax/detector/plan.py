"""Ahead-of-time plan of the detector's train step, as ``experiments/plan.py`` plans the policy's: the jitted
step (frozen policy forward, detector forward and backward, AdamW on the detector) lowered and compiled
over a mesh of simulated CPU devices with abstract state and batch that carry their shardings; nothing is
allocated. Figures: per-device parameter / frozen-policy / optimizer bytes from the shardings, the
compiled program's ``memory_analysis()`` and its fraction of one chip's HBM.
"""

from __future__ import annotations

import math
import time
from typing import Any

import jax
import jax.numpy as jnp

from histeve_jax.detector.config import DetectorConfig
from histeve_jax.detector.coupled import frame_slots
from histeve_jax.detector.stage import detector_stage
from histeve_jax.parallel import axes, sharding
from histeve_jax.policy import PolicyConfig
from histeve_jax.train import optimizer
from histeve_jax.train import state as state_lib
from histeve_jax.train import step as step_lib
from histeve_jax.train.specs import RunSpec


def abstract_batch(config: DetectorConfig, policy_config: PolicyConfig, batch_size: int) -> dict[str, Any]:
    """ShapeDtypeStructs of one global detector batch (``coupled`` module docstring)."""
    s, B = jax.ShapeDtypeStruct, batch_size
    S = len(frame_slots(config, policy_config.num_frames)[0])
    return {"pixel_values": s((B, config.query_patches(S), policy_config.base.vision.patch_dim), jnp.float32),
            "input_ids": s((B, config.max_len), jnp.int32),
            "attention_mask": s((B, config.max_len), jnp.int32),
            "policy_input_ids": s((B, config.policy_max_len), jnp.int32),
            "policy_attention_mask": s((B, config.policy_max_len), jnp.int32),
            "regime": s((B,), jnp.int32), "label": s((B,), jnp.int32)}


def plan_step(spec: RunSpec, config: DetectorConfig, policy_config: PolicyConfig, mesh: Any,
              hbm_bytes: float) -> dict[str, float]:
    """Compile the detector's step on ``mesh`` and return its figures (bytes per device, HBM fraction)."""
    stage = detector_stage(spec, config, policy_config)
    tx, schedule = optimizer.make_optimizer(spec.optimizer)
    t0 = time.time()
    abstract, shardings = state_lib.abstract_train_state(stage.init_model, tx, mesh, axes.RULES)
    missing = sharding.unannotated_params(abstract.params)
    if missing:
        raise ValueError(f"detector plan: parameters without logical axis names: {missing}")
    batch = abstract_batch(config, policy_config, spec.data.batch_size)
    key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype)
    fn = step_lib.make_train_step(stage.loss_fn, tx, schedule=schedule, microbatches=spec.loop.microbatches)
    lowered = step_lib.jit_train_step(fn, shardings, mesh, axes.RULES).lower(abstract, batch, key)
    t1 = time.time()
    compiled = lowered.compile()
    mem = compiled.memory_analysis()
    hbm = (mem.argument_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes
           + mem.temp_size_in_bytes)
    count = lambda tree: sum(math.prod(x.shape) for x in jax.tree.leaves(tree))
    return {"lower_s": t1 - t0, "compile_s": time.time() - t1, "devices": float(mesh.devices.size),
            "trainable_params": float(count(abstract.params)), "frozen_params": float(count(abstract.rest)),
            "params_bytes": float(sharding.bytes_per_device(abstract.params)),
            "frozen_bytes": float(sharding.bytes_per_device(abstract.rest)),
            "opt_bytes": float(sharding.bytes_per_device(abstract.opt_state)),
            "argument_bytes": float(mem.argument_size_in_bytes), "temp_bytes": float(mem.temp_size_in_bytes),
            "hbm_bytes": float(hbm), "hbm_fraction": hbm / hbm_bytes}


def describe(fig: dict[str, float], mesh: Any, hbm_name: str = "v5p") -> list[str]:
    """The plan's lines for a console."""
    gb = lambda x: f"{x / 1e9:.2f} GB"
    shape = " ".join(f"{k}={v}" for k, v in mesh.shape.items())
    return [
        f"detector step on mesh {shape} ({int(fig['devices'])} simulated devices): "
        f"lower {fig['lower_s']:.1f} s, compile {fig['compile_s']:.1f} s",
        f"trainable (detector) {fig['trainable_params'] / 1e9:.3f}B parameters, frozen (policy) "
        f"{fig['frozen_params'] / 1e9:.3f}B",
        f"per device: detector parameters {gb(fig['params_bytes'])}, "
        f"frozen policy {gb(fig['frozen_bytes'])}, "
        f"optimizer state {gb(fig['opt_bytes'])}; memory_analysis arguments {gb(fig['argument_bytes'])}, "
        f"temporaries {gb(fig['temp_bytes'])}, total {gb(fig['hbm_bytes'])} = {fig['hbm_fraction']:.3f} of "
        f"{hbm_name} HBM",
    ]
