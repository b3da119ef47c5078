"""KV-cached sampling: one jitted program per call: prefill, then a `lax.while_loop` decode over the cache.

Padding: left padding is the native layout (as HF's batched generation); right- or mixed-padded prompts are
left-aligned inside the prefill (a stable sort of each row by its mask), so any padding works. During decode
the M-RoPE positions continue from the last prompt position, + 1 per step on all three axes (HF's rule).

`generate(model, ...)` is the one-off call. `Sampler(model)` is the same for repeated calls on one model
(an actor's control loop): it walks the model's graph once, then each call reads the current weights from
the model's own variables (so in-place updates — optimizer steps, `nnx.update`, `load_hf` — are seen) and
runs a compiled program cached per graph and input shapes; the per-call Python work is a few dozen
microseconds instead of a graph traversal and a hash of the graph.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
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


def _prefill(model: Qwen2_5_VLModel, ids, mask, pv, pvv, spg, regime, *, igrid, vgrid, max_new):
    """The prompt through the model, filling a [L, B, T + max_new, K, D] cache; logits of the last token."""
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
    model: Qwen2_5_VLModel,
    logits,
    cache,
    pos,
    kv_valid,
    regime,
    rng,
    temperature,
    top_p,
    constraint,
    *,
    prompt_len,
    max_new,
    greedy,
    stop_ids,
    pad_id,
):
    """Sample, feed back, repeat until every row has stopped or `max_new` tokens are out."""
    B = logits.shape[0]
    S = kv_valid.shape[1]
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
    *_, out, lengths = jax.lax.while_loop(cond, body, init)
    return out, lengths


def _program(
    graphdef,
    paths,
    weights,
    ids,
    mask,
    pv,
    pvv,
    spg,
    regime,
    rng,
    temperature,
    top_p,
    c_leaves,
    *,
    igrid,
    vgrid,
    max_new,
    greedy,
    stop_ids,
    pad_id,
    c_static,
):
    model: Qwen2_5_VLModel = nnx.merge(graphdef, nnx.from_flat_state(list(zip(paths, weights, strict=True))))
    constraint = None
    if c_static is not None:
        kind, payload = c_static
        constraint = jax.tree.unflatten(payload, c_leaves) if kind == "tree" else payload
    logits, cache, pos, kv_valid = _prefill(
        model, ids, mask, pv, pvv, spg, regime, igrid=igrid, vgrid=vgrid, max_new=max_new
    )
    return _decode_loop(
        model,
        logits,
        cache,
        pos,
        kv_valid,
        regime,
        rng,
        temperature,
        top_p,
        constraint,
        prompt_len=ids.shape[1],
        max_new=max_new,
        greedy=greedy,
        stop_ids=stop_ids,
        pad_id=pad_id,
    )


_STATIC = ("igrid", "vgrid", "max_new", "greedy", "stop_ids", "pad_id", "c_static")


@functools.lru_cache(maxsize=16)
def _compiled(graphdef, paths: tuple) -> Any:
    """One jitted program per model graph (hashed once here, not on every call)."""
    return jax.jit(functools.partial(_program, graphdef, paths), static_argnames=_STATIC)


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


def as_input(x: Any, dtype: Any) -> Any:
    """``x`` as ``dtype``, where it already is: a device array stays on its device, anything else becomes a
    numpy array (a jitted call moves all of its host arguments in one go, cheaper than one by one)."""
    if isinstance(x, jax.Array):
        return x if x.dtype == dtype else x.astype(dtype)
    return np.asarray(x, dtype)


class Sampler:
    """`generate` for repeated calls on one model: ``Sampler(model)(input_ids, ...)`` takes `generate`'s
    arguments after the model.

    Weights are read from the model's variables on every call, so in-place updates are seen. The graph
    (which modules and variables there are, and the model's config) is taken once: after replacing a
    submodule or a variable object, or after `resize_token_embeddings` (it replaces the config), call
    `refresh()`; a call notices a replaced config and raises rather than run the old graph.
    """

    def __init__(self, model: Qwen2_5_VLModel):
        self.model = model
        self.refresh()

    def refresh(self) -> None:
        """Re-walk the model's graph (after structural changes)."""
        graphdef, state = nnx.split(self.model)
        paths = tuple(path for path, _ in nnx.to_flat_state(state))
        live = {path: v for path, v in nnx.iter_graph(self.model) if isinstance(v, nnx.Variable)}
        self._variables = tuple(live[p] for p in paths)
        # A variable with get-hooks or an array ref must go through get_value; plain arrays are read raw.
        self._raw = all(
            isinstance(v.get_raw_value(), jax.Array) and "on_get_value" not in v.get_metadata()
            for v in self._variables
        )
        self._config = self.model.config
        self._run = _compiled(graphdef, paths)

    def stale(self) -> bool:
        """Whether the model's config was replaced since the graph was taken (``refresh`` needed)."""
        return self.model.config is not self._config

    def weights(self) -> tuple[jax.Array, ...]:
        """The model's current weights, in the graph's order."""
        if self.stale():
            raise RuntimeError(
                "Sampler: the model's config was replaced since its graph was taken; call refresh()"
            )
        if self._raw:
            return tuple(v.get_raw_value() for v in self._variables)
        return tuple(v.get_value() for v in self._variables)

    def __call__(
        self,
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
        ids = as_input(input_ids, np.int32)
        mask = np.ones(ids.shape, np.int32) if attention_mask is None else as_input(attention_mask, np.int32)
        igrid, vgrid = as_grid(image_grid_thw, "image_grid_thw"), as_grid(video_grid_thw, "video_grid_thw")
        greedy = float(temperature) == 0.0
        if rng is None:
            if not greedy:
                raise ValueError("generate: sampling (temperature > 0) needs rng=")
            rng = jax.random.key(0)
        c_static, c_leaves = _split_constraint(constraint)
        out, lengths = self._run(
            self.weights(),
            ids,
            mask,
            pixel_values,
            pixel_values_videos,
            second_per_grid_ts,
            regime,
            rng,
            np.float32(temperature),
            np.float32(top_p),
            c_leaves,
            igrid=igrid,
            vgrid=vgrid,
            max_new=int(max_new_tokens),
            greedy=greedy,
            stop_ids=tuple(int(s) for s in stop_token_ids),
            pad_id=int(pad_token_id),
            c_static=c_static,
        )
        return GenerateOutput(out, lengths)


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
    `init(B) -> state`, `mask(state) -> bool [B, V]` (allowed tokens), `update(state, token) -> state`.
    For many calls on one model, keep a `Sampler` (same arguments, without the model)."""
    return Sampler(model)(
        input_ids,
        attention_mask,
        pixel_values=pixel_values,
        image_grid_thw=image_grid_thw,
        pixel_values_videos=pixel_values_videos,
        video_grid_thw=video_grid_thw,
        second_per_grid_ts=second_per_grid_ts,
        regime=regime,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        stop_token_ids=stop_token_ids,
        rng=rng,
        constraint=constraint,
        pad_token_id=pad_token_id,
    )
