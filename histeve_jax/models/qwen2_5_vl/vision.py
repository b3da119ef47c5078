"""The Qwen2.5-VL vision tower: patch embedding, windowed/full attention blocks with 2-D RoPE, patch merger.

Grids are static (they fix the number of patches), so window permutations and attention segments are
numpy index tables; attention runs on segments gathered into a padded [segments, max_len] layout, so its
cost is that of the windows, not of a dense [N, N] mask.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from histeve_jax.models.qwen2_5_vl.config import Qwen2_5_VLConfig
from histeve_jax.models.qwen2_5_vl.layers import GatedMLP, RMSNorm, attention, param, remat, zeros_init
from histeve_jax.models.qwen2_5_vl.rope import (
    Grid,
    as_grid,
    rotate_half,
    vision_cos_sin,
    vision_frame_cu_seqlens,
    vision_position_ids,
    vision_window_index,
)
from histeve_jax.parallel import axes


@functools.lru_cache(maxsize=64)
def segment_tables(cu: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For segments [cu[i], cu[i+1]): gather index [S, L], key validity [S, L], and the inverse map
    [N] from a token to its slot in the flattened [S * L] layout."""
    cu_arr = np.asarray(cu)
    lens = np.diff(cu_arr)
    L = int(lens.max())
    pos = np.arange(L)[None, :]
    valid = pos < lens[:, None]
    gather = np.where(valid, cu_arr[:-1, None] + pos, 0)
    inverse = np.concatenate([s * L + np.arange(n) for s, n in enumerate(lens)])
    return gather, valid, inverse


@functools.lru_cache(maxsize=64)
def vision_plan(cfg_v, grid: Grid):
    """The static plan for a set of grids: window permutation and segment tables."""
    m = cfg_v.spatial_merge_size
    window_index, cu_window = vision_window_index(grid, m, cfg_v.window_size, cfg_v.patch_size)
    pos = vision_position_ids(grid, m)
    unit = m * m
    n = pos.shape[0]
    # Permute patches (in units of merge blocks) into window order; permute rope coordinates alike.
    perm = (window_index[:, None] * unit + np.arange(unit)[None]).reshape(-1)
    return dict(
        perm=perm,
        pos=pos[perm],
        reverse=np.argsort(window_index),
        window=segment_tables(tuple(int(x) for x in cu_window)),
        full=segment_tables(tuple(int(x) for x in vision_frame_cu_seqlens(grid))),
        n=n,
    )


class VisionAttention(nnx.Module):
    def __init__(self, cfg: Qwen2_5_VLConfig, *, rngs: nnx.Rngs):
        v = cfg.vision
        E, H, D = v.hidden_size, v.num_heads, v.head_dim
        pd = cfg.param_dtype
        self.dtype = cfg.dtype
        self.qkv = param(rngs, (E, 3, H, D), (axes.EMBED, None, axes.Q_HEADS, axes.HEAD_DIM), pd)
        self.qkv_bias = param(rngs, (3, H, D), (None, axes.Q_HEADS, axes.HEAD_DIM), pd, zeros_init)
        self.proj = param(rngs, (H, D, E), (axes.Q_HEADS, axes.HEAD_DIM, axes.EMBED), pd)
        self.proj_bias = param(rngs, (E,), (axes.NORM,), pd, zeros_init)
        self.scale = D**-0.5

    def __call__(self, x, cos, sin, tables):
        c = lambda p: p[...].astype(self.dtype)
        qkv = jnp.einsum("ne,eshd->snhd", x, c(self.qkv)) + c(self.qkv_bias)[:, None]
        q, k, v = qkv[0], qkv[1], qkv[2]  # [N, H, D]
        # RoPE in float32, as HF's apply_rotary_pos_emb_vision.
        cf, sf = cos[:, None, :], sin[:, None, :]
        rot = lambda t: (t.astype(jnp.float32) * cf + rotate_half(t.astype(jnp.float32)) * sf).astype(t.dtype)
        q, k = rot(q), rot(k)
        gather, valid, inverse = tables
        N, H, D = q.shape
        seg = lambda t: t[gather]  # [S, L, H, D]
        o = attention(seg(q), seg(k), seg(v), jnp.asarray(valid)[:, None, :], self.scale)
        o = o.reshape(-1, H, D)[inverse]
        return jnp.einsum("nhd,hde->ne", o, c(self.proj)) + c(self.proj_bias)


class VisionBlock(nnx.Module):
    def __init__(self, cfg: Qwen2_5_VLConfig, *, rngs: nnx.Rngs):
        v = cfg.vision
        self.norm1 = RMSNorm(v.hidden_size, 1e-6, param_dtype=cfg.param_dtype, rngs=rngs)
        self.norm2 = RMSNorm(v.hidden_size, 1e-6, param_dtype=cfg.param_dtype, rngs=rngs)
        self.attn = VisionAttention(cfg, rngs=rngs)
        self.mlp = GatedMLP(
            v.hidden_size,
            v.intermediate_size,
            bias=True,
            dtype=cfg.dtype,
            param_dtype=cfg.param_dtype,
            rngs=rngs,
        )

    def __call__(self, x, cos, sin, tables):
        x = x + self.attn(self.norm1(x), cos, sin, tables)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nnx.Module):
    """RMSNorm, then 2x2 neighbouring patches concatenated -> Linear -> GELU -> Linear."""

    def __init__(self, cfg: Qwen2_5_VLConfig, *, rngs: nnx.Rngs):
        v = cfg.vision
        pd = cfg.param_dtype
        self.dtype = cfg.dtype
        hid = v.hidden_size * v.spatial_merge_size**2
        self.hid = hid
        self.ln_q = RMSNorm(v.hidden_size, 1e-6, param_dtype=pd, rngs=rngs)
        self.fc1 = param(rngs, (hid, hid), (axes.MLP, axes.EMBED), pd)
        self.fc1_bias = param(rngs, (hid,), (axes.NORM,), pd, zeros_init)
        self.fc2 = param(rngs, (hid, v.out_hidden_size), (axes.MLP, axes.EMBED), pd)
        self.fc2_bias = param(rngs, (v.out_hidden_size,), (axes.NORM,), pd, zeros_init)

    def __call__(self, x):
        c = lambda p: p[...].astype(self.dtype)
        x = self.ln_q(x).reshape(-1, self.hid)
        x = jax.nn.gelu(x @ c(self.fc1) + c(self.fc1_bias), approximate=False)
        return x @ c(self.fc2) + c(self.fc2_bias)


class VisionTower(nnx.Module):
    """HF `Qwen2_5_VisionTransformerPretrainedModel`: flattened patches [N, C*T*P*P] -> merged tokens
    [N / merge^2, out_hidden_size], in the processor's (image-major, merge-block-major) order."""

    def __init__(self, cfg: Qwen2_5_VLConfig, *, rngs: nnx.Rngs):
        v = cfg.vision
        self.cfg_v = v
        self.dtype = cfg.dtype
        self.remat = cfg.remat
        self.patch_embed = param(
            rngs, (v.patch_dim, v.hidden_size), (axes.PATCH, axes.EMBED), cfg.param_dtype
        )
        self.blocks = nnx.List([VisionBlock(cfg, rngs=rngs) for _ in range(v.depth)])
        self.merger = PatchMerger(cfg, rngs=rngs)

    def __call__(self, pixel_values: jax.Array, grid_thw: object) -> jax.Array:
        grid = as_grid(grid_thw)
        if len(grid) > 1 and len(set(grid)) == 1:
            return self._same_size_images(pixel_values, grid)
        return self._forward(pixel_values, grid)

    def _same_size_images(self, pixel_values: jax.Array, grid: tuple) -> jax.Array:
        """Images of one size (the policy's frames): one image's program vmapped over the images, so the
        image axis shards over the batch mesh axes. (`_forward`'s permutations and segment gathers index the
        flat patch axis of all images, which SPMD can only do by gathering every patch onto every device.)
        Same numbers and image-major output order as `_forward`."""
        n, (t, h, w) = len(grid), grid[0]
        if pixel_values.shape != (n * t * h * w, self.cfg_v.patch_dim):
            raise ValueError(
                f"pixel_values has shape {pixel_values.shape}; grid_thw {n} x {grid[0]} needs "
                f"({n * t * h * w}, {self.cfg_v.patch_dim})"
            )
        x = axes.constrain(pixel_values.reshape(n, t * h * w, -1), (axes.ACT_BATCH, None, None))
        out = jax.vmap(lambda xi: self._forward(xi, grid[:1]), spmd_axis_name=axes.batch_mesh_axes(n))(x)
        return out.reshape(n * out.shape[1], out.shape[2])

    def _forward(self, pixel_values: jax.Array, grid: tuple) -> jax.Array:
        plan = vision_plan(self.cfg_v, grid)
        if pixel_values.shape != (plan["n"], self.cfg_v.patch_dim):
            raise ValueError(
                f"pixel_values has shape {pixel_values.shape}; grid_thw {grid} needs "
                f"({plan['n']}, {self.cfg_v.patch_dim})"
            )
        # Conv3d with kernel == stride over a flattened patch is a matmul.
        x = pixel_values.astype(self.dtype) @ self.patch_embed[...].astype(self.dtype)
        x = x[plan["perm"]]
        cos, sin = vision_cos_sin(plan["pos"], self.cfg_v.head_dim, self.cfg_v.rope_theta)
        for i, blk in enumerate(self.blocks):
            tables = plan["full"] if i in self.cfg_v.fullatt_block_indexes else plan["window"]
            run = lambda x, blk=blk, tables=tables: blk(x, cos, sin, tables)
            x = remat(run, self.remat)(x)
        return self.merger(x)[plan["reverse"]]
