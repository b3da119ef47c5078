"""HF weight I/O: exact round trips, sharded and bf16 checkpoints, clear errors, RS-Norm, vocab resizing."""

import functools
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from conftest import assert_close_to_reference, qwen_images, qwen_vision_block
from flax import nnx

from histeve_jax.models.qwen2_5_vl import (
    Qwen2_5_VLConfig,
    load_hf,
    qwen2_5_vl_3b,
    qwen2_5_vl_7b,
    resize_token_embeddings,
    save_hf,
)
from histeve_jax.models.qwen2_5_vl.convert import main as convert_main
from histeve_jax.models.qwen2_5_vl.rope import as_grid
from histeve_jax.models.qwen2_5_vl.weights import SafetensorsFile, _normalize_key, write_safetensors


def _read_dir(d):
    """All tensors of a checkpoint dir by (legacy) name."""
    idx = os.path.join(d, "model.safetensors.index.json")
    files = (
        sorted(set(json.load(open(idx))["weight_map"].values()))
        if os.path.exists(idx)
        else ["model.safetensors"]
    )
    out = {}
    for fn in files:
        f = SafetensorsFile(os.path.join(d, fn))
        out.update({_normalize_key(k): f.get(k) for k in f.keys()})
        f.close()
    return out


@pytest.fixture(scope="module")
def prompt(qwen_tiny_dir):
    cfg = qwen_tiny_dir[0]
    pv, grid = qwen_images([(112, 168)], seed=21)
    ids = np.asarray([[3, 4] + qwen_vision_block(cfg, grid[0], cfg.image_token_id) + [5, 6, 7]])
    return ids, pv, grid


def _hf_logits(cfg, hf, prompt):
    ids, pv, grid = prompt
    t = torch.tensor
    with torch.no_grad():
        return (
            hf(
                input_ids=t(ids),
                pixel_values=t(pv).to(hf.dtype),
                image_grid_thw=t(grid),
                mm_token_type_ids=t((ids == cfg.image_token_id).astype(np.int64)),
            )
            .logits.float()
            .numpy()
        )


@functools.partial(nnx.jit, static_argnames=("grid",))
def _forward(model, ids, pv, regime, grid):
    return model(ids, pixel_values=pv, image_grid_thw=grid, regime=regime)


def _our_logits(model, prompt, regime=None):
    ids, pv, grid = prompt
    return np.asarray(_forward(model, jnp.asarray(ids), jnp.asarray(pv), regime, as_grid(grid)), np.float32)


def _rel(a, b):
    return np.abs(a - b).max() / np.abs(b).max()


@pytest.mark.parametrize("scan", [True, False])
def test_hf_flax_hf_round_trip_is_identical_and_loads_in_transformers(qwen_tiny_dir, prompt, tmp_path, scan):
    from transformers import Qwen2_5_VLForConditionalGeneration

    cfg, hf, d = qwen_tiny_dir
    model = load_hf(d, config_overrides={"scan_layers": scan})
    save_hf(model, str(tmp_path))
    src, dst = _read_dir(d), _read_dir(str(tmp_path))
    assert sorted(src) == sorted(dst)
    for k in src:
        np.testing.assert_array_equal(dst[k], src[k], err_msg=k)
    if scan:
        hf2 = Qwen2_5_VLForConditionalGeneration.from_pretrained(str(tmp_path)).eval()
        np.testing.assert_array_equal(_hf_logits(cfg, hf2, prompt), _hf_logits(cfg, hf, prompt))


def test_sharded_checkpoint_saves_loads_and_transformers_reads_it(
    qwen_tiny_dir, qwen_tiny_flax, prompt, tmp_path
):
    from transformers import Qwen2_5_VLForConditionalGeneration

    cfg, hf, _ = qwen_tiny_dir
    save_hf(qwen_tiny_flax, str(tmp_path), max_shard_size="200KB")
    index = json.load(open(tmp_path / "model.safetensors.index.json"))
    assert len(set(index["weight_map"].values())) > 2
    ref = _hf_logits(cfg, hf, prompt)
    assert_close_to_reference(_our_logits(load_hf(str(tmp_path)), prompt), ref)
    hf2 = Qwen2_5_VLForConditionalGeneration.from_pretrained(str(tmp_path)).eval()
    np.testing.assert_array_equal(_hf_logits(cfg, hf2, prompt), ref)


def test_bf16_checkpoint_loads_in_bf16(qwen_tiny_dir, prompt, tmp_path):
    cfg, hf, _ = qwen_tiny_dir
    ref = _hf_logits(cfg, hf, prompt)
    hf_bf16 = type(hf)(hf.config).eval()
    hf_bf16.load_state_dict(hf.state_dict())
    hf_bf16.to(torch.bfloat16).save_pretrained(str(tmp_path))
    model = load_hf(str(tmp_path), dtype=jnp.bfloat16)
    dtypes = {v.dtype for v in jax.tree.leaves(nnx.state(model, nnx.Param))}
    assert dtypes == {jnp.dtype(jnp.bfloat16)}
    assert _rel(_our_logits(model, prompt), ref) < 2e-2  # bf16 weights and compute: 7.4e-3 measured


def test_new_transformers_key_layout_loads(qwen_tiny_dir, qwen_tiny_flax, prompt, tmp_path):
    cfg, hf, d = qwen_tiny_dir
    renamed = {}
    for k, v in _read_dir(d).items():
        k = k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k
        renamed["model." + k if k.startswith("visual.") else k] = v
    write_safetensors(str(tmp_path / "model.safetensors"), renamed)
    shutil.copy(os.path.join(d, "config.json"), tmp_path)
    assert any(k.startswith("model.language_model.") for k in renamed)
    np.testing.assert_array_equal(
        _our_logits(load_hf(str(tmp_path)), prompt), _our_logits(qwen_tiny_flax, prompt)
    )


def _broken(d, tmp_path, edit):
    t = _read_dir(d)
    edit(t)
    write_safetensors(str(tmp_path / "model.safetensors"), t)
    shutil.copy(os.path.join(d, "config.json"), tmp_path)
    return str(tmp_path)


def test_missing_tensor_is_named(qwen_tiny_dir, tmp_path):
    d = _broken(qwen_tiny_dir[2], tmp_path, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match=r"missing tensor.*model\.layers\.1\.mlp\.up_proj\.weight"):
        load_hf(d)


def test_wrong_shape_is_named_with_its_file(qwen_tiny_dir, tmp_path):
    def edit(t):
        t["visual.blocks.0.attn.qkv.weight"] = t["visual.blocks.0.attn.qkv.weight"][:-1]

    d = _broken(qwen_tiny_dir[2], tmp_path, edit)
    with pytest.raises(
        ValueError, match=r"model\.safetensors: tensor 'visual\.blocks\.0\.attn\.qkv\.weight' has shape"
    ):
        load_hf(d)


def test_unexpected_tensor_is_named(qwen_tiny_dir, tmp_path):
    d = _broken(
        qwen_tiny_dir[2],
        tmp_path,
        lambda t: t.update({"model.layers.9.extra.weight": np.ones(3, np.float32)}),
    )
    with pytest.raises(ValueError, match=r"unexpected tensor.*model\.layers\.9\.extra\.weight"):
        load_hf(d)


def test_bad_config_keys_are_named(qwen_tiny_dir, tmp_path):
    src = json.load(open(os.path.join(qwen_tiny_dir[2], "config.json")))
    fn = str(tmp_path / "config.json")
    bad = json.loads(json.dumps(src))
    del bad["text_config"]["hidden_size"]
    json.dump(bad, open(fn, "w"))
    with pytest.raises(KeyError, match=r"config\.json: missing key 'text_config\.hidden_size'"):
        Qwen2_5_VLConfig.from_pretrained_dir(str(tmp_path))
    bad = json.loads(json.dumps(src))
    bad["vision_config"]["depth"] = "three"
    json.dump(bad, open(fn, "w"))
    with pytest.raises(ValueError, match=r"key 'vision_config\.depth' has bad value"):
        Qwen2_5_VLConfig.from_pretrained_dir(str(tmp_path))
    bad = json.loads(json.dumps(src))
    bad["text_config"]["rope_parameters"]["mrope_section"] = [2, 3, 4]
    json.dump(bad, open(fn, "w"))
    with pytest.raises(ValueError, match=r"mrope_section"):
        Qwen2_5_VLConfig.from_pretrained_dir(str(tmp_path))


def test_config_reads_legacy_flat_layout_and_matches_transformers():
    from transformers import Qwen2_5_VLConfig as HFConfig

    for cfg in (qwen2_5_vl_7b(), qwen2_5_vl_3b()):
        d = cfg.to_hf_dict()
        flat = {**{k: v for k, v in d.items() if k != "text_config"}, **d["text_config"]}
        flat["model_type"] = "qwen2_5_vl"
        flat["rope_scaling"] = {"type": "mrope", "mrope_section": [16, 24, 24]}
        flat["rope_theta"] = 1000000.0
        del flat["rope_parameters"]
        assert Qwen2_5_VLConfig.from_hf_dict(flat) == cfg
        hf = HFConfig(**d)
        assert hf.text_config.hidden_size == cfg.text.hidden_size
        assert hf.text_config.num_key_value_heads == cfg.text.num_key_value_heads
        assert hf.vision_config.out_hidden_size == cfg.text.hidden_size
        assert hf.tie_word_embeddings == cfg.tie_word_embeddings
    assert (qwen2_5_vl_7b().text.vocab_size, qwen2_5_vl_3b().text.vocab_size) == (152064, 151936)


def test_rs_norm_adds_2Ld_params_and_starts_from_the_pretrained_scale(
    qwen_tiny_dir, qwen_tiny_flax, prompt, tmp_path
):
    cfg, hf, d = qwen_tiny_dir
    rs = load_hf(d, config_overrides={"norm_regimes": 2, "scan_layers": True})
    count = lambda m: sum(x.size for x in jax.tree.leaves(nnx.state(m, nnx.Param)))
    assert count(rs) - count(qwen_tiny_flax) == 2 * cfg.text.num_hidden_layers * cfg.text.hidden_size
    ref = _hf_logits(cfg, hf, prompt)
    for r in (0, 1):
        assert_close_to_reference(_our_logits(rs, prompt, regime=jnp.asarray([r])), ref)
    # Perturb the GUI row only: regime 1 changes, regime 0 (and None) keeps HF's logits.
    s = rs.language_model.layers.input_norm.scale
    s.set_value(s.get_value().at[:, 1].mul(1.5))
    assert _rel(_our_logits(rs, prompt, regime=jnp.asarray([1])), ref) > 1e-3
    assert_close_to_reference(_our_logits(rs, prompt, regime=None), ref)
    with pytest.raises(ValueError, match="regime"):
        save_hf(rs, str(tmp_path / "x"))
    save_hf(rs, str(tmp_path / "r1"), regime=1)
    t = _read_dir(str(tmp_path / "r1"))
    np.testing.assert_array_equal(t["model.layers.0.input_layernorm.weight"], np.asarray(s.get_value()[0, 1]))


def test_resize_token_embeddings_keeps_old_logits_and_means_new_rows(qwen_tiny_dir, prompt):
    d = qwen_tiny_dir[2]
    model = load_hf(d)
    before = _our_logits(model, prompt)
    old_embed = np.asarray(model.language_model.embed.get_value())
    resize_token_embeddings(model, 330)
    assert model.config.text.vocab_size == 330
    assert model.language_model.embed.shape == (330, 64) and model.lm_head.shape == (64, 330)
    np.testing.assert_allclose(
        np.asarray(model.language_model.embed.get_value())[325], old_embed.mean(0), rtol=1e-5
    )
    after = _our_logits(model, prompt)
    np.testing.assert_allclose(after[..., :320], before, rtol=1e-5, atol=1e-6)


def test_convert_cli_round_trips_through_orbax(qwen_tiny_dir, qwen_tiny_flax, prompt, tmp_path):
    d = qwen_tiny_dir[2]
    convert_main(["hf2orbax", "--src", d, "--dst", str(tmp_path / "ckpt")])
    convert_main(["orbax2hf", "--src", str(tmp_path / "ckpt"), "--dst", str(tmp_path / "hf")])
    src, dst = _read_dir(d), _read_dir(str(tmp_path / "hf"))
    assert sorted(src) == sorted(dst)
    for k in src:
        np.testing.assert_array_equal(dst[k], src[k], err_msg=k)


@pytest.mark.parametrize("make", [qwen2_5_vl_7b, qwen2_5_vl_3b])
def test_named_configs_have_the_published_parameter_counts(make):
    from transformers import Qwen2_5_VLConfig as HFConfig
    from transformers import Qwen2_5_VLForConditionalGeneration

    from histeve_jax.models.qwen2_5_vl import Qwen2_5_VLModel

    cfg = make()
    model = nnx.eval_shape(lambda: Qwen2_5_VLModel(cfg, rngs=nnx.Rngs(0)))
    ours = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    with torch.device("meta"):
        hf = Qwen2_5_VLForConditionalGeneration(HFConfig(**cfg.to_hf_dict()))
    assert ours == sum(p.numel() for p in hf.parameters())
    assert ours == {qwen2_5_vl_7b: 8_292_166_656, qwen2_5_vl_3b: 3_754_622_976}[make]


def test_tied_embeddings_model_matches_transformers_and_round_trips(prompt, tmp_path):
    from conftest import qwen_tiny_hf

    from histeve_jax.models.qwen2_5_vl import tiny

    cfg = tiny(tie_word_embeddings=True)
    hf = qwen_tiny_hf(cfg, seed=1)
    hf.save_pretrained(str(tmp_path / "src"))
    model = load_hf(str(tmp_path / "src"))
    assert not hasattr(model, "lm_head")
    assert_close_to_reference(_our_logits(model, prompt), _hf_logits(cfg, hf, prompt))
    save_hf(model, str(tmp_path / "dst"))
    src, dst = _read_dir(str(tmp_path / "src")), _read_dir(str(tmp_path / "dst"))
    src.pop("lm_head.weight", None)
    assert sorted(src) == sorted(dst)
    for k in src:
        np.testing.assert_array_equal(dst[k], src[k], err_msg=k)


def test_load_hf_layout_follows_the_backend_unless_told(qwen_tiny_dir, qwen_tiny_flax, prompt):
    """Untold, load_hf gives per-layer parameters on the CPU backend (stacked elsewhere), with the same logits
    as the stacked layout; a Policy loads in the layout its config says, whatever the backend."""
    from histeve_jax.models.qwen2_5_vl.weights import default_scan_layers
    from histeve_jax.policy import Policy, tiny_config

    assert jax.default_backend() == "cpu" and default_scan_layers() is False
    model = load_hf(qwen_tiny_dir[2])
    assert model.config.scan_layers is False
    assert len(model.language_model.layers) == qwen_tiny_dir[0].text.num_hidden_layers
    stacked = qwen_tiny_flax.language_model.layers
    assert model.language_model.layers[0].attn.q.shape == stacked.attn.q.shape[1:]
    np.testing.assert_allclose(_our_logits(model, prompt), _our_logits(qwen_tiny_flax, prompt), atol=1e-5)
    for scan in (True, False):
        config = tiny_config(base=tiny_config().base.replace(scan_layers=scan))
        policy = Policy.from_pretrained(qwen_tiny_dir[2], config)
        assert policy.model.config.scan_layers is scan
