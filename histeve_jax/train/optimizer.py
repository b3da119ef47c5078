"""AdamW with linear warm-up, cosine decay and global-norm clipping, from an ml_collections config."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from histeve_jax.parallel import axes

# Fields of `config.optimizer` and their defaults (the :qwen7b stage configs override lr and steps).
DEFAULTS: dict[str, Any] = {
    "learning_rate": 1e-5,
    "warmup_steps": 100,
    "total_steps": 10_000,
    "end_lr_factor": 0.1,  # the cosine decays to learning_rate * end_lr_factor
    "b1": 0.9,
    "b2": 0.95,
    "eps": 1e-8,
    "weight_decay": 0.1,
    "clip_norm": 1.0,  # 0 or None: no clipping
    "mu_dtype": None,  # e.g. "bfloat16" halves the first moment's memory
    # The vision tower's step relative to the rest (its learning rate times this; 0 freezes it). A random
    # tiny tower at the decoder's 1e-3 collapses to one constant output (measured: README "The GUI").
    "vision_lr_factor": 1.0,
}

# Parameters under this path component are the vision tower's (Qwen2_5_VLModel.visual).
VISION_PATH_KEY = "visual"

# Scales, biases and norm weights are not decayed; their names hold these keys.
_NO_DECAY_NAMES = ("bias", "scale", "norm")


def _cfg(cfg: Any) -> dict[str, Any]:
    given = dict(cfg) if cfg is not None else {}
    unknown = set(given) - set(DEFAULTS)
    if unknown:
        raise ValueError(f"config.optimizer: unknown fields {sorted(unknown)}; known: {sorted(DEFAULTS)}")
    return {**DEFAULTS, **given}


def learning_rate_schedule(cfg: Any) -> optax.Schedule:
    """Linear warm-up from 0 to ``learning_rate`` over ``warmup_steps``, then cosine decay to
    ``learning_rate * end_lr_factor`` at ``total_steps``."""
    c = _cfg(cfg)
    warmup = int(c["warmup_steps"])
    total = int(c["total_steps"])
    if total <= warmup:
        raise ValueError(f"config.optimizer: total_steps={total} must exceed warmup_steps={warmup}")
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=float(c["learning_rate"]),
        warmup_steps=warmup,
        decay_steps=total,
        end_value=float(c["learning_rate"]) * float(c["end_lr_factor"]),
    )


def decay_mask(params: Any) -> Any:
    """True for weight matrices; False for biases, norm scales and other vectors (stacked layers excluded)."""

    def one(path: tuple[Any, ...], var: Any) -> Any:
        value = var.get_value() if isinstance(var, nnx.Variable) else var
        names = tuple(var.get_metadata().get("out_sharding") or ()) if isinstance(var, nnx.Variable) else ()
        # A scanned stack adds a `layers` axis; the matrix-ness of a tensor is its rank without it.
        rank = value.ndim - (1 if axes.LAYERS in names else 0)
        key = jax.tree_util.keystr(path, simple=True, separator="/").lower()
        is_vector_like = rank < 2 or any(n in key.rsplit("/", 1)[-1] for n in _NO_DECAY_NAMES)
        is_vector_like = is_vector_like or axes.NORM in names or axes.REGIME in names
        flag = not is_vector_like
        return var.replace(flag) if isinstance(var, nnx.Variable) else flag

    return jax.tree_util.tree_map_with_path(one, params, is_leaf=lambda x: isinstance(x, nnx.Variable))


def vision_mask(params: Any) -> Any:
    """True for the vision tower's parameters (a ``visual`` component in their path)."""

    def one(path: tuple[Any, ...], var: Any) -> Any:
        parts = jax.tree_util.keystr(path, simple=True, separator="/").split("/")
        flag = VISION_PATH_KEY in parts
        return var.replace(flag) if isinstance(var, nnx.Variable) else flag

    return jax.tree_util.tree_map_with_path(one, params, is_leaf=lambda x: isinstance(x, nnx.Variable))


def make_optimizer(cfg: Any) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """(AdamW chain with clipping, its learning-rate schedule) from ``config.optimizer``."""
    c = _cfg(cfg)
    schedule = learning_rate_schedule(c)
    mu_dtype = jnp.dtype(c["mu_dtype"]) if c["mu_dtype"] else None
    parts = []
    if c["clip_norm"]:
        parts.append(optax.clip_by_global_norm(float(c["clip_norm"])))
    parts.append(
        optax.adamw(
            schedule,
            b1=float(c["b1"]),
            b2=float(c["b2"]),
            eps=float(c["eps"]),
            weight_decay=float(c["weight_decay"]),
            mu_dtype=mu_dtype,
            mask=decay_mask,
        )
    )
    factor = float(c["vision_lr_factor"])
    if factor < 0:
        raise ValueError(f"config.optimizer.vision_lr_factor={factor} must be >= 0")
    if factor != 1.0:  # (1.0 adds nothing, so the optimizer state of older checkpoints keeps its shape)
        parts.append(optax.masked(optax.scale(factor), vision_mask))
    return optax.chain(*parts), schedule


def global_norm(tree: Any) -> jax.Array:
    """The L2 norm over all leaves (for logging gradient and parameter norms)."""
    return optax.tree.norm(tree)
