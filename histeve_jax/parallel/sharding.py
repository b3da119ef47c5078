"""Shardings of a state tree (parameters, optimizer state) from the logical names in its ``out_sharding``
metadata, and what those shardings cost per device.

Each tensor is placed by ``axes.partition_spec`` (the one resolver of the one rules table, ``axes.RULES``),
as loaded weights and activations are. Optimizer state needs no rules of its own: optax maps over the
``nnx.Variable`` nodes of the parameters, so ``mu``/``nu`` carry the same metadata and shard identically.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from histeve_jax.parallel import axes
from histeve_jax.parallel.axes import Rules


def _is_var(x: Any) -> bool:
    return isinstance(x, nnx.Variable)


def _path_str(path: tuple[Any, ...]) -> str:
    return jax.tree_util.keystr(path, simple=True, separator="/")


def logical_names(var: nnx.Variable) -> tuple[str | None, ...] | None:
    """The logical axis names in a Variable's ``out_sharding`` metadata, or None when it has none."""
    meta = var.get_metadata()
    names = meta.get("out_sharding")
    return tuple(names) if names else None


def tree_shardings(
    tree: Any, mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh, rules: Rules = axes.RULES
) -> Any:
    """A tree like ``tree`` (state of Variables and plain arrays) with a NamedSharding in place of each value.

    Variables shard by their logical names; plain arrays (step counters, Adam's count) are replicated.
    """

    def one(path: tuple[Any, ...], x: Any) -> Any:
        if _is_var(x):
            value = x.get_value()
            names = logical_names(x)
            if names is None or not hasattr(value, "shape"):
                return x.replace(NamedSharding(mesh, PartitionSpec()))
            spec = axes.partition_spec(value.shape, names, mesh, rules, where=_path_str(path))
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
        n = math.prod(sizes[a] for a in ((entry,) if isinstance(entry, str) else entry or ()))
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
