"""The Qwen2.5-VL text decoder: pre-norm GQA layers with M-RoPE, optionally stacked and scanned."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from histeve_jax.models.qwen2_5_vl.config import Qwen2_5_VLConfig
from histeve_jax.models.qwen2_5_vl.layers import GatedMLP, RMSNorm, attention, param, remat, zeros_init
from histeve_jax.models.qwen2_5_vl.rope import apply_rope
from histeve_jax.parallel import axes

# (k, v), each [L, B, S, K, D]: the stacked per-layer KV cache.
KVCache = tuple[jax.Array, jax.Array]

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

    def __call__(self, x, cos, sin, mask, kv=None, cache_index=None):
        c = lambda p: p[...].astype(self.dtype)
        q = jnp.einsum("bte,ehd->bthd", x, c(self.q)) + c(self.q_bias)
        k = jnp.einsum("bte,ehd->bthd", x, c(self.k)) + c(self.k_bias)
        v = jnp.einsum("bte,ehd->bthd", x, c(self.v)) + c(self.v_bias)
        q = axes.constrain(q, (axes.ACT_BATCH, axes.ACT_LENGTH, axes.ACT_HEADS, axes.ACT_HEAD_DIM))
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if kv is not None:
            # Write this chunk into the cache at `cache_index`; attend over the whole cache (mask decides).
            kc, vc = kv
            idx = (0, cache_index, 0, 0)
            k = jax.lax.dynamic_update_slice(kc, k.astype(kc.dtype), idx)
            v = jax.lax.dynamic_update_slice(vc, v.astype(vc.dtype), idx)
            kv = (k, v)
        o = attention(q, k.astype(q.dtype), v.astype(q.dtype), mask, self.scale)
        return jnp.einsum("bthd,hde->bte", o, c(self.o)), kv


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

    def __call__(self, x, cos, sin, mask, regime=None, kv=None, cache_index=None):
        h, kv = self.attn(self.input_norm(x, regime), cos, sin, mask, kv, cache_index)
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

    def __call__(
        self,
        x: jax.Array,
        cos: jax.Array,
        sin: jax.Array,
        mask: jax.Array,
        regime: jax.Array | None = None,
        cache: KVCache | None = None,
        cache_index: jax.Array | int | None = None,
    ) -> tuple[jax.Array, KVCache | None]:
        """x [B, T, E] -> final hidden states [B, T, E] (after the norm) and the updated cache."""
        x = axes.constrain(x, _ACT)

        def run(layer, x, kv):
            return layer(x, cos, sin, mask, regime, kv, cache_index)

        if self.cfg.scan_layers:
            graphdef, state = nnx.split(self.layers)

            def body(x, xs):
                st, kv = xs
                return remat(lambda x, st, kv: run(nnx.merge(graphdef, st), x, kv), self.cfg.remat)(x, st, kv)

            x, cache = jax.lax.scan(body, x, (state, cache))
        else:
            new = []
            for i, layer in enumerate(self.layers):
                kv = None if cache is None else (cache[0][i], cache[1][i])
                x, kv = remat(lambda x, kv, layer=layer: run(layer, x, kv), self.cfg.remat)(x, kv)
                new.append(kv)
            if cache is not None:
                cache = (jnp.stack([k for k, _ in new]), jnp.stack([v for _, v in new]))
        return self.norm(x), cache
