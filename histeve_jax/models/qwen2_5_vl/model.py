"""Qwen2.5-VL for conditional generation: vision tower + text decoder + lm_head (HF
`Qwen2_5_VLForConditionalGeneration`), with inputs exactly as the HF processor produces them."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from histeve_jax.models.qwen2_5_vl.config import Qwen2_5_VLConfig
from histeve_jax.models.qwen2_5_vl.layers import param
from histeve_jax.models.qwen2_5_vl.rope import get_rope_index, mrope_cos_sin
from histeve_jax.models.qwen2_5_vl.text import KVCache, TextModel
from histeve_jax.models.qwen2_5_vl.vision import VisionTower
from histeve_jax.parallel import axes


def causal_mask(attention_mask: jax.Array | None, B: int, T: int) -> jax.Array:
    """[B, T, T] bool: causal and key not padding."""
    m = jnp.tril(jnp.ones((T, T), bool))[None]
    if attention_mask is not None:
        m = m & attention_mask.astype(bool)[:, None, :]
    return jnp.broadcast_to(m, (B, T, T))


def _scatter_rows(x_bte: jax.Array, is_tok: jax.Array, rows: jax.Array, name: str) -> jax.Array:
    """Replace the embeddings at `is_tok` (in flattened batch order) by `rows` (HF's masked_scatter)."""
    B, T, E = x_bte.shape
    flat = is_tok.reshape(-1)
    if not isinstance(flat, jax.core.Tracer):
        n_tok = int(np.asarray(flat).sum())
        if n_tok != rows.shape[0]:
            raise ValueError(f"{name}: {n_tok} placeholder tokens in input_ids but {rows.shape[0]} features")
    idx = jnp.clip(jnp.cumsum(flat) - 1, 0, rows.shape[0] - 1)
    out = jnp.where(flat[:, None], rows.astype(x_bte.dtype)[idx], x_bte.reshape(-1, E))
    return out.reshape(B, T, E)


class Qwen2_5_VLModel(nnx.Module):
    """The full model. `model(input_ids, ...) -> logits [B, T, V]`."""

    def __init__(self, config: Qwen2_5_VLConfig, *, rngs: nnx.Rngs):
        self.config = config
        self.visual = VisionTower(config, rngs=rngs)
        self.language_model = TextModel(config, rngs=rngs)
        if not config.tie_word_embeddings:
            t = config.text
            self.lm_head = param(
                rngs, (t.hidden_size, t.vocab_size), (axes.EMBED, axes.VOCAB), config.param_dtype
            )

    # ------------------------------------------------------------------ pieces

    def get_image_features(self, pixel_values: jax.Array, grid_thw: object) -> jax.Array:
        """Vision tower output for all images, concatenated: [sum(t*h*w) / merge^2, E]."""
        return self.visual(pixel_values, grid_thw)

    def embed(
        self,
        input_ids: jax.Array,
        *,
        pixel_values: jax.Array | None = None,
        image_grid_thw: object = None,
        pixel_values_videos: jax.Array | None = None,
        video_grid_thw: object = None,
        image_embeds: jax.Array | None = None,
        video_embeds: jax.Array | None = None,
    ) -> jax.Array:
        """Token embeddings with image/video placeholder rows replaced by vision features [B, T, E].
        `image_embeds`/`video_embeds` (precomputed `get_image_features`) skip the vision tower."""
        cfg = self.config
        x = self.language_model.embed_tokens(input_ids)
        if image_embeds is None and pixel_values is not None:
            image_embeds = self.visual(pixel_values, image_grid_thw)
        if image_embeds is not None:
            x = _scatter_rows(x, input_ids == cfg.image_token_id, image_embeds, "image")
        if video_embeds is None and pixel_values_videos is not None:
            video_embeds = self.visual(pixel_values_videos, video_grid_thw)
        if video_embeds is not None:
            x = _scatter_rows(x, input_ids == cfg.video_token_id, video_embeds, "video")
        return x

    def position_ids(
        self,
        input_ids: jax.Array,
        attention_mask: jax.Array | None = None,
        image_grid_thw: object = None,
        video_grid_thw: object = None,
        second_per_grid_ts: jax.Array | None = None,
    ) -> tuple[jax.Array, jax.Array]:
        """M-RoPE positions [3, B, T] and rope deltas [B, 1] (port of HF `get_rope_index`)."""
        return get_rope_index(
            self.config, input_ids, attention_mask, image_grid_thw, video_grid_thw, second_per_grid_ts
        )

    def rope(self, position_ids: jax.Array) -> tuple[jax.Array, jax.Array]:
        t = self.config.text
        return mrope_cos_sin(position_ids, t.head_dim, t.rope_theta, t.mrope_section, self.config.dtype)

    def logits(self, hidden: jax.Array) -> jax.Array:
        """lm_head (or the tied embedding) applied to final hidden states."""
        if self.config.tie_word_embeddings:
            w = self.language_model.embed[...].astype(self.config.dtype).T
        else:
            w = self.lm_head[...].astype(self.config.dtype)
        out = hidden @ w
        return axes.constrain(out, (axes.ACT_BATCH, axes.ACT_LENGTH, axes.ACT_VOCAB)[-out.ndim :])

    def decode(
        self,
        inputs_embeds: jax.Array,
        position_ids: jax.Array,
        mask: jax.Array,
        *,
        regime: jax.Array | None = None,
        cache: KVCache | None = None,
        cache_index: jax.Array | int | None = None,
        layers: list | None = None,
    ) -> tuple[jax.Array, KVCache | None]:
        """The decoder on embeddings with explicit positions [3, B, T] and a bool mask [B, T, S]; `layers`
        (separate `DecoderLayer`s) unrolls it over their weights."""
        cos, sin = self.rope(position_ids)
        return self.language_model(inputs_embeds, cos, sin, mask, regime, cache, cache_index, layers)

    # ------------------------------------------------------------------ forward

    def hidden_states(
        self,
        input_ids: jax.Array,
        *,
        attention_mask: jax.Array | None = None,
        pixel_values: jax.Array | None = None,
        image_grid_thw: object = None,
        pixel_values_videos: jax.Array | None = None,
        video_grid_thw: object = None,
        second_per_grid_ts: jax.Array | None = None,
        position_ids: jax.Array | None = None,
        inputs_embeds: jax.Array | None = None,
        image_embeds: jax.Array | None = None,
        video_embeds: jax.Array | None = None,
        regime: jax.Array | None = None,
    ) -> jax.Array:
        """Final hidden states [B, T, E] (after the final norm)."""
        B, T = input_ids.shape
        if inputs_embeds is None:
            inputs_embeds = self.embed(
                input_ids,
                pixel_values=pixel_values,
                image_grid_thw=image_grid_thw,
                pixel_values_videos=pixel_values_videos,
                video_grid_thw=video_grid_thw,
                image_embeds=image_embeds,
                video_embeds=video_embeds,
            )
        if position_ids is None:
            position_ids, _ = self.position_ids(
                input_ids, attention_mask, image_grid_thw, video_grid_thw, second_per_grid_ts
            )
        h, _ = self.decode(inputs_embeds, position_ids, causal_mask(attention_mask, B, T), regime=regime)
        return h

    def __call__(self, input_ids: jax.Array, *, return_hidden: bool = False, **kw) -> jax.Array:
        """Logits [B, T, V]; keyword arguments as `hidden_states`. `return_hidden=True` also returns them."""
        h = self.hidden_states(input_ids, **kw)
        logits = self.logits(h)
        return (logits, h) if return_hidden else logits
