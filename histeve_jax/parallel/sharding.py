"""Shardings of parameters and optimizer state from the logical names in their ``out_sharding`` metadata.

One rules table (a preset from :data:`PRESETS`) maps logical axes to mesh axes. A logical axis may appear in
several rules: the first whose mesh axes are unused in that tensor and divide its dimension wins, so presets
carry fall-backs (e.g. under FSDP the ``mlp`` axis takes ``fsdp`` when ``embed`` cannot). Optimizer state
needs no rules of its own: optax maps over the ``nnx.Variable`` nodes of the parameters, so ``mu``/``nu``
carry the same metadata and shard identically.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from histeve_jax.parallel import axes
from histeve_jax.parallel.axes import Rules

_ACTIVATION_RULES: Rules = tuple(r for r in axes.DEFAULT_RULES if r[0].startswith("activation_"))

# Under FSDP the ``embed`` axis carries ``fsdp``; these take it when ``embed`` is absent or indivisible.
_FSDP_FALLBACKS: Rules = (
    (axes.MLP, "fsdp"),
    (axes.Q_HEADS, "fsdp"),
    (axes.KV_HEADS, "fsdp"),
    (axes.VOCAB, "fsdp"),
    (axes.PATCH, "fsdp"),
    (axes.HEAD_DIM, "fsdp"),
)
_REPLICATED: Rules = (
    (axes.HEAD_DIM, None),
    (axes.LAYERS, None),
    (axes.NORM, None),
    (axes.REGIME, None),
    (axes.PATCH, None),
)

PRESETS: dict[str, Rules] = {
    # FSDP over `fsdp` mixed with tensor parallelism over `tensor`; either axis of size 1 disables its part.
    "fsdp_tensor": (
        (axes.VOCAB, "tensor"),
        (axes.EMBED, "fsdp"),
        (axes.MLP, "tensor"),
        (axes.Q_HEADS, "tensor"),
        (axes.KV_HEADS, "tensor"),
        *_FSDP_FALLBACKS,
        *_REPLICATED,
        *_ACTIVATION_RULES,
    ),
    # ZeRO-3 style: every large tensor split over `fsdp`, batch over (data, fsdp).
    "fsdp": (
        (axes.EMBED, "fsdp"),
        *_FSDP_FALLBACKS,
        (axes.VOCAB, None),
        (axes.MLP, None),
        (axes.Q_HEADS, None),
        (axes.KV_HEADS, None),
        *_REPLICATED,
        *tuple(r if r[0] == axes.ACT_BATCH else (r[0], None) for r in _ACTIVATION_RULES),
    ),
    # Megatron-style tensor parallelism over `tensor`, parameters otherwise replicated.
    "tensor": (
        (axes.VOCAB, "tensor"),
        (axes.EMBED, None),
        (axes.MLP, "tensor"),
        (axes.Q_HEADS, "tensor"),
        (axes.KV_HEADS, "tensor"),
        *_REPLICATED,
        *_ACTIVATION_RULES,
    ),
    # Plain data parallelism: parameters replicated.
    "data": (
        *((name, None) for name in (axes.VOCAB, axes.EMBED, axes.MLP, axes.Q_HEADS, axes.KV_HEADS)),
        *_REPLICATED,
        *tuple(r if r[0] == axes.ACT_BATCH else (r[0], None) for r in _ACTIVATION_RULES),
    ),
}


def rules_for(preset: str | Rules) -> Rules:
    """A rules table by preset name (``fsdp_tensor``, ``fsdp``, ``tensor``, ``data``), or the table itself."""
    if isinstance(preset, str):
        if preset not in PRESETS:
            raise ValueError(f"unknown sharding preset {preset!r}; choose one of {sorted(PRESETS)}")
        return PRESETS[preset]
    return tuple(preset)


def _mesh_axes(value: str | tuple[str, ...] | None) -> tuple[str, ...]:
    if value is None:
        return ()
    return (value,) if isinstance(value, str) else tuple(value)


def spec_for_shape(
    shape: tuple[int, ...],
    names: tuple[str | None, ...],
    axis_sizes: Mapping[str, int],
    rules: Rules,
    *,
    where: str = "tensor",
) -> PartitionSpec:
    """The PartitionSpec of one tensor: per dimension, the first rule whose mesh axes are free and divide
    it."""
    if len(names) != len(shape):
        raise ValueError(f"{where}: logical names {names} do not match its shape {shape}")
    known = {name for name, _ in rules}
    used: set[str] = set()
    out: list[str | tuple[str, ...] | None] = []
    for dim, name in zip(shape, names, strict=True):
        if name is None:
            out.append(None)
            continue
        if name not in known:
            raise ValueError(f"{where}: logical axis {name!r} has no rule; known: {sorted(known)}")
        chosen: tuple[str, ...] = ()
        for rule_name, value in rules:
            if rule_name != name:
                continue
            # Axes missing from this mesh or of size 1 shard nothing; drop them so specs stay readable.
            mesh_axes = tuple(a for a in _mesh_axes(value) if axis_sizes.get(a, 1) > 1)
            if any(a in used for a in mesh_axes):
                continue
            if dim % math.prod(axis_sizes[a] for a in mesh_axes):
                continue
            chosen = mesh_axes
            break
        used.update(chosen)
        out.append(None if not chosen else chosen[0] if len(chosen) == 1 else chosen)
    while out and out[-1] is None:
        out.pop()
    return PartitionSpec(*out)


def _is_var(x: Any) -> bool:
    return isinstance(x, nnx.Variable)


def _path_str(path: tuple[Any, ...]) -> str:
    return jax.tree_util.keystr(path, simple=True, separator="/")


def logical_names(var: nnx.Variable) -> tuple[str | None, ...] | None:
    """The logical axis names in a Variable's ``out_sharding`` metadata, or None when it has none."""
    meta = var.get_metadata()
    names = meta.get("out_sharding")
    return tuple(names) if names else None


def tree_shardings(tree: Any, mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh, rules: Rules) -> Any:
    """A tree like ``tree`` (state of Variables and plain arrays) with a NamedSharding in place of each value.

    Variables shard by their logical names; plain arrays (step counters, Adam's count) are replicated.
    """
    axis_sizes = dict(mesh.shape)

    def one(path: tuple[Any, ...], x: Any) -> Any:
        if _is_var(x):
            value = x.get_value()
            names = logical_names(x)
            if names is None or not hasattr(value, "shape"):
                return x.replace(NamedSharding(mesh, PartitionSpec()))
            spec = spec_for_shape(tuple(value.shape), names, axis_sizes, rules, where=_path_str(path))
            return x.replace(NamedSharding(mesh, spec))
        if hasattr(x, "shape"):
            return NamedSharding(mesh, PartitionSpec())
        return x

    return jax.tree_util.tree_map_with_path(one, tree, is_leaf=_is_var)


def with_shardings(abstract: Any, shardings: Any) -> Any:
    """Abstract arrays (``ShapeDtypeStruct``) that carry the given shardings, for AOT lowering and restore."""
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)


def unannotated_params(tree: Any) -> list[str]:
    """Paths of ``nnx.Param`` variables that carry no logical axis names (each one is a bug to fix)."""
    missing: list[str] = []

    def visit(path: tuple[Any, ...], x: Any) -> Any:
        if isinstance(x, nnx.Param) and logical_names(x) is None:
            missing.append(_path_str(path))
        return x

    jax.tree_util.tree_map_with_path(visit, tree, is_leaf=_is_var)
    return missing


def shard_shape(shape: tuple[int, ...], sharding: NamedSharding) -> tuple[int, ...]:
    """The per-device block shape of an array of ``shape`` under ``sharding`` (abstract meshes too)."""
    sizes = dict(sharding.mesh.shape)
    out = list(shape)
    for i, entry in enumerate(sharding.spec):
        n = math.prod(sizes[a] for a in _mesh_axes(entry))
        out[i] = -(-out[i] // n)
    return tuple(out)


def bytes_per_device(abstract: Any) -> int:
    """Bytes one device holds for a tree of sharded ``ShapeDtypeStruct``s."""
    total = 0
    for leaf in jax.tree.leaves(abstract):
        shape = shard_shape(tuple(leaf.shape), leaf.sharding)
        total += math.prod(shape) * np.dtype(leaf.dtype).itemsize
    return total


def replicated_tensors(abstract: Any, min_bytes: int) -> list[tuple[str, tuple[int, ...], int]]:
    """(path, shape, bytes) of sharded ``ShapeDtypeStruct`` leaves of ``min_bytes`` or more left whole."""
    found: list[tuple[str, tuple[int, ...], int]] = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(abstract)[0]:
        nbytes = math.prod(leaf.shape) * np.dtype(leaf.dtype).itemsize
        if nbytes >= min_bytes and shard_shape(tuple(leaf.shape), leaf.sharding) == tuple(leaf.shape):
            found.append((_path_str(path), tuple(leaf.shape), nbytes))
    return found
