"""The detector module: the port's text decoder with cross-attention blocks to the policy's hidden states.

``Detector`` holds a ``qwen2_5_vl.text.TextModel`` (the port's embedding, stacked ``DecoderLayer``s and final
norm: the 3B's code, not a copy) and, when ``cross_attention_every = n > 0``, one ``CrossAttention`` block
after every n-th layer: ``Z + MHA(Norm(Z), H, H)`` with ``H`` the policy's final-layer hidden states of its
prompt (projected to the detector's width where the widths differ). The layers run as a scan over groups of
n layers, each group a scan over its layers, then its cross-attention block. The image placeholder rows of
the detector's prompt take the policy's image embeddings (projected alike). The final token's hidden state
goes to two logits.

Norm is the port's RMSNorm (Qwen's "LN"). The output projection of each cross-attention block starts at
zero, so at initialisation the detector computes exactly the pruned backbone and the blocks open as they
learn (the zero-init residual of ControlNet/Flamingo-style adapters); their q/k/v start random.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from histeve_jax.detector.config import NUM_CLASSES, DetectorConfig
from histeve_jax.models.qwen2_5_vl.layers import RMSNorm, attention, param, remat, zeros_init
from histeve_jax.models.qwen2_5_vl.model import _scatter_rows, causal_mask
from histeve_jax.models.qwen2_5_vl.rope import get_rope_index, mrope_cos_sin
from histeve_jax.models.qwen2_5_vl.text import TextModel
from histeve_jax.parallel import axes

_ACT = (axes.ACT_BATCH, axes.ACT_LENGTH, axes.ACT_EMBED)


class CrossAttention(nnx.Module):
    """``z + MHA(RMSNorm(z), h, h)``: multi-head attention (the decoder's head count, no RoPE: the policy's
    states already carry their positions) from the detector's tokens to the policy's."""

    def __init__(self, cfg: DetectorConfig, *, rngs: nnx.Rngs):
        t = cfg.base.text
        E, H, D = t.hidden_size, t.num_attention_heads, t.head_dim
        pd = cfg.base.param_dtype
        self.dtype = cfg.base.dtype
        self.norm = RMSNorm(E, t.rms_norm_eps, param_dtype=pd, rngs=rngs)
        names = (axes.EMBED, axes.Q_HEADS, axes.HEAD_DIM)
        self.q = param(rngs, (E, H, D), names, pd)
        self.k = param(rngs, (E, H, D), names, pd)
        self.v = param(rngs, (E, H, D), names, pd)
        self.o = param(rngs, (H, D, E), (axes.Q_HEADS, axes.HEAD_DIM, axes.EMBED), pd, zeros_init)
        self.scale = D**-0.5

    def __call__(self, z: jax.Array, context: jax.Array, context_mask: jax.Array) -> jax.Array:
        """z [B, T, E], context [B, S, E], context_mask [B, S] (True = a real token) -> [B, T, E]."""
        c = lambda p: p[...].astype(self.dtype)
        x = self.norm(z)
        q = jnp.einsum("bte,ehd->bthd", x, c(self.q))
        k = jnp.einsum("bse,ehd->bshd", context, c(self.k))
        v = jnp.einsum("bse,ehd->bshd", context, c(self.v))
        o = attention(q, k, v, context_mask.astype(bool)[:, None, :], self.scale)
        return axes.constrain(z + jnp.einsum("bthd,hde->bte", o, c(self.o)), _ACT)


def last_token(h: jax.Array, attention_mask: jax.Array) -> jax.Array:
    """h [B, T, E] at each row's last real token (left or right padding) -> [B, E]."""
    T = h.shape[1]
    last = T - 1 - jnp.argmax(attention_mask[:, ::-1].astype(bool), axis=1)
    return jnp.take_along_axis(h, last[:, None, None], axis=1)[:, 0]


class Detector(nnx.Module):
    """``detector(input_ids, attention_mask, image_embeds, context, context_mask) -> logits [B, 2]``."""

    def __init__(self, config: DetectorConfig, *, rngs: nnx.Rngs):
        self.config = config
        base = config.base.replace(scan_layers=True)
        self.language_model = TextModel(base, rngs=rngs)
        E, Ep, pd = config.hidden_size, config.policy_hidden_size, base.param_dtype
        if config.num_groups:

            @nnx.split_rngs(splits=config.num_groups)
            @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: axes.LAYERS})
            def make(r):
                return CrossAttention(config, rngs=r)

            self.cross = make(rngs)
        if config.projects:
            # [policy width, detector width]: the input axis takes the `mlp` rules (as the merger's fc1).
            self.image_proj = param(rngs, (Ep, E), (axes.MLP, axes.EMBED), pd, _fan_in(Ep))
            if config.num_groups:
                self.context_proj = param(rngs, (Ep, E), (axes.MLP, axes.EMBED), pd, _fan_in(Ep))
        self.head = param(rngs, (E, NUM_CLASSES), (axes.EMBED, None), pd)
        self.head_bias = param(rngs, (NUM_CLASSES,), (axes.NORM,), pd, zeros_init)

    def _project(self, x: jax.Array, name: str) -> jax.Array:
        dt = self.config.base.dtype
        x = x.astype(dt)
        return x @ getattr(self, name)[...].astype(dt) if self.config.projects else x

    def _decode(self, x, cos, sin, mask, context, context_mask):
        """The decoder layers, with a cross-attention block after each group (then the final norm)."""
        lm, cfg = self.language_model, self.config
        if not cfg.num_groups:
            return lm(x, cos, sin, mask)[0]
        n, G = cfg.cross_attention_every, cfg.num_groups
        layer_def, layer_state = nnx.split(lm.layers)
        layer_state = jax.tree.map(lambda a: a.reshape(G, n, *a.shape[1:]), layer_state)
        cross_def, cross_state = nnx.split(self.cross)
        policy = cfg.base.remat

        def one_layer(x, st):
            run = lambda x, st: nnx.merge(layer_def, st)(x, cos, sin, mask)[0]
            return remat(run, policy)(x, st), None

        def group(x, xs):
            st, cst = xs
            x, _ = jax.lax.scan(one_layer, x, st)
            return nnx.merge(cross_def, cst)(x, context, context_mask), None

        x, _ = jax.lax.scan(group, axes.constrain(x, _ACT), (layer_state, cross_state))
        return lm.norm(x)

    def __call__(
        self,
        input_ids: jax.Array,
        attention_mask: jax.Array,
        image_embeds: jax.Array,
        context: jax.Array | None = None,
        context_mask: jax.Array | None = None,
    ) -> jax.Array:
        """Logits [B, 2] of the detector prompt ``input_ids`` [B, T] whose images per row (``num_frames``
        frames, then any detail crops: ``DetectorConfig.image_grids``) take ``image_embeds``
        [B * image tokens per row, policy width] (row-major), attending to the policy's
        ``context`` [B, S, policy width] where ``context_mask`` [B, S] is set."""
        cfg, base = self.config, self.config.base
        B, T = input_ids.shape
        x = self.language_model.embed_tokens(input_ids)
        x = _scatter_rows(x, input_ids == base.image_token_id, self._project(image_embeds, "image_proj"),
                          "detector image")
        grid = cfg.image_grids() * B
        pos, _ = get_rope_index(base, input_ids, attention_mask, grid, None, None)
        t = base.text
        cos, sin = mrope_cos_sin(pos, t.head_dim, t.rope_theta, t.mrope_section, base.dtype)
        if cfg.num_groups:
            if context is None or context_mask is None:
                raise ValueError("Detector: cross_attention_every > 0 needs the policy's context and mask")
            context = self._project(context, "context_proj")
        h = self._decode(x, cos, sin, causal_mask(attention_mask, B, T), context, context_mask)
        z = last_token(h, attention_mask).astype(jnp.float32)
        return z @ self.head[...].astype(jnp.float32) + self.head_bias[...].astype(jnp.float32)


def _fan_in(n: int):
    """Normal init with std 1/sqrt(n): a projection that keeps the policy's per-unit scale."""
    return jax.nn.initializers.normal(1.0 / math.sqrt(n))


def parameter_count(config: DetectorConfig) -> dict[str, int]:
    """Parameters by part, by abstract evaluation (nothing allocated): the backbone (embedding, decoder
    layers, final norm), the cross-attention blocks, the projections and the head; ``total`` sums them."""
    abstract = nnx.eval_shape(lambda: Detector(config, rngs=nnx.Rngs(0)))
    parts: dict[str, int] = {"embedding": 0, "decoder_layers": 0, "final_norm": 0, "cross_attention": 0,
                             "projections": 0, "head": 0}
    for path, var in nnx.to_flat_state(nnx.state(abstract, nnx.Param)):
        n = math.prod(var.shape)
        top, second = path[0], path[1] if len(path) > 1 else ""
        if top == "language_model":
            parts[{"embed": "embedding", "layers": "decoder_layers"}.get(second, "final_norm")] += n
        elif top == "cross":
            parts["cross_attention"] += n
        elif top in ("image_proj", "context_proj"):
            parts["projections"] += n
        else:
            parts["head"] += n
    parts["backbone"] = parts["embedding"] + parts["decoder_layers"] + parts["final_norm"]
    parts["total"] = parts["backbone"] + parts["cross_attention"] + parts["projections"] + parts["head"]
    return parts
