"""KV-cached sampling: one jitted program per call: prefill, then a `lax.while_loop` decode over the cache.

Padding: left padding is the native layout (as HF's batched generation); right- or mixed-padded prompts are
left-aligned inside the prefill (a stable sort of each row by its mask), so any padding works. During decode
the M-RoPE positions continue from the last prompt position, + 1 per step on all three axes (HF's rule).

`Sampler(model)` is the object a caller creates and keeps (the Flax gemma example's shape): it walks the
model's graph once, then each call reads the current weights from the model's own variables (so in-place
updates — optimizer steps, `nnx.update` on a weight sync, `load_hf` — are seen) and runs a program
compiled per graph and input shapes. `generate(model, ...)` is a one-off `Sampler(model)(...)`. What to
sample is one `SamplingOptions`; the decode loop carries one `_SamplingState`.

Each sampled token comes with its log-probability under the distribution it was drawn from: the logits
masked by the constraint, divided by the temperature and restricted to the nucleus (greedy: the masked
logits at temperature 1). RL's behaviour log-probabilities are exactly these.
"""

from __future__ import annotations

import dataclasses
import functools
import weakref
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from histeve_jax.models.qwen2_5_vl.model import Qwen2_5_VLModel
from histeve_jax.models.qwen2_5_vl.rope import as_grid


@dataclasses.dataclass(frozen=True)
class SamplingOptions:
    """What to sample: ``max_new_tokens`` after the prompt, greedy when ``temperature == 0``, else
    temperature + nucleus (``top_p``). A row ends after one of ``stop_token_ids``; later tokens are
    ``pad_token_id``."""

    max_new_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    stop_token_ids: tuple[int, ...] = ()
    pad_token_id: int = 0

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError(f"SamplingOptions.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0 or not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingOptions: temperature {self.temperature} must be >= 0 and top_p "
                             f"{self.top_p} in (0, 1]")
        object.__setattr__(self, "stop_token_ids", tuple(int(s) for s in self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return float(self.temperature) == 0.0


class GenerateOutput(NamedTuple):
    tokens: jax.Array  # [B, max_new_tokens], `pad_token_id` after a row stops
    lengths: jax.Array  # [B] tokens generated per row, its stop token included
    logprobs: jax.Array  # [B, max_new_tokens] float32 log-probability of each sampled token; 0 after a stop


class _Prompt(NamedTuple):
    """The traced inputs of one call (None where absent)."""

    input_ids: Any
    attention_mask: Any
    pixel_values: Any
    pixel_values_videos: Any
    second_per_grid_ts: Any
    regime: Any


@dataclasses.dataclass(frozen=True)
class _Static:
    """What the program is compiled for, besides the graph and the input shapes."""

    image_grid: tuple | None
    video_grid: tuple | None
    max_new: int
    greedy: bool
    stop_ids: tuple[int, ...]
    pad_id: int
    constraint: Any  # None, ("tree", treedef) or ("static", constraint)
    unstack: bool  # run the decoder over separate layer weights (`layer_weights`) with a per-layer cache


class _SamplingState(NamedTuple):
    """The decode loop's carry."""

    step: jax.Array  # tokens sampled so far
    logits: jax.Array  # [B, V] float32, of the next token
    cache: Any  # the decoder's KVCache: per layer (k, v) [B, K, S, D], or stacked [L, B, K, S, D]
    positions: jax.Array  # [3, B] M-RoPE position of the next token
    constraint_state: Any
    rng: jax.Array
    done: jax.Array  # [B] bool
    tokens: jax.Array  # [B, max_new] int32
    logprobs: jax.Array  # [B, max_new] float32
    lengths: jax.Array  # [B] int32


def sample_token(
    logits: jax.Array,
    rng: jax.Array | None,
    temperature: jax.Array | float,
    top_p: jax.Array | float,
    greedy: bool,
) -> tuple[jax.Array, jax.Array]:
    """(token [B] int32, its log-probability [B]): greedy argmax, or temperature + nucleus (top-p) sampling;
    logits [B, V] float32 (-inf where not allowed)."""
    if greedy:
        tok = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        # The argmax's log-probability is its logit minus the log-normaliser: no [B, V] log-softmax.
        return tok, jnp.max(logits, axis=-1) - jax.nn.logsumexp(logits, axis=-1)
    lg = logits / jnp.maximum(temperature, 1e-6)
    order = jnp.argsort(-lg, axis=-1)
    sorted_lg = jnp.take_along_axis(lg, order, axis=-1)
    probs = jax.nn.softmax(sorted_lg, axis=-1)
    # Drop a token when the mass before it already reaches top_p; the most likely token always stays.
    drop = (jnp.cumsum(probs, axis=-1) - probs) >= top_p
    drop = drop.at[:, 0].set(False)
    sorted_lg = jnp.where(drop, -jnp.inf, sorted_lg)
    choice = jax.random.categorical(rng, sorted_lg, axis=-1)
    logp = jnp.take_along_axis(jax.nn.log_softmax(sorted_lg, axis=-1), choice[:, None], axis=-1)[:, 0]
    return jnp.take_along_axis(order, choice[:, None], axis=-1)[:, 0].astype(jnp.int32), logp


def _left_align(ids: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    order = jnp.argsort(mask.astype(jnp.int32), axis=-1, stable=True)  # pads first, tokens keep their order
    return jnp.take_along_axis(ids, order, -1), jnp.take_along_axis(mask, order, -1)


def _prefill(model: Qwen2_5_VLModel, prompt: _Prompt, layers, static: _Static):
    """The prompt through the model, filling a cache of T + max_new positions; logits of the last token."""
    ids, mask = _left_align(prompt.input_ids, prompt.attention_mask)
    B, T = ids.shape
    S = T + static.max_new
    igrid, vgrid = static.image_grid, static.video_grid
    x = model.embed(ids, pixel_values=prompt.pixel_values, image_grid_thw=igrid,
                    pixel_values_videos=prompt.pixel_values_videos, video_grid_thw=vgrid)
    pos, _ = model.position_ids(ids, mask, igrid, vgrid, prompt.second_per_grid_ts)
    cache = model.language_model.init_cache(B, S, per_layer=layers is not None)
    kv_valid = jnp.concatenate([mask.astype(bool), jnp.ones((B, static.max_new), bool)], axis=1)  # [B, S]
    causal = jnp.arange(S)[None, :] <= jnp.arange(T)[:, None]  # [T, S]
    h, cache = model.decode(
        x, pos, causal[None] & kv_valid[:, None], regime=prompt.regime, cache=cache, cache_index=0,
        layers=layers,
    )
    logits = model.logits(h[:, -1]).astype(jnp.float32)
    return logits, cache, pos[:, :, -1] + 1, kv_valid


def _decode_loop(model, layers, state: _SamplingState, kv_valid, prompt: _Prompt, temperature, top_p,
                 constraint, static: _Static) -> _SamplingState:
    """Sample, feed back, repeat until every row has stopped or ``max_new`` tokens are out."""
    S = kv_valid.shape[1]
    prompt_len = prompt.input_ids.shape[1]
    stop = jnp.asarray(static.stop_ids or (-1,), jnp.int32)

    def cond(s: _SamplingState) -> jax.Array:
        return (s.step < static.max_new) & ~jnp.all(s.done)

    def body(s: _SamplingState) -> _SamplingState:
        logits, cstate = s.logits, s.constraint_state
        if constraint is not None:
            logits = jnp.where(constraint.mask(cstate), logits, -jnp.inf)
        rng, sub = jax.random.split(s.rng)
        tok, logp = sample_token(logits, sub, temperature, top_p, static.greedy)
        tok = jnp.where(s.done, static.pad_id, tok)
        logp = jnp.where(s.done, 0.0, logp)
        tokens = jax.lax.dynamic_update_slice(s.tokens, tok[:, None], (0, s.step))
        logprobs = jax.lax.dynamic_update_slice(s.logprobs, logp[:, None], (0, s.step))
        lengths = s.lengths + (~s.done).astype(jnp.int32)
        if constraint is not None:
            cstate = constraint.update(cstate, tok)
        done = s.done | jnp.isin(tok, stop)
        slot = prompt_len + s.step
        mask = (kv_valid & (jnp.arange(S)[None, :] <= slot))[:, None, :]  # [B, 1, S]
        x = model.language_model.embed_tokens(tok[:, None])
        h, cache = model.decode(x, s.positions[:, :, None], mask, regime=prompt.regime, cache=s.cache,
                                cache_index=slot, layers=layers)
        logits = model.logits(h[:, 0]).astype(jnp.float32)
        return _SamplingState(s.step + 1, logits, cache, s.positions + 1, cstate, rng, done, tokens, logprobs,
                              lengths)

    return jax.lax.while_loop(cond, body, state)


def _program(graphdef, paths, layer_def, layer_paths, weights, layer_weights, prompt: _Prompt, rng,
             temperature, top_p, c_leaves, *, static: _Static) -> GenerateOutput:
    model: Qwen2_5_VLModel = nnx.merge(graphdef, nnx.from_flat_state(list(zip(paths, weights, strict=True))))
    constraint = None
    if static.constraint is not None:
        kind, payload = static.constraint
        constraint = jax.tree.unflatten(payload, c_leaves) if kind == "tree" else payload
    # Unrolled layers are split before the loop (or arrive split, `layer_weights`), not inside each step.
    layers = None
    if static.unstack:
        layers = [nnx.merge(layer_def, nnx.from_flat_state(list(zip(layer_paths, w, strict=True))))
                  for w in layer_weights]
    elif model.language_model.unrolled():
        layers = model.language_model.split_layers()
    logits, cache, pos, kv_valid = _prefill(model, prompt, layers, static)
    B, N = logits.shape[0], static.max_new
    init = _SamplingState(
        step=jnp.int32(0), logits=logits, cache=cache, positions=pos,
        constraint_state=constraint.init(B) if constraint is not None else (), rng=rng,
        done=jnp.zeros((B,), bool), tokens=jnp.full((B, N), static.pad_id, jnp.int32),
        logprobs=jnp.zeros((B, N), jnp.float32), lengths=jnp.zeros((B,), jnp.int32),
    )
    final = _decode_loop(model, layers, init, kv_valid, prompt, temperature, top_p, constraint, static)
    return GenerateOutput(final.tokens, final.lengths, final.logprobs)


@functools.lru_cache(maxsize=16)
def _compiled(graphdef, paths: tuple, layer_def, layer_paths: tuple) -> Any:
    """One jitted program per model graph (hashed once here, not on every call)."""
    return jax.jit(functools.partial(_program, graphdef, paths, layer_def, layer_paths),
                   static_argnames=("static",))


@functools.lru_cache(maxsize=16)
def _unstacker(n_layers: int) -> Any:
    """Stacked [L, ...] weights -> L tuples of per-layer arrays, one jitted copy."""
    return jax.jit(lambda stacked: tuple(tuple(a[i] for a in stacked) for i in range(n_layers)))


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
    """Sampling for repeated calls on one model: ``Sampler(model)(input_ids, mask, options=..., ...)``.

    Weights are read from the model's variables on every call, so in-place updates are seen. The graph
    (which modules and variables there are, and the model's config) is taken once: after replacing a
    submodule or a variable object, or after `resize_token_embeddings` (it replaces the config), call
    `refresh()`; a call notices a replaced config and raises rather than run the old graph.

    ``unstack_layers`` (default: where the model's stacked layers run unrolled, i.e. on the CPU) keeps
    per-layer copies of the stacked weights, made once per weight version, so that no call copies them
    again; else a call that runs the layers unrolled splits the stacks once, before its decode loop.
    """

    def __init__(self, model: Qwen2_5_VLModel, unstack_layers: bool | None = None):
        self.model = model
        self.unstack_layers = unstack_layers
        self.refresh()

    def refresh(self) -> None:
        """Re-walk the model's graph (after structural changes)."""
        graphdef, state = nnx.split(self.model)
        paths = tuple(path for path, _ in nnx.to_flat_state(state))
        layer_def, layer_state = nnx.split(self.model.language_model.layers)
        layer_paths = tuple(path for path, _ in nnx.to_flat_state(layer_state))
        self._layer_index = tuple(paths.index(("language_model", "layers", *p)) for p in layer_paths)
        self._unstacked: tuple | None = None  # (weak refs to the stacked arrays, their per-layer copies)
        live = {path: v for path, v in nnx.iter_graph(self.model) if isinstance(v, nnx.Variable)}
        self._variables = tuple(live[p] for p in paths)
        # A variable with get-hooks or an array ref must go through get_value; plain arrays are read raw.
        self._raw = all(
            isinstance(v.get_raw_value(), jax.Array) and "on_get_value" not in v.get_metadata()
            for v in self._variables
        )
        self._config = self.model.config
        self._run = _compiled(graphdef, paths, layer_def, layer_paths)

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

    def _layer_weights(self, weights: tuple) -> tuple:
        """Per-layer copies of the stacked layer weights, remade only when one of those arrays is replaced."""
        stacked = tuple(weights[i] for i in self._layer_index)
        kept = self._unstacked
        if kept is None or any(ref() is not a for ref, a in zip(kept[0], stacked, strict=True)):
            n = self._config.text.num_hidden_layers
            self._unstacked = kept = (tuple(weakref.ref(a) for a in stacked), _unstacker(n)(stacked))
        return kept[1]

    def __call__(
        self,
        input_ids: jax.Array,
        attention_mask: jax.Array | None = None,
        *,
        options: SamplingOptions,
        pixel_values: jax.Array | None = None,
        image_grid_thw: Any = None,
        pixel_values_videos: jax.Array | None = None,
        video_grid_thw: Any = None,
        second_per_grid_ts: jax.Array | None = None,
        regime: jax.Array | None = None,
        rng: jax.Array | None = None,
        constraint: Any = None,
    ) -> GenerateOutput:
        """Sample after [B, T] prompts (inputs as the HF processor produces them; ``regime`` [B] selects the
        RS-Norm row). ``constraint`` (optional) has pure-jnp ``init(B) -> state``, ``mask(state) -> bool
        [B, V]`` (allowed tokens) and ``update(state, token) -> state``."""
        ids = as_input(input_ids, np.int32)
        mask = np.ones(ids.shape, np.int32) if attention_mask is None else as_input(attention_mask, np.int32)
        if rng is None:
            if not options.greedy:
                raise ValueError("Sampler: sampling (temperature > 0) needs rng=")
            rng = jax.random.key(0)
        c_static, c_leaves = _split_constraint(constraint)
        weights = self.weights()
        unstack = self.unstack_layers
        if unstack is None:
            unstack = self.model.language_model.unrolled()
        unstack = bool(unstack) and self._config.scan_layers
        static = _Static(
            image_grid=as_grid(image_grid_thw, "image_grid_thw"),
            video_grid=as_grid(video_grid_thw, "video_grid_thw"),
            max_new=int(options.max_new_tokens), greedy=options.greedy, stop_ids=options.stop_token_ids,
            pad_id=int(options.pad_token_id), constraint=c_static, unstack=unstack,
        )
        prompt = _Prompt(ids, mask, pixel_values, pixel_values_videos, second_per_grid_ts, regime)
        layer_weights = self._layer_weights(weights) if unstack else ()
        return self._run(weights, layer_weights, prompt, rng, np.float32(options.temperature),
                         np.float32(options.top_p), c_leaves, static=static)


def generate(model: Qwen2_5_VLModel, *args: Any, **kwargs: Any) -> GenerateOutput:
    """A one-off ``Sampler(model)(*args, **kwargs)`` (see :meth:`Sampler.__call__`); keep a ``Sampler`` for
    repeated calls on one model."""
    return Sampler(model)(*args, **kwargs)
