"""Token losses and metrics: masked cross-entropy, per-group token accuracy, sequence exact match."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def masked_cross_entropy(
    logits: jax.Array, labels: jax.Array, mask: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Mean cross-entropy over ``mask``: logits [..., V], labels [...] int, mask [...] -> (loss, count).

    Computed in float32 whatever the logits' dtype; an all-zero mask gives loss 0 (not NaN).
    """
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    nll = -jnp.take_along_axis(logp, labels[..., None].astype(jnp.int32), axis=-1)[..., 0]
    m = mask.astype(jnp.float32)
    n = m.sum()
    return (nll * m).sum() / jnp.maximum(n, 1.0), n


def grouped_accuracy(
    logits: jax.Array, labels: jax.Array, mask: jax.Array, group: jax.Array, n_groups: int
) -> tuple[jax.Array, jax.Array]:
    """Argmax accuracy per group: labels' ``group`` [...] int in 0..n_groups-1 -> ([n_groups] acc, counts).

    A group with no masked label has accuracy 0 and count 0, so callers can weight or skip it.
    """
    correct = (jnp.argmax(logits, axis=-1) == labels).astype(jnp.float32) * mask.astype(jnp.float32)
    onehot = jax.nn.one_hot(group, n_groups, dtype=jnp.float32) * mask.astype(jnp.float32)[..., None]
    counts = onehot.reshape(-1, n_groups).sum(0)
    hits = (onehot * correct[..., None]).reshape(-1, n_groups).sum(0)
    return hits / jnp.maximum(counts, 1.0), counts


def sequence_exact_match(logits: jax.Array, labels: jax.Array, mask: jax.Array) -> jax.Array:
    """[B, K, V], [B, K], [B, K] -> fraction of rows (with any masked label) whose every one is the argmax."""
    ok = (jnp.argmax(logits, axis=-1) == labels) | ~mask.astype(bool)
    has = mask.astype(bool).any(-1)
    rows = (ok.all(-1) & has).astype(jnp.float32)
    return rows.sum() / jnp.maximum(has.sum().astype(jnp.float32), 1.0)
