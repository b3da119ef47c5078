"""A policy update whose loss is non-finite is skipped: weights and optimizer state unchanged, reported."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from histeve_jax.train import state as state_lib
from histeve_jax.train import step as step_lib


class _Linear(nnx.Module):
    def __init__(self):
        self.w = nnx.Param(jnp.ones((3,)))


def _loss(model, batch, rng):
    # batch["poison"] = 1 makes the loss NaN through the weights (as an overflowing policy would)
    loss = jnp.mean((batch["x"] @ model.w[...] - 1.0) ** 2) + jnp.where(batch["poison"][0] > 0, jnp.nan, 0.0)
    return loss, {"n_targets": jnp.float32(batch["x"].shape[0])}


def test_a_non_finite_loss_skips_the_update_and_is_reported():
    tx = optax.adamw(0.1)
    state = state_lib.state_from_model(_Linear(), tx)
    step = jax.jit(step_lib.make_train_step(_loss, tx))
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    good = {"x": x, "poison": np.zeros(2, np.int32)}
    bad = {"x": x, "poison": np.ones(2, np.int32)}
    state, m = step(state, good, jax.random.key(0))
    assert m["skipped_nonfinite"] == 0
    before = jax.tree.map(np.asarray, (state.params, state.opt_state))
    state, m = step(state, bad, jax.random.key(0))
    assert not np.isfinite(m["loss"]) and m["skipped_nonfinite"] == 1 and int(state.step) == 2
    after = jax.tree.map(np.asarray, (state.params, state.opt_state))
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after), strict=True):
        np.testing.assert_array_equal(a, b)  # weights and Adam moments as they were
    state, m = step(state, good, jax.random.key(0))
    assert m["skipped_nonfinite"] == 0
    assert not np.array_equal(np.asarray(state.params["w"][...]), before[0]["w"][...])
