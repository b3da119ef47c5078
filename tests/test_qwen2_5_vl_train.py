"""Gradients match torch's backward (with and without remat), and load_hf places tensors on a mesh."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
from conftest import qwen_images, qwen_vision_block
from flax import nnx

from histeve_jax.models.qwen2_5_vl import load_hf
from histeve_jax.parallel import axes


@pytest.fixture(scope="module")
def batch(qwen_tiny_dir):
    cfg = qwen_tiny_dir[0]
    pv, grid = qwen_images([(56, 84)], seed=31)
    ids = np.asarray([[3, 4] + qwen_vision_block(cfg, grid[0], cfg.image_token_id) + [5, 6, 7, 8]])
    return ids, pv, grid


def _torch_grads(cfg, hf, batch):
    ids, pv, grid = batch
    t = torch.tensor
    hf.zero_grad()
    logits = hf(
        input_ids=t(ids),
        pixel_values=t(pv),
        image_grid_thw=t(grid),
        mm_token_type_ids=t((ids == cfg.image_token_id).astype(np.int64)),
    ).logits
    loss = torch.nn.functional.cross_entropy(logits[0, :-1], t(ids[0, 1:]))
    loss.backward()
    g = dict(hf.named_parameters())
    return loss.item(), {
        "q0": g["model.language_model.layers.0.self_attn.q_proj.weight"].grad.numpy().T.reshape(64, 4, 16),
        "patch": g["model.visual.patch_embed.proj.weight"].grad.numpy().reshape(32, -1).T,
        "lm_head": g["lm_head.weight"].grad.numpy().T,
    }


@functools.partial(nnx.jit, static_argnames=("grid",))
def _loss_and_grads(model, ids, pv, grid):
    def loss_fn(m):
        logits = m(ids, pixel_values=pv, image_grid_thw=grid)
        return optax.softmax_cross_entropy_with_integer_labels(logits[0, :-1], ids[0, 1:]).mean()

    return nnx.value_and_grad(loss_fn)(model)


@pytest.mark.parametrize(
    ("remat", "scan"), [("none", True), ("full", True), ("save_dots", True), ("full", False)]
)
def test_grads_match_torch_backward(qwen_tiny_dir, batch, remat, scan):
    cfg, hf, d = qwen_tiny_dir
    ref_loss, ref = _torch_grads(cfg, hf, batch)
    model = load_hf(d, config_overrides={"remat": remat, "scan_layers": scan})
    ids, pv, grid = batch
    loss, g = _loss_and_grads(model, jnp.asarray(ids), jnp.asarray(pv), tuple(map(tuple, grid)))
    np.testing.assert_allclose(float(loss), ref_loss, rtol=1e-5)
    ours = {
        "q0": g.language_model.layers.attn.q.get_value()[0]
        if scan
        else g.language_model.layers[0].attn.q.get_value(),
        "patch": g.visual.patch_embed.get_value(),
        "lm_head": g.lm_head.get_value(),
    }
    for k, r in ref.items():
        err = np.abs(np.asarray(ours[k]) - r).max() / np.abs(r).max()
        assert err < 1e-4, f"{k}: {err:.2e}"


def test_load_hf_places_tensors_by_logical_names(qwen_tiny_dir):
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:1]).reshape(1, 1, 1), ("data", "fsdp", "tensor"))
    model = load_hf(qwen_tiny_dir[2], mesh=mesh)
    q = model.language_model.layers.attn.q.get_value()
    assert isinstance(q.sharding, jax.sharding.NamedSharding)
    assert q.sharding.spec == axes.logical_to_spec((axes.LAYERS, axes.EMBED, axes.Q_HEADS, axes.HEAD_DIM))
    assert model.lm_head.get_value().sharding.spec == jax.sharding.PartitionSpec("fsdp", "tensor")


_SHARDED_SCRIPT = r"""
import sys
import jax, jax.numpy as jnp, numpy as np
from flax import nnx
from histeve_jax.models.qwen2_5_vl import load_hf
from histeve_jax.parallel import axes
d = sys.argv[1]
mesh = jax.sharding.Mesh(np.asarray(jax.devices()).reshape(1, 2, 1), ("data", "fsdp", "tensor"))
ids = jnp.asarray(np.random.default_rng(0).integers(0, 290, (2, 12)))
fwd = nnx.jit(lambda m, ids: m(ids))
ref = np.asarray(fwd(load_hf(d), ids))
model = load_hf(d, mesh=mesh)
emb = model.language_model.embed.get_value()
assert len(emb.sharding.device_set) == 2 and emb.addressable_shards[0].data.shape == (320, 32), emb.sharding
with axes.activate(mesh):
    out = np.asarray(fwd(model, ids))
err = np.abs(out - ref).max() / np.abs(ref).max()
assert err < 1e-5, err
print("SHARDED_OK", err)
"""


def test_fsdp_sharded_load_gives_the_same_logits(qwen_tiny_dir):
    import os
    import subprocess
    import sys

    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
    r = subprocess.run(
        [sys.executable, "-c", _SHARDED_SCRIPT, qwen_tiny_dir[2]],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert "SHARDED_OK" in r.stdout, r.stderr[-3000:]
