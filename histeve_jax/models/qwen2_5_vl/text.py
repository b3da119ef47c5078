"""The Qwen2.5-VL text decoder: pre-norm GQA layers with M-RoPE, optionally stacked and scanned, and its KV
cache.

The cache keeps the KV heads before the positions ([B, K, S, D] per layer), the layout attention reads without
a transpose. Scanned, it is one [L, B, K, S, D] pair in the scan's carry and a step writes only its new
positions (MaxText's layout); unrolled (separate layer modules) it is one [B, K, S, D] pair per layer.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from histeve_jax.models.qwen2_5_vl.config import Qwen2_5_VLConfig
from histeve_jax.models.qwen2_5_vl.layers import GatedMLP, RMSNorm, attention, param, remat, zeros_init
from histeve_jax.models.qwen2_5_vl.rope import apply_rope
from histeve_jax.parallel import axes

# Stacked: (k, v), each [L, B, K, S, D]; per layer: a tuple of L (k, v) pairs, each [B, K, S, D].
KVCache = tuple[jax.Array, jax.Array] | tuple[tuple[jax.Array, jax.Array], ...]

_ACT = (axes.ACT_BATCH, axes.ACT_LENGTH, axes.ACT_EMBED)


class Attention(nnx.Module):
    """HF `Qwen2_5_VLAttention` (q/k/v with bias, o without)."""

    def __init__(self, cfg: Qwen2_5_VLConfig, *, rngs: nnx.Rngs):
        t = cfg.text
        E, H, K, D = t.hidden_size, t.num_attention_heads, t.num_key_value_heads, t.head_dim
        pd = cfg.param_dtype
        self.dtype = cfg.dtype
        self.q = param(rngs, (E, H, D), (axes.EMBED, axes.Q_HEADS, axes.HEAD_DIM), pd)
        self.q_bias = param(rngs, (H, D), (axes.Q_HEADS, axes.HEAD_DIM), pd, zeros_init)
        self.k = param(rngs, (E, K, D), (axes.EMBED, axes.KV_HEADS, axes.HEAD_DIM), pd)
        self.k_bias = param(rngs, (K, D), (axes.KV_HEADS, axes.HEAD_DIM), pd, zeros_init)
        self.v = param(rngs, (E, K, D), (axes.EMBED, axes.KV_HEADS, axes.HEAD_DIM), pd)
        self.v_bias = param(rngs, (K, D), (axes.KV_HEADS, axes.HEAD_DIM), pd, zeros_init)
        self.o = param(rngs, (H, D, E), (axes.Q_HEADS, axes.HEAD_DIM, axes.EMBED), pd)
        self.scale = D**-0.5

    def __call__(self, x, cos, sin, mask, kv=None, cache_index=None, layer=None):
        """`kv`: this layer's (k, v) cache [B, K, S, D], or with `layer` the stacked [L, B, K, S, D] one; the
        chunk's keys and values are written at `cache_index` and attention runs over the whole cache."""
        c = lambda p: p[...].astype(self.dtype)
        q = jnp.einsum("bte,ehd->bthd", x, c(self.q)) + c(self.q_bias)
        k = jnp.einsum("bte,ehd->bthd", x, c(self.k)) + c(self.k_bias)
        v = jnp.einsum("bte,ehd->bthd", x, c(self.v)) + c(self.v_bias)
        q = axes.constrain(q, (axes.ACT_BATCH, axes.ACT_LENGTH, axes.ACT_HEADS, axes.ACT_HEAD_DIM))
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if kv is None:
            o = attention(q, k.astype(q.dtype), v.astype(q.dtype), mask, self.scale)
        else:
            # Only the chunk's positions are written; the mask decides which cached positions count.
            k, kc = _cache_write(kv[0], k, cache_index, layer)
            v, vc = _cache_write(kv[1], v, cache_index, layer)
            kv = (kc, vc)
            o = attention(q, k.astype(q.dtype), v.astype(q.dtype), mask, self.scale, kv_layout="bksd")
        # As one [H*D, E] matmul: an [H, D, E] einsum lets XLA:CPU transpose the weight on every call.
        B, T, H, D = o.shape
        return o.reshape(B, T, H * D) @ c(self.o).reshape(H * D, -1), kv


def _cache_write(cache: jax.Array, new: jax.Array, index, layer) -> tuple[jax.Array, jax.Array]:
    """`new` [B, T, K, D] written at position `index` of `cache` ([B, K, S, D], or [L, B, K, S, D] at
    `layer`): (this layer's cache [B, K, S, D], the whole updated cache)."""
    new = new.astype(cache.dtype).transpose(0, 2, 1, 3)
    if layer is None:
        cache = jax.lax.dynamic_update_slice(cache, new, (0, 0, index, 0))
        return cache, cache
    cache = jax.lax.dynamic_update_slice(cache, new[None], (layer, 0, 0, index, 0))
    return jax.lax.dynamic_index_in_dim(cache, layer, keepdims=False), cache


class DecoderLayer(nnx.Module):
    """HF `Qwen2_5_VLDecoderLayer`; its two pre-norms are the RS-Norm hook."""

    def __init__(self, cfg: Qwen2_5_VLConfig, *, rngs: nnx.Rngs):
        t = cfg.text
        self.input_norm = RMSNorm(
            t.hidden_size, t.rms_norm_eps, regimes=cfg.norm_regimes, param_dtype=cfg.param_dtype, rngs=rngs
        )
        self.attn = Attention(cfg, rngs=rngs)
        self.post_attn_norm = RMSNorm(
            t.hidden_size, t.rms_norm_eps, regimes=cfg.norm_regimes, param_dtype=cfg.param_dtype, rngs=rngs
        )
        self.mlp = GatedMLP(
            t.hidden_size,
            t.intermediate_size,
            bias=False,
            dtype=cfg.dtype,
            param_dtype=cfg.param_dtype,
            rngs=rngs,
        )

    def __call__(self, x, cos, sin, mask, regime=None, kv=None, cache_index=None, layer=None):
        h, kv = self.attn(self.input_norm(x, regime), cos, sin, mask, kv, cache_index, layer)
        x = x + h
        x = x + self.mlp(self.post_attn_norm(x, regime))
        return axes.constrain(x, _ACT), kv


class TextModel(nnx.Module):
    """Embedding, decoder layers and final norm (HF `Qwen2_5_VLTextModel`)."""

    def __init__(self, cfg: Qwen2_5_VLConfig, *, rngs: nnx.Rngs):
        t = cfg.text
        self.cfg = cfg
        self.embed = param(rngs, (t.vocab_size, t.hidden_size), (axes.VOCAB, axes.EMBED), cfg.param_dtype)
        if cfg.scan_layers:

            @nnx.split_rngs(splits=t.num_hidden_layers)
            @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: axes.LAYERS})
            def make(r):
                return DecoderLayer(cfg, rngs=r)

            self.layers = make(rngs)
        else:
            self.layers = nnx.List([DecoderLayer(cfg, rngs=rngs) for _ in range(t.num_hidden_layers)])
        self.norm = RMSNorm(t.hidden_size, t.rms_norm_eps, param_dtype=cfg.param_dtype, rngs=rngs)

    def embed_tokens(self, input_ids: jax.Array) -> jax.Array:
        return self.embed[...].astype(self.cfg.dtype)[input_ids]

    def unrolled(self) -> bool:
        """Whether stacked layers run unrolled (`layer_loop`; "auto": on the CPU backend)."""
        loop = self.cfg.layer_loop
        auto_unroll = loop == "auto" and jax.default_backend() == "cpu"
        return not self.cfg.scan_layers or loop == "unroll" or auto_unroll

    def split_layers(self) -> list[DecoderLayer]:
        """The layers as separate modules (scanned: the stacks split along the layer axis, whose gradient is
        their concatenation)."""
        if not self.cfg.scan_layers:
            return list(self.layers)
        graphdef, state = nnx.split(self.layers)
        n = self.cfg.text.num_hidden_layers
        leaves, treedef = jax.tree.flatten(state)
        parts = [[p[0] for p in jax.lax.split(a, (1,) * n)] for a in leaves]
        return [nnx.merge(graphdef, jax.tree.unflatten(treedef, [p[i] for p in parts])) for i in range(n)]

    def init_cache(self, batch: int, length: int, per_layer: bool) -> KVCache:
        """A zero cache of `length` positions: one (k, v) pair per layer (`per_layer`: for unrolled layers),
        or the stacked pair the scanned layers carry."""
        t = self.cfg.text
        shape = (batch, t.num_key_value_heads, length, t.head_dim)
        if per_layer:
            return tuple((jnp.zeros(shape, self.cfg.dtype),) * 2 for _ in range(t.num_hidden_layers))
        return (jnp.zeros((t.num_hidden_layers, *shape), self.cfg.dtype),) * 2

    def __call__(
        self,
        x: jax.Array,
        cos: jax.Array,
        sin: jax.Array,
        mask: jax.Array,
        regime: jax.Array | None = None,
        cache: KVCache | None = None,
        cache_index: jax.Array | int | None = None,
        layers: list[DecoderLayer] | None = None,
    ) -> tuple[jax.Array, KVCache | None]:
        """x [B, T, E] -> final hidden states [B, T, E] (after the norm) and the updated cache. With `layers`
        (separate `DecoderLayer`s, e.g. per-layer copies of the stacked weights), or when `unrolled()`, the
        loop is unrolled and the cache is per layer; else the layers are scanned with the stacked cache."""
        x = axes.constrain(x, _ACT)
        if layers is None and self.cfg.scan_layers and self.unrolled():
            layers = self.split_layers()

        def run(layer, x, kv, i=None):
            return layer(x, cos, sin, mask, regime, kv, cache_index, i)

        if layers is None and self.cfg.scan_layers:
            graphdef, state = nnx.split(self.layers)

            def body(carry, xs):
                x, kv = carry
                st, i = xs
                layer_fn = lambda x, st, kv: run(nnx.merge(graphdef, st), x, kv, None if kv is None else i)
                return remat(layer_fn, self.cfg.remat)(x, st, kv), None

            index = jnp.arange(self.cfg.text.num_hidden_layers)
            (x, cache), _ = jax.lax.scan(body, (x, cache), (state, index))
        else:
            new = []
            for i, layer in enumerate(self.layers if layers is None else layers):
                kv = None if cache is None else cache[i]
                x, kv = remat(lambda x, kv, layer=layer: run(layer, x, kv), self.cfg.remat)(x, kv)
                new.append(kv)
            cache = None if cache is None else tuple(new)
        return self.norm(x), cache
