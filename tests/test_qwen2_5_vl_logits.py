"""Our Qwen2.5-VL gives transformers' logits: text, images, video, padding, long prompts, scan or not."""

import functools

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from conftest import assert_close_to_reference, qwen_images, qwen_vision_block
from flax import nnx

from histeve_jax.models.qwen2_5_vl import get_rope_index, load_hf
from histeve_jax.models.qwen2_5_vl.rope import as_grid


def _mm_types(cfg, ids):
    return (ids == cfg.image_token_id).astype(np.int64) + 2 * (ids == cfg.video_token_id).astype(np.int64)


def hf_logits(cfg, hf, ids, mask=None, pv=None, grid=None, pvv=None, vgrid=None, spg=None, hidden=False):
    t = lambda x: None if x is None else torch.tensor(x)
    with torch.no_grad():
        out = (hf.model if hidden else hf)(
            input_ids=t(ids),
            attention_mask=t(mask),
            pixel_values=t(pv),
            image_grid_thw=t(grid),
            pixel_values_videos=t(pvv),
            video_grid_thw=t(vgrid),
            second_per_grid_ts=t(spg),
            mm_token_type_ids=t(_mm_types(cfg, ids)),
        )
    return out.last_hidden_state.numpy() if hidden else out.logits.numpy()


@functools.partial(nnx.jit, static_argnames=("grid", "vgrid"))
def _forward(model, ids, mask, pv, pvv, spg, grid, vgrid):
    return model(
        ids,
        attention_mask=mask,
        pixel_values=pv,
        image_grid_thw=grid,
        pixel_values_videos=pvv,
        video_grid_thw=vgrid,
        second_per_grid_ts=spg,
        return_hidden=True,
    )


def our_logits(model, ids, mask=None, pv=None, grid=None, pvv=None, vgrid=None, spg=None, hidden=False):
    """Logits (or final hidden states) from one jitted forward (grids static)."""
    j = lambda x: None if x is None else jnp.asarray(x)
    out = _forward(model, j(ids), j(mask), j(pv), j(pvv), j(spg), as_grid(grid), as_grid(vgrid))
    return np.asarray(out[1] if hidden else out[0])


assert_close = assert_close_to_reference  # the measured bound (conftest)


@pytest.fixture(scope="module", params=["scan", "loop"])
def model(request, qwen_tiny_dir, qwen_tiny_flax):
    if request.param == "scan":
        return qwen_tiny_flax
    return load_hf(qwen_tiny_dir[2], config_overrides={"scan_layers": False})


def _video(seed=1, grid=(2, 4, 6)):
    n = int(np.prod(grid))
    pvv = np.random.default_rng(seed).standard_normal((n, 1176)).astype(np.float32)
    return pvv, np.asarray([grid])


def test_text_only_logits_match_transformers(qwen_tiny_dir, model):
    cfg, hf, _ = qwen_tiny_dir
    ids = np.random.default_rng(0).integers(0, 290, size=(2, 17))
    assert_close(our_logits(model, ids), hf_logits(cfg, hf, ids))


def test_one_image_logits_match_transformers(qwen_tiny_dir, qwen_tiny_flax):
    model = qwen_tiny_flax
    cfg, hf, _ = qwen_tiny_dir
    pv, grid = qwen_images([(112, 168)])
    ids = np.asarray([[1, 2, 3] + qwen_vision_block(cfg, grid[0], cfg.image_token_id) + [4, 5, 6]])
    assert_close(our_logits(model, ids, pv=pv, grid=grid), hf_logits(cfg, hf, ids, pv=pv, grid=grid))
    # The final hidden states (the completion detector reads them) match HF's last_hidden_state.
    ref_h = hf_logits(cfg, hf, ids, pv=pv, grid=grid, hidden=True)
    assert_close(our_logits(model, ids, pv=pv, grid=grid, hidden=True), ref_h)
    # Precomputed image features (a policy sharing its image encoder) give the same logits.
    feats = model.get_image_features(jnp.asarray(pv), grid)
    via_embeds = np.asarray(model(jnp.asarray(ids), image_embeds=feats, image_grid_thw=grid))
    assert_close(via_embeds, hf_logits(cfg, hf, ids, pv=pv, grid=grid))


def test_two_images_of_different_sizes_match_transformers(qwen_tiny_dir, model):
    cfg, hf, _ = qwen_tiny_dir
    pv, grid = qwen_images([(112, 168), (84, 140)], seed=2)
    blocks = [qwen_vision_block(cfg, g, cfg.image_token_id) for g in grid]
    ids = np.asarray([[7, 8] + blocks[0] + [9, 10, 11] + blocks[1] + [12]])
    assert_close(our_logits(model, ids, pv=pv, grid=grid), hf_logits(cfg, hf, ids, pv=pv, grid=grid))


def test_video_with_seconds_per_grid_matches_transformers(qwen_tiny_dir, qwen_tiny_flax):
    model = qwen_tiny_flax
    cfg, hf, _ = qwen_tiny_dir
    pvv, vgrid = _video()
    pv, grid = qwen_images([(56, 84)], seed=3)
    spg = np.asarray([0.75], np.float32)  # interval 1.5: temporal positions are truncated, as in HF
    ids = np.asarray(
        [
            [1]
            + qwen_vision_block(cfg, vgrid[0], cfg.video_token_id)
            + [2, 3]
            + qwen_vision_block(cfg, grid[0], cfg.image_token_id)
            + [4]
        ]
    )
    kw = dict(pv=pv, grid=grid, pvv=pvv, vgrid=vgrid, spg=spg)
    assert_close(our_logits(model, ids, **kw), hf_logits(cfg, hf, ids, **kw))


def test_left_padded_batch_matches_transformers(qwen_tiny_dir, model):
    cfg, hf, _ = qwen_tiny_dir
    pv, grid = qwen_images([(56, 84), (84, 112)], seed=4)
    r0 = [1, 2] + qwen_vision_block(cfg, grid[0], cfg.image_token_id) + [3]
    r1 = [4, 5, 6, 7] + qwen_vision_block(cfg, grid[1], cfg.image_token_id) + [8, 9, 10]
    T = max(len(r0), len(r1))
    ids = np.zeros((2, T), np.int64)
    mask = np.zeros((2, T), np.int64)
    for b, r in enumerate((r0, r1)):
        ids[b, T - len(r) :], mask[b, T - len(r) :] = r, 1
    ours = our_logits(model, ids, mask=mask, pv=pv, grid=grid)
    assert_close(ours, hf_logits(cfg, hf, ids, mask=mask, pv=pv, grid=grid), where=mask.astype(bool))
    # Text only, padded: HF positions ignore the mask, ours follow it; RoPE is relative, so logits agree.
    tids = np.random.default_rng(5).integers(0, 290, size=(2, 9))
    tmask = np.ones_like(tids)
    tmask[0, :4] = 0
    assert_close(
        our_logits(model, tids, mask=tmask), hf_logits(cfg, hf, tids, mask=tmask), tmask.astype(bool)
    )


def test_long_prompt_matches_transformers(qwen_tiny_dir, qwen_tiny_flax):
    cfg, hf, _ = qwen_tiny_dir
    pv, grid = qwen_images([(112, 112)], seed=6)
    rng = np.random.default_rng(7)
    ids = np.asarray(
        [
            list(rng.integers(0, 290, 200))
            + qwen_vision_block(cfg, grid[0], cfg.image_token_id)
            + list(rng.integers(0, 290, 250))
        ]
    )
    assert_close(our_logits(qwen_tiny_flax, ids, pv=pv, grid=grid), hf_logits(cfg, hf, ids, pv=pv, grid=grid))


def test_vision_tower_matches_transformers(qwen_tiny_dir, qwen_tiny_flax):
    cfg, hf, _ = qwen_tiny_dir
    # 8x12 patches -> 4x6 merged tokens -> windows of 2x2 merged tokens: windowing is active.
    pv, grid = qwen_images([(112, 168), (84, 140)], seed=8)
    with torch.no_grad():
        ref = hf.model.get_image_features(torch.tensor(pv), torch.tensor(grid)).pooler_output
    ref = torch.cat(ref).numpy()
    vis = nnx.jit(lambda m, pv: m.get_image_features(pv, as_grid(grid)))
    ours = np.asarray(vis(qwen_tiny_flax, jnp.asarray(pv)))
    assert ours.shape == ref.shape
    assert_close(ours, ref)


def test_get_rope_index_equals_transformers(qwen_tiny_dir):
    cfg, hf, _ = qwen_tiny_dir
    _, grid = qwen_images([(56, 84), (84, 140)], seed=9)
    _, vgrid = _video(grid=(4, 4, 6))
    spg = np.asarray([0.5], np.float32)
    r0 = (
        [1]
        + qwen_vision_block(cfg, grid[0], cfg.image_token_id)
        + [2, 3]
        + qwen_vision_block(cfg, vgrid[0], cfg.video_token_id)
        + [4]
    )
    r1 = [5, 6] + qwen_vision_block(cfg, grid[1], cfg.image_token_id) + [7, 8, 9]
    T = max(len(r0), len(r1)) + 2
    ids = np.zeros((2, T), np.int64)
    mask = np.zeros((2, T), np.int64)
    for b, r in enumerate((r0, r1)):
        ids[b, T - len(r) :], mask[b, T - len(r) :] = r, 1
    t = torch.tensor
    ref_pos, ref_delta = hf.model.get_rope_index(
        t(ids),
        t(_mm_types(cfg, ids)),
        image_grid_thw=t(grid),
        video_grid_thw=t(vgrid),
        second_per_grid_ts=t(spg),
        attention_mask=t(mask),
    )
    pos, delta = get_rope_index(cfg, jnp.asarray(ids), jnp.asarray(mask), grid, vgrid, jnp.asarray(spg))
    np.testing.assert_array_equal(np.asarray(pos), ref_pos.numpy())
    np.testing.assert_array_equal(np.asarray(delta), ref_delta.numpy())
    # Text and images, no mask.
    ids1 = np.asarray([r1])
    ref_pos, ref_delta = hf.model.get_rope_index(t(ids1), t(_mm_types(cfg, ids1)), image_grid_thw=t(grid[1:]))
    pos, delta = get_rope_index(cfg, jnp.asarray(ids1), None, grid[1:])
    np.testing.assert_array_equal(np.asarray(pos), ref_pos.numpy())
    np.testing.assert_array_equal(np.asarray(delta), ref_delta.numpy())
