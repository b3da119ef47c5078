"""Logical axis names, the one rules table that maps them to mesh axes, and the one function that resolves it.

Every parameter carries logical names in its ``out_sharding`` metadata (as ``nnx.with_partitioning`` sets);
activations are constrained at layer boundaries with :func:`constrain`. :data:`RULES` (MaxText's
``logical_axis_rules``) may list several mesh axes for one logical axis, tried in order, and
:func:`partition_spec` picks, per dimension, the first that fits the tensor's shape on the mesh. Parameters
(``sharding.tree_shardings``), loaded weights (``load_hf``, ``load_orbax``), activations and the input batch
are all placed by that one function, so the mesh's shape alone decides between FSDP (``fsdp`` > 1), tensor
parallelism (``tensor`` > 1), their mix, and plain data parallelism (both 1: parameters replicated).
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterator, Sequence

import jax
from jax.sharding import PartitionSpec

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

# Tried in order per logical axis (see `partition_spec`): a rule whose mesh axes are all of size 1 falls
# through, so on an fsdp-only mesh `vocab`, `mlp` and the heads take `fsdp` where `embed` did not.
# `None` replicates (and ends the search); a name with no rule that fits is replicated too.
RULES: Rules = (
    # Tensor parallelism over `tensor`, FSDP over `fsdp`.
    (VOCAB, "tensor"),
    (VOCAB, "fsdp"),
    (EMBED, "fsdp"),
    (MLP, "tensor"),
    (MLP, "fsdp"),
    (Q_HEADS, "tensor"),
    (Q_HEADS, "fsdp"),
    (KV_HEADS, "tensor"),
    (KV_HEADS, "fsdp"),
    (HEAD_DIM, "fsdp"),
    (PATCH, "fsdp"),
    (LAYERS, None),
    (NORM, None),
    (REGIME, None),
    # Activations: batch over (data, fsdp), features over `tensor` as their weights are.
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
def activate(mesh: jax.sharding.Mesh, rules: Rules = RULES) -> Iterator[None]:
    """Within this context, :func:`constrain` shards activations over ``mesh`` by ``rules``."""
    token = _ACTIVE.set((mesh, rules))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def _as_axes(value: str | tuple[str, ...] | None) -> tuple[str, ...]:
    if value is None:
        return ()
    return (value,) if isinstance(value, str) else tuple(value)


def partition_spec(
    shape: Sequence[int | None],
    names: Sequence[str | None],
    mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh,
    rules: Rules = RULES,
    *,
    where: str = "tensor",
) -> PartitionSpec:
    """The PartitionSpec of a tensor of ``shape`` named ``names`` on ``mesh``: per dimension, the first rule
    for its name whose mesh axes (those of size > 1) are unused in this tensor and divide the dimension.

    A rule whose mesh axes are all absent or of size 1 falls through to the next; a dimension of size None
    (unknown, e.g. the batch before it is loaded) skips the divisibility test. ``where`` names the tensor
    in errors.
    """
    if len(names) != len(shape):
        raise ValueError(f"{where}: logical names {tuple(names)} do not match its shape {tuple(shape)}")
    sizes = dict(mesh.shape)
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
            if value is None:
                break
            # Axes missing from this mesh or of size 1 shard nothing; drop them so specs stay readable.
            mesh_axes = tuple(a for a in _as_axes(value) if sizes.get(a, 1) > 1)
            if not mesh_axes or used.intersection(mesh_axes):
                continue
            if dim is not None and dim % math.prod(sizes[a] for a in mesh_axes):
                continue
            chosen = mesh_axes
            break
        used.update(chosen)
        out.append(None if not chosen else chosen[0] if len(chosen) == 1 else chosen)
    while out and out[-1] is None:
        out.pop()
    return PartitionSpec(*out)


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
    """Sharding constraint on an activation by logical names and its shape (a dimension no rule divides
    stays whole); the identity when no mesh is active."""
    active = _ACTIVE.get()
    if active is None:
        return x
    mesh, rules = active
    spec = partition_spec(x.shape, names, mesh, rules, where=f"activation {tuple(names)}")
    return jax.lax.with_sharding_constraint(x, jax.sharding.NamedSharding(mesh, spec))


def batch_mesh_axes(size: int | None = None) -> tuple[str, ...] | None:
    """The mesh axes an activation batch axis of ``size`` shards over under the active mesh (as
    :func:`constrain` places it), or None outside one (for ``jax.vmap(spmd_axis_name=...)`` over a
    batch-like axis, so constraints inside keep it split)."""
    active = _ACTIVE.get()
    if active is None:
        return None
    mesh, rules = active
    spec = partition_spec((size,), (ACT_BATCH,), mesh, rules, where="activation batch")
    return _as_axes(spec[0]) if spec else None
