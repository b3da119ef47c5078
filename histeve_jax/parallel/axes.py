"""Logical axis names and the one rules table that maps them to mesh axes.

Every parameter carries logical names in its ``out_sharding`` metadata (as ``nnx.with_partitioning`` sets);
activations are constrained at layer boundaries with :func:`constrain`. Which mesh axis a logical axis lands
on is decided here and nowhere else, so FSDP, tensor parallelism and their mix are a choice of rules.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Sequence

import jax
from flax.linen import spmd

# Parameter axes (text decoder and vision tower share the names).
VOCAB = "vocab"
EMBED = "embed"
MLP = "mlp"
Q_HEADS = "q_heads"
KV_HEADS = "kv_heads"
HEAD_DIM = "head_dim"
LAYERS = "layers"  # the stacked axis of scanned layers
NORM = "norm"  # 1-D scale vectors and biases' feature axis when kept replicated
REGIME = "regime"  # RS-Norm's per-regime axis
PATCH = "patch"  # flattened patch input of the vision patch embedding

# Activation axes.
ACT_BATCH = "activation_batch"
ACT_LENGTH = "activation_length"
ACT_EMBED = "activation_embed"
ACT_MLP = "activation_mlp"
ACT_HEADS = "activation_heads"
ACT_KV_HEADS = "activation_kv_heads"
ACT_HEAD_DIM = "activation_head_dim"
ACT_VOCAB = "activation_vocab"

Rules = tuple[tuple[str, str | tuple[str, ...] | None], ...]

# FSDP over `fsdp` (and data), tensor parallelism over `tensor`. A mesh axis of size 1 makes its rule a no-op.
DEFAULT_RULES: Rules = (
    (VOCAB, "tensor"),
    (EMBED, "fsdp"),
    (MLP, "tensor"),
    (Q_HEADS, "tensor"),
    (KV_HEADS, "tensor"),
    (HEAD_DIM, None),
    (LAYERS, None),
    (NORM, None),
    (REGIME, None),
    (PATCH, None),
    (ACT_BATCH, ("data", "fsdp")),
    (ACT_LENGTH, None),
    (ACT_EMBED, None),
    (ACT_MLP, "tensor"),
    (ACT_HEADS, "tensor"),
    (ACT_KV_HEADS, "tensor"),
    (ACT_HEAD_DIM, None),
    (ACT_VOCAB, "tensor"),
)

_ACTIVE: contextvars.ContextVar[tuple[jax.sharding.Mesh, Rules] | None] = contextvars.ContextVar(
    "histeve_active_mesh_rules", default=None
)


@contextlib.contextmanager
def activate(mesh: jax.sharding.Mesh, rules: Rules = DEFAULT_RULES) -> Iterator[None]:
    """Within this context, :func:`constrain` shards activations over ``mesh`` by ``rules``."""
    token = _ACTIVE.set((mesh, rules))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def logical_to_spec(names: Sequence[str | None], rules: Rules = DEFAULT_RULES) -> jax.sharding.PartitionSpec:
    """The mesh PartitionSpec for a tuple of logical axis names."""
    return spmd.logical_to_mesh_axes(tuple(names), rules)


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
    """Sharding constraint on an activation by logical names; the identity when no mesh is active."""
    active = _ACTIVE.get()
    if active is None:
        return x
    mesh, rules = active
    spec = logical_to_spec(names, rules)
    return jax.lax.with_sharding_constraint(x, jax.sharding.NamedSharding(mesh, spec))


def batch_mesh_axes() -> tuple[str, ...] | None:
    """The mesh axes the batch axis of activations shards over under the active mesh, or None outside one
    (for ``jax.vmap(spmd_axis_name=...)`` over a batch-like axis, so constraints inside keep it split)."""
    active = _ACTIVE.get()
    if active is None:
        return None
    mesh, rules = active
    entry = logical_to_spec((ACT_BATCH,), rules)[0]
    if entry is None:
        return None
    names = (entry,) if isinstance(entry, str) else tuple(entry)
    return tuple(a for a in names if a in mesh.axis_names) or None
