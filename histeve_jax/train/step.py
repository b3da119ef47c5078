"""The generic train step: gradients of a pure ``loss_fn(model, batch, rng) -> (loss, metrics)`` and an
optimizer update, with optional gradient accumulation over microbatches.

``make_train_step`` returns a pure function of pytrees, ``train_step(state, batch, rng) -> (state, metrics)``;
``jit_train_step`` wraps it with the state's shardings, the batch sharded over (data, fsdp), and the old state
donated, so the update happens in place in device memory. A step whose loss or gradient is not finite
leaves the weights and the optimizer state unchanged and reports ``skipped_nonfinite`` = 1.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from histeve_jax.parallel import axes
from histeve_jax.parallel.axes import Rules
from histeve_jax.train.optimizer import global_norm
from histeve_jax.train.state import TrainState

LossFn = Callable[[nnx.Module, Any, jax.Array], tuple[jax.Array, Mapping[str, jax.Array]]]


def split_microbatches(batch: Any, n: int) -> Any:
    """Leaves [B, ...] -> [n, B/n, ...], microbatch i taking rows i, i+n, ...: a strided split keeps every
    microbatch spread over all batch shards instead of landing on a few devices."""

    def one(x: jax.Array) -> jax.Array:
        if x.shape[0] % n:
            raise ValueError(f"batch leaf of shape {x.shape}: leading dim not divisible by {n} microbatches")
        return x.reshape(x.shape[0] // n, n, *x.shape[1:]).swapaxes(0, 1)

    return jax.tree.map(one, batch)


def make_train_step(
    loss_fn: LossFn,
    tx: optax.GradientTransformation,
    *,
    schedule: optax.Schedule | None = None,
    microbatches: int = 1,
    weight_key: str = "n_targets",
) -> Callable[[TrainState, Any, jax.Array], tuple[TrainState, dict[str, jax.Array]]]:
    """A pure ``train_step(state, batch, rng) -> (state, metrics)``, accumulating gradients over
    ``microbatches`` passes so that loss and gradient are the full batch's.

    A loss that is a mean over masked terms (``policy.action_loss``: target tokens) reports their count in
    its metrics under ``weight_key``: microbatch i is then weighted by n_i / sum(n), which makes the
    accumulated gradient that of the full batch's masked mean (equal weights would not, as microbatches
    hold different numbers of targets). A loss without that metric gets equal weights (right for a
    per-example mean: the microbatches are of equal size). ``weight_key`` is summed over microbatches;
    the other metrics are their means over microbatches."""
    if microbatches < 1:
        raise ValueError(f"microbatches must be >= 1, got {microbatches}")

    def train_step(state: TrainState, batch: Any, rng: jax.Array) -> tuple[TrainState, dict[str, jax.Array]]:
        def loss_of_params(params: nnx.State, mb: Any, key: jax.Array) -> tuple[jax.Array, Any]:
            loss, metrics = loss_fn(state.model(params), mb, key)
            return loss, dict(metrics)

        grad_fn = jax.value_and_grad(loss_of_params, has_aux=True)
        rng = jax.random.fold_in(rng, state.step)
        if microbatches == 1:
            (loss, metrics), grads = grad_fn(state.params, batch, rng)
        else:
            mbs = split_microbatches(batch, microbatches)
            keys = jax.random.split(rng, microbatches)
            zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), state.params)

            def accumulate(carry: Any, xs: Any) -> tuple[Any, Any]:
                mb, key = xs
                (mb_loss, mb_metrics), mb_grads = grad_fn(state.params, mb, key)
                n = jnp.asarray(mb_metrics.get(weight_key, 1.0), jnp.float32)  # this microbatch's terms
                carry = jax.tree.map(lambda a, g: a + n * g.astype(jnp.float32), carry, mb_grads)
                return carry, (mb_loss, n, mb_metrics)

            grad_sum, (losses, counts, metrics) = jax.lax.scan(accumulate, zeros, (mbs, keys))
            # A masked mean over all terms of the batch: sum_i n_i * mean_i / sum_i n_i (0 if no terms).
            total = jnp.maximum(counts.sum(), jnp.finfo(jnp.float32).tiny)
            grads = jax.tree.map(lambda g, p: (g / total).astype(p.dtype), grad_sum, state.params)
            loss = (counts * losses).sum() / total
            metrics = {k: m.sum(0) if k == weight_key else m.mean(0) for k, m in metrics.items()}
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        grad_norm = global_norm(grads)
        # A non-finite loss or gradient (an update that blew the model up) skips the step: the weights and the
        # optimizer state stay as they were, and the metrics say so.
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        params, opt_state = jax.tree.map(lambda new, old: jnp.where(finite, new, old),
                                         (params, opt_state), (state.params, state.opt_state))
        out = {**metrics, "loss": loss, "grad_norm": grad_norm, "param_norm": global_norm(params),
               "skipped_nonfinite": (~finite).astype(jnp.float32)}
        if schedule is not None:
            out["learning_rate"] = jnp.asarray(schedule(state.step), jnp.float32)
        new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state)
        return new_state, out

    return train_step


def batch_sharding(
    mesh: jax.sharding.Mesh, rules: Rules = axes.RULES, batch_size: int | None = None
) -> NamedSharding:
    """Batch leaves split on their leading axis the way activations' batch axis is (``activation_batch``);
    given ``batch_size``, only over axes that divide it."""
    spec = axes.partition_spec((batch_size,), (axes.ACT_BATCH,), mesh, rules, where="batch")
    return NamedSharding(mesh, spec)


def jit_train_step(
    train_step: Callable[[TrainState, Any, jax.Array], tuple[TrainState, dict[str, jax.Array]]],
    state_shardings: TrainState,
    mesh: jax.sharding.Mesh,
    rules: Rules = axes.RULES,
    *,
    donate: bool = True,
) -> Callable[[TrainState, Any, jax.Array], tuple[TrainState, dict[str, jax.Array]]]:
    """``train_step`` under jit on ``mesh``: state in/out with its shardings, batch over the batch axes,
    metrics replicated; activations constrained by ``rules`` inside."""
    replicated = NamedSharding(mesh, PartitionSpec())

    def step(state: TrainState, batch: Any, rng: jax.Array) -> tuple[TrainState, dict[str, jax.Array]]:
        with axes.activate(mesh, rules):
            return train_step(state, batch, rng)

    return jax.jit(
        step,
        in_shardings=(state_shardings, batch_sharding(mesh, rules), replicated),
        out_shardings=(state_shardings, replicated),
        donate_argnums=(0,) if donate else (),
    )
