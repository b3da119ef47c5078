"""Logical-axis rules to shardings: hand-checked specs and fallbacks, activations resolved as parameters are,
every parameter named, the 7B state split under FSDP and under FSDP x tensor.

Abstract meshes only (no devices, nothing allocated): shardings depend on axis sizes, not on hardware.
"""

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from histeve_jax.models.qwen2_5_vl import Qwen2_5_VLModel, qwen2_5_vl_7b, tiny
from histeve_jax.models.qwen2_5_vl.vision import VisionTower
from histeve_jax.parallel import axes, sharding
from histeve_jax.train import optimizer
from histeve_jax.train import state as state_lib

MiB = 1 << 20


def abstract_mesh(data=1, fsdp=1, tensor=1):
    auto = (jax.sharding.AxisType.Auto,) * 3
    return jax.sharding.AbstractMesh((data, fsdp, tensor), ("data", "fsdp", "tensor"), axis_types=auto)


def spec(shape, names, rules=axes.RULES, **mesh):
    return axes.partition_spec(shape, names, abstract_mesh(**mesh), rules)


def test_fsdp_and_tensor_axes_land_on_embed_and_mlp():
    assert spec((64, 256), (axes.EMBED, axes.MLP), fsdp=4, tensor=2) == P("fsdp", "tensor")
    assert spec((256, 64), (axes.MLP, axes.EMBED), fsdp=4, tensor=2) == P("tensor", "fsdp")
    # Axes of size 1 shard nothing and are left out.
    assert spec((64, 256), (axes.EMBED, axes.MLP), fsdp=8) == P("fsdp")


def test_a_rule_on_size_1_or_absent_axes_falls_through_to_the_next():
    # On an fsdp-only mesh `mlp`'s first rule (tensor) shards nothing, so its fallback (fsdp) applies.
    assert spec((64,), (axes.MLP,), fsdp=8) == P("fsdp")
    assert spec((256, 64), (axes.MLP, axes.EMBED), fsdp=8) == P("fsdp")
    assert spec((320, 64), (axes.VOCAB, axes.EMBED), fsdp=8) == P("fsdp")
    # Of a multi-axis rule only the axes of size > 1 count: the batch over (data, fsdp) is over fsdp alone.
    assert spec((16, 12), (axes.ACT_BATCH, axes.ACT_LENGTH), fsdp=8) == P("fsdp")
    rules = ((axes.MLP, "expert"), (axes.MLP, "tensor"), (axes.MLP, None), (axes.MLP, "fsdp"))
    assert spec((64,), (axes.MLP,), rules, tensor=4) == P("tensor")  # `expert` is not a mesh axis
    assert spec((64,), (axes.MLP,), rules, fsdp=4) == P()  # `None` replicates and ends the search


def test_indivisible_axis_falls_back_and_no_mesh_axis_is_used_twice():
    # 4 KV heads cannot split 8 ways over `tensor`; `fsdp` is taken by embed, so the heads stay whole.
    assert spec((64, 4, 16), (axes.EMBED, axes.KV_HEADS, axes.HEAD_DIM), fsdp=2, tensor=8) == P("fsdp")
    # On an fsdp-only mesh an embed of 60 does not split 8 ways; the mlp axis takes `fsdp` instead.
    assert spec((60, 256), (axes.EMBED, axes.MLP), fsdp=8) == P(None, "fsdp")
    # The vocab axis takes `tensor`, embed `fsdp`: both used once.
    assert spec((320, 64), (axes.VOCAB, axes.EMBED), fsdp=2, tensor=2) == P("tensor", "fsdp")
    # 320 rows do not split 3 ways over `tensor`, so vocab falls back to `fsdp` and embed stays whole.
    assert spec((320, 64), (axes.VOCAB, axes.EMBED), fsdp=4, tensor=3) == P("fsdp")


def test_layers_norm_and_regime_axes_are_replicated():
    assert spec((28, 2, 3584), (axes.LAYERS, axes.REGIME, axes.NORM), fsdp=64) == P()
    assert spec((28, 3584, 18944), (axes.LAYERS, axes.EMBED, axes.MLP), fsdp=64) == P(None, "fsdp")


def test_a_mesh_without_fsdp_or_tensor_replicates_every_parameter_and_splits_the_batch():
    assert spec((64, 256), (axes.EMBED, axes.MLP), data=8) == P()
    assert spec((320, 64), (axes.VOCAB, axes.EMBED), data=8) == P()
    assert spec((16, 12, 64), (axes.ACT_BATCH, axes.ACT_LENGTH, axes.ACT_EMBED), data=8) == P("data")


def test_bad_names_raise_naming_the_tensor():
    mesh = abstract_mesh(fsdp=2)
    with pytest.raises(ValueError, match="layers/attn/q.*'embd'"):
        axes.partition_spec((4, 4), ("embd", None), mesh, where="layers/attn/q")
    with pytest.raises(ValueError, match="w: logical names"):
        axes.partition_spec((4, 4), (axes.EMBED,), mesh, where="w")


def constrained_spec(shape, names, **mesh):
    """The spec `axes.constrain` puts on an activation of ``shape`` (traced, nothing allocated)."""
    with axes.activate(abstract_mesh(**mesh)):
        jaxpr = jax.make_jaxpr(lambda x: axes.constrain(x, names))(jax.ShapeDtypeStruct(shape, np.float32))
    (eqn,) = jaxpr.jaxpr.eqns
    return eqn.params["sharding"].spec


def test_activations_are_constrained_by_the_same_resolver():
    names = (axes.ACT_BATCH, axes.ACT_LENGTH, axes.ACT_HEADS, axes.ACT_HEAD_DIM)
    mesh = dict(data=2, fsdp=2, tensor=4)
    assert constrained_spec((8, 12, 8, 16), names, **mesh) == P(("data", "fsdp"), None, "tensor")
    assert constrained_spec((8, 12, 8, 16), names, **mesh) == spec((8, 12, 8, 16), names, **mesh)
    # 6 heads do not split 4 ways, 3 rows not 4 ways: those dimensions stay whole instead of erroring.
    assert constrained_spec((8, 12, 6, 16), names, **mesh) == P(("data", "fsdp"))
    assert constrained_spec((3, 12, 8, 16), names, **mesh) == P(None, None, "tensor")
    with pytest.raises(ValueError, match="activation.*'activation_bach'"):
        constrained_spec((8, 12), ("activation_bach", None), **mesh)


def test_the_input_batch_splits_as_the_activation_batch_axis_does():
    from histeve_jax.train import step as step_lib

    mesh = abstract_mesh(data=2, fsdp=4, tensor=2)
    assert step_lib.batch_sharding(mesh).spec == P(("data", "fsdp"))
    assert step_lib.batch_sharding(mesh, batch_size=16).spec == spec((16,), (axes.ACT_BATCH,), **mesh.shape)
    assert step_lib.batch_sharding(mesh, batch_size=6).spec == P()  # 6 rows do not split 8 ways


def test_the_vmapped_image_axis_shards_as_its_constraint_does():
    with axes.activate(abstract_mesh(data=2, fsdp=2)):
        assert axes.batch_mesh_axes(8) == ("data", "fsdp")
        assert axes.batch_mesh_axes(3) is None  # left whole by constrain, so not split by vmap either
    assert axes.batch_mesh_axes(8) is None  # no active mesh


@pytest.mark.parametrize("scan_layers", [True, False])
def test_every_parameter_of_the_tiny_policy_has_logical_names(scan_layers):
    from histeve_jax import policy as policy_lib

    config = policy_lib.tiny_config(base=tiny(scan_layers=scan_layers))
    abstract = nnx.eval_shape(lambda: policy_lib.Policy(config, rngs=nnx.Rngs(0)))
    params = nnx.state(abstract, nnx.Param)
    assert sharding.unannotated_params(params) == []
    flat = {"/".join(map(str, k)): v for k, v in nnx.to_flat_state(params)}
    # RS-Norm: a [2, d] scale per decoder pre-norm, named (regime, norm), with `layers` in front when scanned.
    layer = "model/language_model/layers" + ("" if scan_layers else "/0")
    want = ((axes.LAYERS,) if scan_layers else ()) + (axes.REGIME, axes.NORM)
    for norm in ("input_norm", "post_attn_norm"):
        assert sharding.logical_names(flat[f"{layer}/{norm}/scale"]) == want
    # The action tokens' rows live in the (vocab, embed) tables, so they shard with them.
    embed = flat["model/language_model/embed"]
    assert embed.get_value().shape[0] == config.vocab_size > config.base.text.vocab_size
    assert sharding.logical_names(embed) == (axes.VOCAB, axes.EMBED)
    assert sharding.logical_names(flat["model/lm_head"]) == (axes.EMBED, axes.VOCAB)
    assert any(k.startswith("model/visual/blocks/") for k in flat)


def test_unannotated_parameter_is_reported():
    class Bare(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(np.zeros((4, 4), np.float32))

    assert sharding.unannotated_params(nnx.state(Bare(), nnx.Param)) == ["w"]


@pytest.fixture(scope="module")
def abstract_7b_state():
    """The real 7B policy-shaped train state (RS-Norm on, AdamW moments), as ShapeDtypeStructs."""
    tx, _ = optimizer.make_optimizer({})
    cfg = qwen2_5_vl_7b(norm_regimes=2)
    with nnx.use_eager_sharding(False):
        return jax.eval_shape(lambda: state_lib.state_from_model(Qwen2_5_VLModel(cfg, rngs=nnx.Rngs(0)), tx))


@pytest.mark.parametrize("fsdp", [64, 256])
def test_fsdp_splits_every_7b_tensor_over_1mib(abstract_7b_state, fsdp):
    mesh = abstract_mesh(fsdp=fsdp)
    shardings = sharding.tree_shardings(abstract_7b_state, mesh)
    state = sharding.with_shardings(abstract_7b_state, shardings)
    assert sharding.replicated_tensors(state.params, MiB) == []
    assert sharding.replicated_tensors(state.opt_state, MiB) == []
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state.params))
    assert 8.2e9 < n_params < 8.4e9  # Qwen2.5-VL-7B with its vision tower, plus RS-Norm's 2Ld
    # fp32 params + two fp32 moments split evenly, plus the norm scales and biases kept whole (< 16 MiB).
    per_device = sharding.bytes_per_device(state.params) + sharding.bytes_per_device(state.opt_state)
    assert 12 * n_params / fsdp < per_device < 12 * n_params / fsdp + 16 * MiB


def test_fsdp_x_tensor_splits_every_7b_tensor_over_1mib(abstract_7b_state):
    mesh = abstract_mesh(data=2, fsdp=16, tensor=4)
    state = sharding.with_shardings(abstract_7b_state, sharding.tree_shardings(abstract_7b_state, mesh))
    assert sharding.replicated_tensors(state.params, MiB) == []
    assert sharding.replicated_tensors(state.opt_state, MiB) == []


def _mesh_axes_used(shardings):
    specs = [s.spec for s in jax.tree.leaves(shardings)]
    return {a for spec in specs for e in spec if e for a in ((e,) if isinstance(e, str) else e)}


@pytest.mark.parametrize(
    "mesh, used, gate",
    [
        (dict(fsdp=64), {"fsdp"}, P(None, "fsdp")),  # the old "fsdp" preset
        (dict(tensor=4), {"tensor"}, P(None, None, "tensor")),  # the old "tensor" preset
        (dict(data=2, fsdp=16, tensor=4), {"fsdp", "tensor"}, P(None, "fsdp", "tensor")),  # "fsdp_tensor"
        (dict(data=8), set(), P()),  # the old "data" preset: parameters replicated
    ],
)
def test_the_mesh_shape_alone_picks_fsdp_tensor_or_data_parallelism(abstract_7b_state, mesh, used, gate):
    shardings = sharding.tree_shardings(abstract_7b_state.params, abstract_mesh(**mesh))
    assert _mesh_axes_used(shardings) == used
    assert shardings["language_model"]["layers"]["mlp"]["gate"].get_value().spec == gate  # [L, E, F]


def test_optimizer_moments_are_sharded_like_their_parameters(abstract_7b_state):
    mesh = abstract_mesh(data=2, fsdp=16, tensor=4)
    shardings = sharding.tree_shardings(abstract_7b_state, mesh)
    adam = shardings.opt_state[1][0]  # chain(clip, adamw) -> adamw's ScaleByAdamState
    params = dict(nnx.to_flat_state(shardings.params))
    for moments in (adam.mu, adam.nu):
        flat = dict(nnx.to_flat_state(moments))
        assert flat.keys() == params.keys()
        for k, v in flat.items():
            assert v.get_value().spec == params[k].get_value().spec, k
    assert params[("lm_head",)].get_value().spec == P("fsdp", "tensor")


def test_same_size_images_run_per_image_with_the_same_output():
    # The policy's frames share one size; the vision tower then maps one image's program over the images
    # (so the image axis can shard over the batch axes) and must give exactly the flat all-images result.
    vt = VisionTower(tiny(), rngs=nnx.Rngs(0))
    grid = ((1, 4, 6),) * 3
    pv = np.random.RandomState(0).randn(3 * 24, tiny().vision.patch_dim).astype(np.float32)
    per_image = jax.jit(lambda x: vt(x, grid))(pv)
    flat = jax.jit(lambda x: vt._forward(x, grid))(pv)
    np.testing.assert_allclose(np.asarray(per_image), np.asarray(flat), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="pixel_values has shape"):
        vt(pv[:-1], grid)
