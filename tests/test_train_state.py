"""Train state, optimizer and the generic step on one device, against hand-computed values."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from histeve_jax.parallel import axes
from histeve_jax.parallel import mesh as mesh_lib
from histeve_jax.train import optimizer
from histeve_jax.train import state as state_lib
from histeve_jax.train import step as step_lib


def param(value, names):
    # Placement comes from our rules at jit boundaries, as in the real model (no eager sharding).
    return nnx.Param(value, out_sharding=names, eager_sharding=False)


class TinyRegressor(nnx.Module):
    """y = x @ W + b, with a scanned-style [L, d] norm and an RS-Norm-style [2, d] scale."""

    def __init__(self, rngs: nnx.Rngs):
        init = nnx.initializers.normal(0.5)
        self.w = param(init(rngs.params(), (3, 2)), (axes.EMBED, axes.MLP))
        self.bias = param(jnp.full((2,), 0.1), (axes.MLP,))
        self.norm_scale = param(jnp.ones((4, 3)), (axes.LAYERS, axes.NORM))
        self.rs = param(jnp.ones((2, 3)), (axes.REGIME, axes.NORM))
        self.stacked = param(init(rngs.params(), (4, 3, 3)), (axes.LAYERS, axes.EMBED, axes.MLP))

    def __call__(self, x):
        x = x * self.rs[0] * self.norm_scale[0]
        x = x @ self.stacked[0]
        return x @ self.w + self.bias


def mse_loss(model, batch, rng):
    del rng
    err = model(batch["x"]) - batch["y"]
    return jnp.mean(err**2), {"mae": jnp.mean(jnp.abs(err))}


def one_device_mesh():
    return mesh_lib.make_mesh({}, devices=jax.devices()[:1])


def test_schedule_warms_up_linearly_then_decays_by_cosine():
    cfg = {"learning_rate": 2.0, "warmup_steps": 4, "total_steps": 12, "end_lr_factor": 0.25}
    s = optimizer.learning_rate_schedule(cfg)
    np.testing.assert_allclose([float(s(i)) for i in (0, 1, 2, 4)], [0.0, 0.5, 1.0, 2.0], rtol=1e-6)
    # Half-way through the cosine: end + (peak - end) / 2.
    np.testing.assert_allclose(float(s(8)), 0.5 + (2.0 - 0.5) * 0.5, rtol=1e-6)
    np.testing.assert_allclose(float(s(12)), 0.5, rtol=1e-6)
    np.testing.assert_allclose(float(s(100)), 0.5, rtol=1e-6)


def test_unknown_optimizer_field_is_an_error():
    with pytest.raises(ValueError, match="lr_peak"):
        optimizer.make_optimizer({"lr_peak": 1.0})


def test_decay_mask_spares_biases_norms_and_regime_scales():
    params = nnx.state(TinyRegressor(nnx.Rngs(0)), nnx.Param)
    mask = optimizer.decay_mask(params)
    flags = {k: bool(v.get_value()) for k, v in nnx.to_flat_state(mask)}
    assert flags == {
        ("w",): True,
        ("bias",): False,
        ("norm_scale",): False,  # [layers, d] is a stack of vectors
        ("rs",): False,
        ("stacked",): True,
    }


def test_adamw_step_matches_hand_formula():
    lr, b1, b2, eps, wd, clip = 0.1, 0.9, 0.99, 1e-8, 0.5, 1.0
    cfg = {
        "learning_rate": lr,
        "warmup_steps": 0,
        "total_steps": 10,
        "end_lr_factor": 1.0,
        "b1": b1,
        "b2": b2,
        "eps": eps,
        "weight_decay": wd,
        "clip_norm": clip,
    }
    tx, _ = optimizer.make_optimizer(cfg)
    params = nnx.state(TinyRegressor(nnx.Rngs(0)), nnx.Param)
    grads = jax.tree.map(lambda p: jnp.full(p.shape, 2.0), params)
    updates, _ = tx.update(grads, tx.init(params), params)
    new = optax.apply_updates(params, updates)
    n_leaves = sum(int(np.prod(p.shape)) for p in jax.tree.leaves(params))
    g = 2.0 * clip / (2.0 * np.sqrt(n_leaves))  # clipped to global norm `clip`
    m_hat, v_hat = g, g * g  # bias-corrected first step
    adam = m_hat / (np.sqrt(v_hat) + eps)
    decayed = {"w", "stacked"}
    for (name,), p in nnx.to_flat_state(params):
        p0 = np.asarray(p.get_value())
        want = p0 - lr * (adam + (wd * p0 if name in decayed else 0.0))
        np.testing.assert_allclose(
            np.asarray(new[name].get_value()), want, rtol=1e-5, atol=1e-6, err_msg=name
        )


@pytest.mark.parametrize("factor", [0.1, 0.0])
def test_vision_lr_factor_scales_only_the_vision_towers_step(factor):
    from histeve_jax.policy.config import tiny_config
    from histeve_jax.policy.model import Policy

    params = nnx.state(Policy(tiny_config(), rngs=nnx.Rngs(0)), nnx.Param)
    cfg = {"learning_rate": 0.1, "warmup_steps": 0, "total_steps": 10, "end_lr_factor": 1.0,
           "weight_decay": 0.5, "clip_norm": 0.0}
    grads = jax.tree.map(lambda p: jnp.full(p.shape, 2.0), params)
    steps = {}
    for f in (1.0, factor):
        tx, _ = optimizer.make_optimizer({**cfg, "vision_lr_factor": f})
        updates, _ = tx.update(grads, tx.init(params), params)
        steps[f] = dict(nnx.to_flat_state(updates))
    vision = 0
    for path, full in steps[1.0].items():
        is_vision = "visual" in path
        vision += is_vision
        want = np.asarray(full.get_value()) * (factor if is_vision else 1.0)
        np.testing.assert_allclose(np.asarray(steps[factor][path].get_value()), want, rtol=1e-6,
                                   err_msg=str(path))
    assert 0 < vision < len(steps[1.0])  # the tower's tensors (patch embedding, blocks, merger), not others
    with pytest.raises(ValueError, match="vision_lr_factor"):
        optimizer.make_optimizer({**cfg, "vision_lr_factor": -1.0})


def test_sharded_init_equals_eager_init_and_starts_at_step_zero():
    tx, _ = optimizer.make_optimizer({"warmup_steps": 0, "total_steps": 10})
    mesh = one_device_mesh()
    st, shardings = state_lib.create_train_state(
        lambda: TinyRegressor(nnx.Rngs(3)), tx, mesh, axes.RULES
    )
    eager = nnx.state(TinyRegressor(nnx.Rngs(3)), nnx.Param)
    for (path, a), (_, b) in zip(nnx.to_flat_state(st.params), nnx.to_flat_state(eager), strict=True):
        np.testing.assert_array_equal(np.asarray(a.get_value()), np.asarray(b.get_value()), err_msg=str(path))
    assert int(st.step) == 0
    mu = st.opt_state[1][0].mu  # chain(clip, adamw): adamw's ScaleByAdamState
    assert all(float(jnp.abs(x).max()) == 0.0 for x in jax.tree.leaves(mu))
    assert shardings.params["w"].get_value().mesh.shape == mesh.shape


def test_train_step_reduces_loss_and_keeps_the_input_state():
    tx, sched = optimizer.make_optimizer({"learning_rate": 0.05, "warmup_steps": 0, "total_steps": 100})
    model = TinyRegressor(nnx.Rngs(0))
    st = state_lib.state_from_model(model, tx)
    rs = np.random.RandomState(0)
    batch = {"x": jnp.asarray(rs.randn(8, 3), jnp.float32), "y": jnp.asarray(rs.randn(8, 2), jnp.float32)}
    step = jax.jit(step_lib.make_train_step(mse_loss, tx, schedule=sched))
    before = jax.tree.map(np.asarray, st.params)
    losses = []
    for _ in range(20):
        st, metrics = step(st, batch, jax.random.key(0))
        losses.append(float(metrics["loss"]))
    assert losses[-1] < 0.5 * losses[0]
    assert int(st.step) == 20
    assert set(metrics) == {"loss", "mae", "grad_norm", "param_norm", "learning_rate", "skipped_nonfinite"}
    # The first state is untouched: the step is a pure function (only jit donation reuses buffers).
    st0 = state_lib.state_from_model(model, tx)
    for a, b in zip(jax.tree.leaves(st0.params), jax.tree.leaves(before), strict=True):
        np.testing.assert_array_equal(np.asarray(a), b)


def test_microbatched_gradient_equals_full_batch_gradient():
    tx, _ = optimizer.make_optimizer({"learning_rate": 1e-3, "warmup_steps": 0, "total_steps": 10})
    st = state_lib.state_from_model(TinyRegressor(nnx.Rngs(0)), tx)
    rs = np.random.RandomState(1)
    batch = {"x": jnp.asarray(rs.randn(8, 3), jnp.float32), "y": jnp.asarray(rs.randn(8, 2), jnp.float32)}
    full = step_lib.make_train_step(mse_loss, tx)
    micro = step_lib.make_train_step(mse_loss, tx, microbatches=4)
    a, ma = jax.jit(full)(st, batch, jax.random.key(0))
    b, mb = jax.jit(micro)(st, batch, jax.random.key(0))
    np.testing.assert_allclose(float(ma["loss"]), float(mb["loss"]), rtol=1e-6)
    np.testing.assert_allclose(float(ma["grad_norm"]), float(mb["grad_norm"]), rtol=1e-5)
    for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=1e-7)


def test_microbatches_take_strided_rows():
    batch = {"x": jnp.arange(8)[:, None]}
    mbs = step_lib.split_microbatches(batch, 2)
    np.testing.assert_array_equal(np.asarray(mbs["x"][:, :, 0]), [[0, 2, 4, 6], [1, 3, 5, 7]])
    with pytest.raises(ValueError, match="not divisible by 3"):
        step_lib.split_microbatches(batch, 3)


def test_shard_model_state_wraps_an_existing_model():
    tx, _ = optimizer.make_optimizer({"warmup_steps": 0, "total_steps": 10})
    model = TinyRegressor(nnx.Rngs(5))
    st, sh = state_lib.shard_model_state(model, tx, one_device_mesh(), axes.RULES)
    np.testing.assert_array_equal(np.asarray(st.params["w"].get_value()), np.asarray(model.w.get_value()))
    assert int(st.step) == 0
    assert isinstance(sh.params["w"].get_value(), jax.sharding.NamedSharding)
