"""Gradients match torch's backward (with and without remat), and load_hf places tensors on a mesh where
the train state built from the model wants them."""

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


def _torch_grads(cfg, hf, batch, scale=1.0):
    ids, pv, grid = batch
    t = torch.tensor
    hf.zero_grad()
    logits = hf(
        input_ids=t(ids),
        pixel_values=t(pv),
        image_grid_thw=t(grid),
        mm_token_type_ids=t((ids == cfg.image_token_id).astype(np.int64)),
    ).logits
    loss = scale * torch.nn.functional.cross_entropy(logits[0, :-1], t(ids[0, 1:]))
    loss.backward()
    g = {k: p.grad.numpy() for k, p in hf.named_parameters()}
    lm, vis = "model.language_model.", "model.visual."
    return loss.item(), {
        "q0": g[lm + "layers.0.self_attn.q_proj.weight"].T.reshape(64, 4, 16),
        "patch": g[vis + "patch_embed.proj.weight"].reshape(32, -1).T,
        "lm_head": g["lm_head.weight"].T,
        # norm scales and biases, in the decoder and the vision tower
        "q_bias1": g[lm + "layers.1.self_attn.q_proj.bias"].reshape(4, 16),
        "input_norm2": g[lm + "layers.2.input_layernorm.weight"],
        "final_norm": g[lm + "norm.weight"],
        "vision_norm1": g[vis + "blocks.0.norm1.weight"],
        "vision_qkv_bias": g[vis + "blocks.1.attn.qkv.bias"].reshape(3, 2, 16),
        "merger_ln_q": g[vis + "merger.ln_q.weight"],
        "merger_fc2_bias": g[vis + "merger.mlp.2.bias"],
    }


@functools.partial(nnx.jit, static_argnames=("grid",))
def _loss_and_grads(model, ids, pv, grid, regime=None):
    def loss_fn(m):  # the mean next-token loss over every row's tokens
        logits = m(ids, pixel_values=pv, image_grid_thw=grid, regime=regime)
        return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], ids[:, 1:]).mean()

    return nnx.value_and_grad(loss_fn)(model)


@pytest.mark.parametrize(
    ("remat", "scan", "loop"),
    [("none", True, "scan"), ("none", True, "unroll"), ("full", True, "scan"), ("save_dots", True, "unroll"),
     ("full", False, "auto")],
)
def test_grads_match_torch_backward(qwen_tiny_dir, batch, remat, scan, loop):
    """Stacked layers scanned or unrolled (split stacks, gradients concatenated), or unstacked layers."""
    cfg, hf, d = qwen_tiny_dir
    ref_loss, ref = _torch_grads(cfg, hf, batch)
    model = load_hf(d, config_overrides={"remat": remat, "scan_layers": scan, "layer_loop": loop})
    ids, pv, grid = batch
    loss, g = _loss_and_grads(model, jnp.asarray(ids), jnp.asarray(pv), tuple(map(tuple, grid)))
    np.testing.assert_allclose(float(loss), ref_loss, rtol=1e-5)
    def layer(i, module, name):  # decoder layer i's gradient (a slice of the scanned stack)
        if scan:
            return getattr(getattr(g.language_model.layers, module), name).get_value()[i]
        return getattr(getattr(g.language_model.layers[i], module), name).get_value()

    ours = {
        "q0": layer(0, "attn", "q"),
        "patch": g.visual.patch_embed.get_value(),
        "lm_head": g.lm_head.get_value(),
        "q_bias1": layer(1, "attn", "q_bias"),
        "input_norm2": layer(2, "input_norm", "scale"),
        "final_norm": g.language_model.norm.scale.get_value(),
        "vision_norm1": g.visual.blocks[0].norm1.scale.get_value(),
        "vision_qkv_bias": g.visual.blocks[1].attn.qkv_bias.get_value(),
        "merger_ln_q": g.visual.merger.ln_q.scale.get_value(),
        "merger_fc2_bias": g.visual.merger.fc2_bias.get_value(),
    }
    for k, r in ref.items():
        err = np.abs(np.asarray(ours[k]) - r).max() / np.abs(r).max()
        assert err < 1e-4, f"{k}: {err:.2e}"


def test_rs_norm_row_grads_are_torchs_per_regime(qwen_tiny_dir, batch):
    """Two sequences in regimes NG and GUI: row r of every RS-Norm scale gets exactly the gradient torch
    gives the base model's norm weight from sequence r alone; shared weights get the sum."""
    cfg, hf, d = qwen_tiny_dir
    ids, pv, grid = batch
    pv2, grid2 = qwen_images([(56, 84)], seed=32)
    ids2 = ids.copy()
    ids2[0, -4:] = [9, 10, 11, 12]  # another instruction, another image
    # Torch, one sequence at a time: each one's share of the batch's mean token loss.
    n_tok = 2 * (ids.shape[1] - 1)
    refs, lm = [], "model.language_model.layers."
    for x, p, gr in ((ids, pv, grid), (ids2, pv2, grid2)):
        loss, _ = _torch_grads(cfg, hf, (x, p, gr), scale=(ids.shape[1] - 1) / n_tok)
        g = {k: q.grad.numpy().copy() for k, q in hf.named_parameters()}
        refs.append({"input_norm": np.stack([g[lm + f"{i}.input_layernorm.weight"] for i in range(3)]),
                     "post_attn_norm": np.stack([g[lm + f"{i}.post_attention_layernorm.weight"]
                                                 for i in range(3)]),
                     "q0": g[lm + "0.self_attn.q_proj.weight"].T.reshape(64, 4, 16)})
    model = load_hf(d, config_overrides={"norm_regimes": 2, "scan_layers": True})
    both = (jnp.asarray(np.concatenate([ids, ids2])), jnp.asarray(np.concatenate([pv, pv2])),
            tuple(map(tuple, np.concatenate([grid, grid2]))))
    _, g = _loss_and_grads(model, *both, regime=jnp.asarray([0, 1]))
    layers = g.language_model.layers
    for name in ("input_norm", "post_attn_norm"):
        ours = np.asarray(getattr(layers, name).scale.get_value())  # [L, 2, d]
        for r in (0, 1):
            want = refs[r][name]
            err = np.abs(ours[:, r] - want).max() / np.abs(want).max()
            assert err < 1e-4, f"{name} row {r}: {err:.2e}"
    want = refs[0]["q0"] + refs[1]["q0"]
    assert np.abs(np.asarray(layers.attn.q.get_value()[0]) - want).max() / np.abs(want).max() < 1e-4


def test_load_hf_places_tensors_by_logical_names(qwen_tiny_dir):
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:1]).reshape(1, 1, 1), ("data", "fsdp", "tensor"))
    model = load_hf(qwen_tiny_dir[2], mesh=mesh, config_overrides={"scan_layers": True})
    q = model.language_model.layers.attn.q.get_value()
    assert isinstance(q.sharding, jax.sharding.NamedSharding) and q.sharding.mesh == mesh
    names = (axes.LAYERS, axes.EMBED, axes.Q_HEADS, axes.HEAD_DIM)
    assert q.sharding.spec == axes.partition_spec(q.shape, names, mesh) == jax.sharding.PartitionSpec()


_PLACEMENT_SCRIPT = r"""
import sys, tempfile
import jax, numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P
from histeve_jax.models.qwen2_5_vl import load_hf
from histeve_jax.models.qwen2_5_vl.convert import load_orbax, save_orbax
from histeve_jax.parallel import mesh as mesh_lib
from histeve_jax.train import optimizer, state as state_lib
tx, _ = optimizer.make_optimizer({})
lm_head = {(1, 8, 1): P("fsdp"), (1, 2, 4): P("fsdp", "tensor"), (1, 1, 8): P(None, "tensor"), (8, 1, 1): P()}
for shape, want in lm_head.items():
    mesh = mesh_lib.make_mesh(dict(zip(mesh_lib.AXES, shape)))
    model = load_hf(sys.argv[1], mesh=mesh)
    loaded = nnx.state(model, nnx.Param)
    _, shardings = state_lib.shard_model_state(model, tx, mesh)
    want_sh = dict(nnx.to_flat_state(shardings.params))
    for path, got in nnx.to_flat_state(loaded):
        assert got.get_value().sharding == want_sh[path].get_value(), (shape, path, got.get_value().sharding)
    # So the train state's device_put moves nothing: every shard keeps its buffer.
    moved = jax.device_put(loaded, shardings.params)
    for x, y in zip(jax.tree.leaves(loaded), jax.tree.leaves(moved), strict=True):
        ptrs = lambda a: [s.data.unsafe_buffer_pointer() for s in a.addressable_shards]
        assert ptrs(x) == ptrs(y), shape
    assert model.lm_head.get_value().sharding.spec == want, (shape, model.lm_head.get_value().sharding)
    if shape == (1, 2, 4):  # an orbax checkpoint restores onto the same places
        save_orbax(model, ckpt := tempfile.mkdtemp())
        restored = nnx.state(load_orbax(ckpt, mesh=mesh), nnx.Param)
        for path, got in nnx.to_flat_state(restored):
            assert got.get_value().sharding == want_sh[path].get_value(), ("orbax", path)
print("PLACEMENT_OK")
"""


def _run_on_cpu_devices(script: str, n: int, *args: str):
    import os
    import subprocess
    import sys

    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={n}", JAX_PLATFORMS="cpu")
    return subprocess.run(
        [sys.executable, "-c", script, *args], env=env, capture_output=True, text=True, timeout=300
    )


def test_load_hf_puts_each_weight_where_the_train_state_wants_it(qwen_tiny_dir):
    r = _run_on_cpu_devices(_PLACEMENT_SCRIPT, 8, qwen_tiny_dir[2])
    assert "PLACEMENT_OK" in r.stdout, r.stderr[-3000:]


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
# [vocab, embed] on an fsdp-only mesh: `vocab`'s first rule (tensor) has size 1, so it takes `fsdp`.
assert len(emb.sharding.device_set) == 2 and emb.addressable_shards[0].data.shape == (160, 64), emb.sharding
with axes.activate(mesh):
    out = np.asarray(fwd(model, ids))
err = np.abs(out - ref).max() / np.abs(ref).max()
assert err < 1e-5, err
print("SHARDED_OK", err)
"""


def test_fsdp_sharded_load_gives_the_same_logits(qwen_tiny_dir):
    r = _run_on_cpu_devices(_SHARDED_SCRIPT, 2, qwen_tiny_dir[2])
    assert "SHARDED_OK" in r.stdout, r.stderr[-3000:]
