"""KV-cached sampling: a jitted prefill, then a jitted `lax.while_loop` decode over a donated cache.

Padding: left padding is the native layout (as HF's batched generation); right- or mixed-padded prompts are
left-aligned inside the prefill (a stable sort of each row by its mask), so any padding works. During decode
the M-RoPE positions continue from the last prompt position, + 1 per step on all three axes (HF's rule).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from histeve_jax.models.qwen2_5_vl.model import Qwen2_5_VLModel
from histeve_jax.models.qwen2_5_vl.rope import as_grid


class GenerateOutput(NamedTuple):
    tokens: jax.Array  # [B, max_new_tokens], `pad_token_id` after a row stops
    lengths: jax.Array  # [B] tokens generated per row, its stop token included


def sample_token(
    logits: jax.Array,
    rng: jax.Array | None,
    temperature: jax.Array | float,
    top_p: jax.Array | float,
    greedy: bool,
) -> jax.Array:
    """Greedy argmax, or temperature + nucleus (top-p) sampling; logits [B, V] float32."""
    if greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    lg = logits / jnp.maximum(temperature, 1e-6)
    order = jnp.argsort(-lg, axis=-1)
    sorted_lg = jnp.take_along_axis(lg, order, axis=-1)
    probs = jax.nn.softmax(sorted_lg, axis=-1)
    # Drop a token when the mass before it already reaches top_p; the most likely token always stays.
    drop = (jnp.cumsum(probs, axis=-1) - probs) >= top_p
    drop = drop.at[:, 0].set(False)
    sorted_lg = jnp.where(drop, -jnp.inf, sorted_lg)
    choice = jax.random.categorical(rng, sorted_lg, axis=-1)
    return jnp.take_along_axis(order, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)


def _left_align(ids: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    order = jnp.argsort(mask.astype(jnp.int32), axis=-1, stable=True)  # pads first, tokens keep their order
    return jnp.take_along_axis(ids, order, -1), jnp.take_along_axis(mask, order, -1)


@functools.partial(jax.jit, static_argnames=("graphdef", "igrid", "vgrid", "max_new"))
def _prefill(graphdef, state, ids, mask, pv, pvv, spg, regime, *, igrid, vgrid, max_new):
    model: Qwen2_5_VLModel = nnx.merge(graphdef, state)
    cfg = model.config
    ids, mask = _left_align(ids, mask)
    B, T = ids.shape
    S = T + max_new
    x = model.embed(ids, pixel_values=pv, image_grid_thw=igrid, pixel_values_videos=pvv, video_grid_thw=vgrid)
    pos, _ = model.position_ids(ids, mask, igrid, vgrid, spg)
    t = cfg.text
    shape = (t.num_hidden_layers, B, S, t.num_key_value_heads, t.head_dim)
    cache = (jnp.zeros(shape, cfg.dtype), jnp.zeros(shape, cfg.dtype))
    kv_valid = jnp.concatenate([mask.astype(bool), jnp.ones((B, max_new), bool)], axis=1)  # [B, S]
    causal = jnp.arange(S)[None, :] <= jnp.arange(T)[:, None]  # [T, S]
    h, cache = model.decode(
        x, pos, causal[None] & kv_valid[:, None], regime=regime, cache=cache, cache_index=0
    )
    logits = model.logits(h[:, -1]).astype(jnp.float32)
    return logits, cache, pos[:, :, -1] + 1, kv_valid


def _decode_loop(
    graphdef,
    state,
    logits,
    cache,
    pos,
    kv_valid,
    regime,
    rng,
    temperature,
    top_p,
    c_leaves,
    *,
    prompt_len,
    max_new,
    greedy,
    stop_ids,
    pad_id,
    c_static,
):
    model: Qwen2_5_VLModel = nnx.merge(graphdef, state)
    B = logits.shape[0]
    S = kv_valid.shape[1]
    constraint = None
    if c_static is not None:
        kind, payload = c_static
        constraint = jax.tree.unflatten(payload, c_leaves) if kind == "tree" else payload
    cstate = constraint.init(B) if constraint is not None else ()
    stop = jnp.asarray(stop_ids if stop_ids else (-1,), jnp.int32)

    def cond(c):
        i, *_, done, _, _ = c
        return (i < max_new) & ~jnp.all(done)

    def body(c):
        i, logits, cache, pos, cstate, rng, done, out, lengths = c
        if constraint is not None:
            logits = jnp.where(constraint.mask(cstate), logits, -jnp.inf)
        rng, sub = jax.random.split(rng)
        tok = sample_token(logits, sub, temperature, top_p, greedy)
        tok = jnp.where(done, pad_id, tok)
        out = jax.lax.dynamic_update_slice(out, tok[:, None], (0, i))
        lengths = lengths + (~done).astype(jnp.int32)
        if constraint is not None:
            cstate = constraint.update(cstate, tok)
        done = done | jnp.isin(tok, stop)
        slot = prompt_len + i
        mask = (kv_valid & (jnp.arange(S)[None, :] <= slot))[:, None, :]  # [B, 1, S]
        x = model.language_model.embed_tokens(tok[:, None])
        h, cache = model.decode(x, pos[:, :, None], mask, regime=regime, cache=cache, cache_index=slot)
        logits = model.logits(h[:, 0]).astype(jnp.float32)
        return i + 1, logits, cache, pos + 1, cstate, rng, done, out, lengths

    init = (
        jnp.int32(0),
        logits,
        cache,
        pos,
        cstate,
        rng,
        jnp.zeros((B,), bool),
        jnp.full((B, max_new), pad_id, jnp.int32),
        jnp.zeros((B,), jnp.int32),
    )
    _, _, cache, *_, out, lengths = jax.lax.while_loop(cond, body, init)
    # Returning the cache lets XLA alias it to the donated input: the loop writes the prefill's buffer.
    return out, lengths, cache


_STATIC = ("graphdef", "prompt_len", "max_new", "greedy", "stop_ids", "pad_id", "c_static")
# The prefilled cache is donated: the loop updates it in place.
_decode = jax.jit(_decode_loop, static_argnames=_STATIC, donate_argnums=(3,))


def _split_constraint(constraint: Any) -> tuple[Any, list]:
    """Array leaves travel traced; the rest of the constraint (its class, config) is static."""
    if constraint is None:
        return None, []
    leaves, treedef = jax.tree.flatten(constraint)
    if leaves and all(isinstance(x, (jax.Array, jnp.ndarray)) or hasattr(x, "__array__") for x in leaves):
        if not (len(leaves) == 1 and leaves[0] is constraint):
            return ("tree", treedef), leaves
    try:
        hash(constraint)
    except TypeError as e:
        raise TypeError("constraint must be a pytree of arrays or a hashable object") from e
    return ("static", constraint), []


def generate(
    model: Qwen2_5_VLModel,
    input_ids: jax.Array,
    attention_mask: jax.Array | None = None,
    *,
    pixel_values: jax.Array | None = None,
    image_grid_thw: Any = None,
    pixel_values_videos: jax.Array | None = None,
    video_grid_thw: Any = None,
    second_per_grid_ts: jax.Array | None = None,
    regime: jax.Array | None = None,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    stop_token_ids: tuple[int, ...] | list[int] = (),
    rng: jax.Array | None = None,
    constraint: Any = None,
    pad_token_id: int = 0,
) -> GenerateOutput:
    """Samples `max_new_tokens` after the prompt (greedy when temperature == 0). A row ends after it emits
    one of `stop_token_ids`; its later tokens are `pad_token_id`. `constraint` (optional) has pure-jnp
    `init(B) -> state`, `mask(state) -> bool [B, V]` (allowed tokens), `update(state, token) -> state`."""
    ids = jnp.asarray(input_ids, jnp.int32)
    mask = jnp.ones_like(ids) if attention_mask is None else jnp.asarray(attention_mask, jnp.int32)
    igrid, vgrid = as_grid(image_grid_thw, "image_grid_thw"), as_grid(video_grid_thw, "video_grid_thw")
    greedy = float(temperature) == 0.0
    if rng is None:
        if not greedy:
            raise ValueError("generate: sampling (temperature > 0) needs rng=")
        rng = jax.random.key(0)
    graphdef, state = nnx.split(model)
    logits, cache, pos, kv_valid = _prefill(
        graphdef,
        state,
        ids,
        mask,
        pixel_values,
        pixel_values_videos,
        second_per_grid_ts,
        regime,
        igrid=igrid,
        vgrid=vgrid,
        max_new=max_new_tokens,
    )
    c_static, c_leaves = _split_constraint(constraint)
    out, lengths, _ = _decode(
        graphdef,
        state,
        logits,
        cache,
        pos,
        kv_valid,
        regime,
        rng,
        jnp.float32(temperature),
        jnp.float32(top_p),
        c_leaves,
        prompt_len=ids.shape[1],
        max_new=max_new_tokens,
        greedy=greedy,
        stop_ids=tuple(int(s) for s in stop_token_ids),
        pad_id=int(pad_token_id),
        c_static=c_static,
    )
    return GenerateOutput(out, lengths)
