"""Rotary embeddings: the text decoder's M-RoPE, the vision tower's 2-D RoPE, and a port of `get_rope_index`.

`get_rope_index` is written in jnp so it runs inside jit (the prompt's token ids may be traced); what it needs
to be static is only the image/video grids, which fix the number of vision tokens anyway.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from histeve_jax.models.qwen2_5_vl.config import Qwen2_5_VLConfig

Grid = tuple[tuple[int, int, int], ...]


def as_grid(grid_thw: object, name: str = "grid_thw") -> Grid:
    """A concrete `[n, 3]` grid as a hashable tuple; the grids fix shapes, so they cannot be traced."""
    if grid_thw is None or (isinstance(grid_thw, tuple) and not grid_thw):
        return ()
    if isinstance(grid_thw, jax.core.Tracer):
        raise TypeError(
            f"{name} must be concrete (numpy or a tuple), not traced: pass it as a static argument"
        )
    arr = np.asarray(grid_thw)
    if arr.ndim != 2 or arr.shape[1] != 3:
        raise ValueError(f"{name} must have shape [n, 3], got {arr.shape}")
    return tuple(tuple(int(x) for x in row) for row in arr)


def rotate_half(x: jax.Array) -> jax.Array:
    h = x.shape[-1] // 2
    return jnp.concatenate([-x[..., h:], x[..., :h]], axis=-1)


def text_inv_freq(head_dim: int, theta: float) -> jax.Array:
    return 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))


def mrope_cos_sin(
    position_ids: jax.Array, head_dim: int, theta: float, mrope_section: Sequence[int], dtype
) -> tuple[jax.Array, jax.Array]:
    """M-RoPE tables from `position_ids` [3, B, T] (temporal, height, width) -> cos, sin [B, T, head_dim]."""
    inv = text_inv_freq(head_dim, theta)
    freqs = position_ids.astype(jnp.float32)[..., None] * inv  # [3, B, T, D/2]
    cos, sin = jnp.cos(freqs), jnp.sin(freqs)

    def recompose(f):
        # Frequency chunk i takes its positions from axis i % 3 (HF's `recomposition_frequencies`).
        bounds = np.cumsum([0, *mrope_section])
        f = jnp.concatenate([f[i % 3, ..., bounds[i] : bounds[i + 1]] for i in range(len(mrope_section))], -1)
        return jnp.concatenate([f, f], axis=-1)

    return recompose(cos).astype(dtype), recompose(sin).astype(dtype)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [B, T, H, D]; cos/sin [B, T, D]."""
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    return x * cos + rotate_half(x) * sin


# ------------------------------------------------------------------ vision


def vision_position_ids(grid: Grid, merge: int) -> np.ndarray:
    """(h, w) patch coordinates [N, 2], laid out block-major over merge x merge blocks (HF's order)."""
    out = []
    for t, h, w in grid:
        hp, wp = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
        shape = (h // merge, merge, w // merge, merge)
        hp = hp.reshape(shape).transpose(0, 2, 1, 3).reshape(-1)
        wp = wp.reshape(shape).transpose(0, 2, 1, 3).reshape(-1)
        out.append(np.tile(np.stack([hp, wp], -1), (t, 1)))
    return np.concatenate(out, 0)


def vision_cos_sin(pos_hw: np.ndarray, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """2-D RoPE for the vision tower: cos, sin [N, head_dim] from (h, w) coordinates [N, 2]."""
    spatial = head_dim // 2
    inv = 1.0 / (theta ** (jnp.arange(0, spatial, 2, dtype=jnp.float32) / spatial))
    freqs = jnp.asarray(pos_hw, jnp.float32)[..., None] * inv  # [N, 2, D/4]
    freqs = jnp.concatenate([freqs[:, 0], freqs[:, 1]], -1)
    freqs = jnp.concatenate([freqs, freqs], -1)
    return jnp.cos(freqs), jnp.sin(freqs)


def vision_window_index(
    grid: Grid, merge: int, window_size: int, patch_size: int
) -> tuple[np.ndarray, np.ndarray]:
    """Port of HF `get_vision_window_index`: merged-token permutation and cumulative window lengths."""
    window_index, cu = [], [0]
    offset = 0
    wsz = window_size // merge // patch_size
    unit = merge * merge
    for t, h, w in grid:
        lh, lw = h // merge, w // merge
        index = np.arange(t * lh * lw).reshape(t, lh, lw)
        pad_h, pad_w = wsz - lh % wsz, wsz - lw % wsz
        nh, nw = (lh + pad_h) // wsz, (lw + pad_w) // wsz
        padded = np.pad(index, ((0, 0), (0, pad_h), (0, pad_w)), constant_values=-100)
        padded = padded.reshape(t, nh, wsz, nw, wsz).transpose(0, 1, 3, 2, 4).reshape(t, nh * nw, wsz, wsz)
        seqlens = (padded != -100).sum((2, 3)).reshape(-1)
        flat = padded.reshape(-1)
        window_index.append(flat[flat != -100] + offset)
        cu.extend((np.cumsum(seqlens) * unit + cu[-1]).tolist())
        offset += t * lh * lw
    cu_arr = np.asarray(cu, np.int64)
    cu_arr = cu_arr[np.concatenate([[True], np.diff(cu_arr) != 0])]  # unique_consecutive
    return np.concatenate(window_index), cu_arr


def vision_frame_cu_seqlens(grid: Grid) -> np.ndarray:
    """Full-attention segments: one per frame (h * w patches)."""
    lens = [h * w for t, h, w in grid for _ in range(t)]
    return np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)


# ------------------------------------------------------------------ get_rope_index


def _vision_token_tables(cfg: Qwen2_5_VLConfig, grid: Grid, video: bool) -> dict[str, np.ndarray]:
    """Per merged vision token, in stream order: its image index, (t, h, w) offsets, and whether it is the
    image's last token (which carries the image's advance of the text position)."""
    m = cfg.vision.spatial_merge_size
    img, ti, hi, wi, last, span = [], [], [], [], [], []
    for k, (t, h, w) in enumerate(grid):
        lh, lw = h // m, w // m
        tt, hh, ww = np.meshgrid(np.arange(t), np.arange(lh), np.arange(lw), indexing="ij")
        n = t * lh * lw
        img.append(np.full(n, k))
        ti.append(tt.reshape(-1))
        hi.append(hh.reshape(-1))
        wi.append(ww.reshape(-1))
        lst = np.zeros(n, bool)
        lst[-1] = True
        last.append(lst)
        span.append(np.full(n, max(h, w) // m))
    if not grid:
        z = np.zeros(1, np.int32)
        return dict(img=z, t=z, h=z, w=z, last=z.astype(bool), span=z)
    cat = lambda xs: np.concatenate(xs).astype(np.int32)
    return dict(img=cat(img), t=cat(ti), h=cat(hi), w=cat(wi), last=np.concatenate(last), span=cat(span))


def get_rope_index(
    cfg: Qwen2_5_VLConfig,
    input_ids: jax.Array,
    attention_mask: jax.Array | None = None,
    image_grid_thw: object = None,
    video_grid_thw: object = None,
    second_per_grid_ts: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """3-D positions [3, B, T] (int32) and rope deltas [B, 1], as HF's `get_rope_index` computes them.

    Text tokens advance by one; an image/video block starts at the current position, spans
    (t * interval, h, w) offsets, and advances the position by max(h, w) / merge. Padding gets position 0.
    Images and videos are consumed in order over the flattened batch, as HF does.
    """
    igrid, vgrid = as_grid(image_grid_thw, "image_grid_thw"), as_grid(video_grid_thw, "video_grid_thw")
    B, T = input_ids.shape
    valid = jnp.ones((B, T), bool) if attention_mask is None else attention_mask.astype(bool)
    zeros = jnp.zeros((B, T), jnp.int32)
    adv = valid.astype(jnp.int32)  # what each token adds to the running position
    off = [zeros, zeros, zeros]  # per-axis offset from the block start
    is_vis = jnp.zeros((B, T), bool)
    for grid, tok, video in ((igrid, cfg.image_token_id, False), (vgrid, cfg.video_token_id, True)):
        if not grid:
            continue
        tab = {k: jnp.asarray(v) for k, v in _vision_token_tables(cfg, grid, video).items()}
        mine = (input_ids == tok) & valid
        n = tab["img"].shape[0]
        ordinal = jnp.clip(jnp.cumsum(mine.reshape(-1)) - 1, 0, n - 1).reshape(B, T)
        if video:
            spg = (
                jnp.ones((len(grid),), jnp.float32)
                if second_per_grid_ts is None
                else jnp.asarray(second_per_grid_ts, jnp.float32).reshape(-1)
            )
            interval = jnp.float32(cfg.vision.tokens_per_second) * spg  # float32, as torch computes it
            t_off = (tab["t"][ordinal].astype(jnp.float32) * interval[tab["img"][ordinal]]).astype(jnp.int32)
        else:
            t_off = tab["t"][ordinal]
        adv = jnp.where(mine, jnp.where(tab["last"][ordinal], tab["span"][ordinal], 0), adv)
        off = [
            jnp.where(mine, o, prev)
            for o, prev in zip((t_off, tab["h"][ordinal], tab["w"][ordinal]), off, strict=True)
        ]
        is_vis = is_vis | mine
    start = jnp.cumsum(adv, axis=1) - adv  # exclusive prefix sum: the running position before each token
    pos = jnp.stack([jnp.where(valid, start + jnp.where(is_vis, o, 0), 0) for o in off])  # [3, B, T]
    n_valid = valid.sum(1)
    deltas = jnp.max(jnp.where(valid[None], pos, jnp.iinfo(jnp.int32).min), axis=(0, 2)) + 1 - n_valid
    return pos.astype(jnp.int32), deltas[:, None].astype(jnp.int32)
