"""Building blocks shared by the text decoder and the vision tower: parameters with logical axis names,
RMSNorm (with the RS-Norm regime hook), gated MLP, and softmax attention."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from histeve_jax.parallel import axes

_INIT = jax.nn.initializers.normal(0.02)


def param(rngs: nnx.Rngs, shape: Sequence[int], names: Sequence[str | None], dtype, init=_INIT) -> nnx.Param:
    """A parameter whose `out_sharding` metadata holds its logical axis names."""
    if len(shape) != len(names):
        raise ValueError(f"shape {tuple(shape)} and logical names {tuple(names)} differ in rank")
    # Placement is explicit (load_hf / the parallel helpers resolve logical names by axes.RULES), so no
    # eager sharding at creation.
    return nnx.Param(
        init(rngs.params(), tuple(shape), dtype), out_sharding=tuple(names), eager_sharding=False
    )


def zeros_init(key, shape, dtype):
    del key
    return jnp.zeros(shape, dtype)


def ones_init(key, shape, dtype):
    del key
    return jnp.ones(shape, dtype)


class RMSNorm(nnx.Module):
    """HF `Qwen2_5_VLRMSNorm`. With `regimes > 1` the scale is [regimes, d] and row `regime[b]` scales
    sequence b (RS-Norm); `regimes == 1` keeps HF's [d] scale."""

    def __init__(self, dim: int, eps: float, *, regimes: int = 1, param_dtype=jnp.float32, rngs: nnx.Rngs):
        self.eps = eps
        self.regimes = regimes
        if regimes == 1:
            self.scale = param(rngs, (dim,), (axes.NORM,), param_dtype, ones_init)
        else:
            self.scale = param(rngs, (regimes, dim), (axes.REGIME, axes.NORM), param_dtype, ones_init)

    def __call__(self, x: jax.Array, regime: jax.Array | None = None) -> jax.Array:
        in_dtype = x.dtype
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        w = self.scale[...]
        if self.regimes > 1:
            r = jnp.zeros((x.shape[0],), jnp.int32) if regime is None else regime.astype(jnp.int32)
            w = w[r].reshape((x.shape[0],) + (1,) * (x.ndim - 2) + (w.shape[-1],))
        return w.astype(in_dtype) * xf.astype(in_dtype)


class GatedMLP(nnx.Module):
    """down(silu(gate(x)) * up(x)); the vision tower's has biases, the decoder's not."""

    def __init__(self, dim: int, hidden: int, *, bias: bool, dtype, param_dtype, rngs: nnx.Rngs):
        self.dtype = dtype
        self.gate = param(rngs, (dim, hidden), (axes.EMBED, axes.MLP), param_dtype)
        self.up = param(rngs, (dim, hidden), (axes.EMBED, axes.MLP), param_dtype)
        self.down = param(rngs, (hidden, dim), (axes.MLP, axes.EMBED), param_dtype)
        self.bias = bias
        if bias:
            self.gate_bias = param(rngs, (hidden,), (axes.MLP,), param_dtype, zeros_init)
            self.up_bias = param(rngs, (hidden,), (axes.MLP,), param_dtype, zeros_init)
            self.down_bias = param(rngs, (dim,), (axes.NORM,), param_dtype, zeros_init)

    def __call__(self, x: jax.Array) -> jax.Array:
        c = lambda p: p[...].astype(self.dtype)
        g = x @ c(self.gate)
        u = x @ c(self.up)
        if self.bias:
            g, u = g + c(self.gate_bias), u + c(self.up_bias)
        h = jax.nn.silu(g) * u
        h = axes.constrain(h, (axes.ACT_BATCH, axes.ACT_LENGTH, axes.ACT_MLP)[-h.ndim :])
        y = h @ c(self.down)
        return y + c(self.down_bias) if self.bias else y


def attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array | None, scale: float,
              kv_layout: str = "bskd") -> jax.Array:
    """Grouped-query softmax attention. q [B, T, H, D], k/v [B, S, K, D] (`kv_layout="bksd"`: [B, K, S, D],
    the KV cache's layout), mask bool broadcastable to [B, T, S] (True = attend). Scores and softmax in
    float32, as HF's eager/sdpa paths."""
    B, T, H, D = q.shape
    K = k.shape[2] if kv_layout == "bskd" else k.shape[1]
    qg = q.reshape(B, T, K, H // K, D)
    if kv_layout not in ("bskd", "bksd"):
        raise ValueError(f"attention: kv_layout {kv_layout!r}; expected 'bskd' or 'bksd'")
    s = jnp.einsum(f"btkgd,{kv_layout}->bkgts", qg, k, preferred_element_type=jnp.float32) * scale
    if mask is not None:
        s = jnp.where(mask[:, None, None], s, jnp.finfo(jnp.float32).min)
    p = jax.nn.softmax(s, axis=-1).astype(v.dtype)
    o = jnp.einsum(f"bkgts,{kv_layout}->btkgd", p, v)
    return o.reshape(B, T, H, D)


def remat(fn, policy: str):
    """`fn` under `jax.checkpoint` with the named policy ("none" returns it unchanged)."""
    if policy == "none":
        return fn
    if policy == "full":
        return jax.checkpoint(fn)
    if policy == "save_dots":
        return jax.checkpoint(fn, policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable)
    raise ValueError(f"remat policy {policy!r}; expected 'none', 'full' or 'save_dots'")
