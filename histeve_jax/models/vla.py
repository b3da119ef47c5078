"""The HiSTEVE policy: Qwen2.5-VL + RS-Norm + Dual-Mouse action-token rows; imitation loss and ``act``.

* RS-Norm: the base model is built with ``norm_regimes=2``, so each decoder layer's pre-attention and
  pre-MLP RMSNorm keep a [2, d] scale (row 0 NG, row 1 GUI) chosen per sequence by ``regime``; ``load_hf``
  copies the pretrained scale into both rows, so at initialisation the policy *is* the base model in
  either regime. Everything else is shared; the policy adds exactly 2 * L * d parameters.
* Dual-Mouse rows: the action tokens (``histeve_jax.actions.tokens``) take ids ``action_token_base ..``,
  i.e. right after the tokenizer's own ids. Qwen2.5-VL's 3B/7B tables have spare rows there (151936 /
  152064 > 151665 + 103), so nothing is resized; a smaller table grows. The action rows (embedding and
  lm_head) start at the mean of the pretrained rows plus small noise: the mean keeps the new inputs in
  the distribution the layers were trained on and gives each action token about the average logit, so
  the pretrained text distribution barely moves; the noise makes the rows distinct from the first step.

Batch (``action_loss``), as ``histeve_jax.data.pipeline.Featurize`` produces it; B samples, L padded
length, F = history_frames + 1 images per sample, P = (H/14) * (W/14) patches per image::

    input_ids       int32   [B, L]  prompt (F images, then the instruction) + action tokens + <|im_end|>
    attention_mask  int32   [B, L]  1 on real tokens
    targets         int32   [B, L]  targets[:, t] = input_ids[:, t + 1] (next-token convention)
    loss_mask       float32 [B, L]  1 where targets[:, t] is to be predicted (the assistant's reply)
    regime          int32   [B]     0 = NG, 1 = GUI (RS-Norm row)
    pixel_values    float32 [B, F * P, 1176] or [B * F * P, 1176]; absent for text-only batches
    image_grid_thw  int32   [B * F, 3] or [B, F, 3]: optional, checked when concrete; every image is
                                    (1, H/14, W/14), so the grid is static, taken from the config.

Other keys are ignored: the loss reads token kinds from the vocabulary.
"""

from __future__ import annotations

import dataclasses
import functools
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from histeve_jax.actions import grammar as G
from histeve_jax.actions.codebook import Regime, get_codebook, regime_of
from histeve_jax.actions.tokens import TOKEN_GROUPS, ActionVocab, token_strings
from histeve_jax.data.prompts import observation_messages
from histeve_jax.data.tokenizer import NUM_TOKENIZER_IDS
from histeve_jax.models.qwen2_5_vl import Qwen2_5_VLConfig, Qwen2_5_VLModel, load_hf, resize_token_embeddings
from histeve_jax.models.qwen2_5_vl import tiny as tiny_base
from histeve_jax.models.qwen2_5_vl.generate import Sampler, as_input
from histeve_jax.train.losses import grouped_accuracy, masked_cross_entropy, sequence_exact_match

METRIC_GROUPS: tuple[str, ...] = TOKEN_GROUPS + ("other",)  # "other": <|im_end|> and text targets


@dataclasses.dataclass(frozen=True)
class VLAConfig:
    """The policy: base Qwen2.5-VL shape, action codebook and token ids, and what one observation is."""

    base: Qwen2_5_VLConfig
    codebook: str = "vpt"
    # First action token id: the Qwen tokenizer's length before add_action_tokens (its own ids end there).
    action_token_base: int = NUM_TOKENIZER_IDS
    history_frames: int = 0  # frames before the current one in each prompt
    image_size: tuple[int, int] = (56, 56)  # (H, W) of every frame, multiples of 28
    max_targets: int = 16  # target positions per sample at which the loss computes logits
    row_init_noise: float = 0.02  # std of the action rows' noise, relative to the rows' per-dim std

    def __post_init__(self):
        if any(int(s) % 28 for s in self.image_size):
            raise ValueError(f"VLAConfig.image_size {self.image_size} must be multiples of 28")
        if self.max_targets < self.vocab.max_len + 1:
            raise ValueError(f"VLAConfig.max_targets={self.max_targets} < one action + <|im_end|>")

    @property
    def vocab(self) -> ActionVocab:
        return ActionVocab.contiguous(self.codebook, self.action_token_base)

    def check_tokenizer(self, tokenizer: Any) -> None:
        """Raise unless ``tokenizer`` (after ``add_action_tokens``) gives the action tokens these ids."""
        got = ActionVocab.from_tokenizer(tokenizer, self.codebook).ids
        if not np.array_equal(got, self.vocab.ids):
            raise ValueError(
                f"tokenizer action ids start at {int(got[0])}, VLAConfig.action_token_base is "
                f"{self.action_token_base}"
            )

    @property
    def vocab_size(self) -> int:
        """Rows of the policy's tables: the base's, or more if the action tokens do not fit."""
        return max(self.base.text.vocab_size, self.action_token_base + len(token_strings(self.codebook)))

    @property
    def model_config(self) -> Qwen2_5_VLConfig:
        return self.base.replace(norm_regimes=2, text={"vocab_size": self.vocab_size})

    @property
    def num_frames(self) -> int:
        return self.history_frames + 1

    @property
    def patches_per_image(self) -> int:
        return (self.image_size[0] // 14) * (self.image_size[1] // 14)

    def image_grid(self, n_images: int) -> tuple[tuple[int, int, int], ...]:
        """The (static) grid of ``n_images`` frames."""
        return ((1, self.image_size[0] // 14, self.image_size[1] // 14),) * n_images


def tiny_config(**kw: Any) -> VLAConfig:
    """The tiny random policy of tests and CPU benchmarks (vocab 320: the action rows are appended)."""
    base = kw.pop("base", None) or tiny_base()
    return VLAConfig(base=base, action_token_base=kw.pop("action_token_base", base.text.vocab_size), **kw)


def _init_rows(key: jax.Array, w_ve: jax.Array, ids: jax.Array, n_pretrained: int, noise: float) -> jax.Array:
    """``w_ve`` with rows ``ids`` set to the mean of the first ``n_pretrained`` rows plus relative noise."""
    old = w_ve[:n_pretrained].astype(jnp.float32)
    mean, std = old.mean(0), old.std(0)
    rows = mean + noise * std * jax.random.normal(key, (ids.shape[0], w_ve.shape[1]), jnp.float32)
    return w_ve.at[ids].set(rows.astype(w_ve.dtype))


def init_action_rows(model: Qwen2_5_VLModel, config: VLAConfig, key: jax.Array) -> None:
    """Initialise the action tokens' embedding (and untied lm_head) rows in place (module docstring)."""
    ids = jnp.asarray(config.vocab.ids, jnp.int32)
    n_pre = min(config.action_token_base, config.base.text.vocab_size)
    noise = config.row_init_noise
    k_embed, k_head = jax.random.split(key)
    lm = model.language_model
    w = lm.embed.get_value()
    rows = jax.jit(_init_rows, static_argnums=(3, 4), out_shardings=w.sharding)
    lm.embed.set_value(rows(k_embed, w, ids, n_pre, noise))
    if not model.config.tie_word_embeddings:
        w = model.lm_head.get_value()  # [E, V]
        cols = jax.jit(lambda k, w, i: _init_rows(k, w.T, i, n_pre, noise).T, out_shardings=w.sharding)
        model.lm_head.set_value(cols(k_head, w, ids))


class VLAPolicy(nnx.Module):
    """Qwen2.5-VL with RS-Norm and Dual-Mouse rows. ``policy.loss(batch)``, ``policy.act(...)``."""

    def __init__(
        self, config: VLAConfig, *, rngs: nnx.Rngs | None = None, model: Qwen2_5_VLModel | None = None
    ):
        self.config = config
        if model is None:
            if rngs is None:
                raise ValueError("VLAPolicy: pass rngs= (random init) or model= (a loaded base model)")
            model = Qwen2_5_VLModel(config.model_config, rngs=rngs)
        if model.config.norm_regimes != 2:
            raise ValueError(f"VLAPolicy: the model has norm_regimes={model.config.norm_regimes}, expected 2")
        if model.config.text.vocab_size != config.vocab_size:
            raise ValueError(
                f"VLAPolicy: model vocab_size {model.config.text.vocab_size} != config's {config.vocab_size}"
            )
        self.model = model

    @classmethod
    def from_pretrained(cls, path: str, config: VLAConfig, *, seed: int = 0, **load_kw: Any) -> VLAPolicy:
        """The policy at initialisation from a Hugging Face Qwen2.5-VL directory (``load_hf`` keywords)."""
        overrides = {"norm_regimes": 2, **load_kw.pop("config_overrides", {})}
        model = load_hf(path, config_overrides=overrides, **load_kw)
        if model.config.text.vocab_size != config.base.text.vocab_size:
            raise ValueError(
                f"{path}: vocab_size {model.config.text.vocab_size} != VLAConfig.base's "
                f"{config.base.text.vocab_size}"
            )
        if config.vocab_size > model.config.text.vocab_size:
            resize_token_embeddings(model, config.vocab_size)
        init_action_rows(model, config, jax.random.key(seed))
        return cls(config, model=model)

    def check_tokenizer(self, tokenizer: Any) -> None:
        """Raise unless ``tokenizer``'s action-token ids are the ones this policy was built with."""
        self.config.check_tokenizer(tokenizer)

    def loss(self, batch: Mapping[str, Any]) -> tuple[jax.Array, dict[str, jax.Array]]:
        return action_loss(self, batch)

    def act(self, *args: Any, **kw: Any) -> np.ndarray:
        """Constrained sampling of one action per row; see :func:`act`."""
        return act(self, *args, **kw)


# ------------------------------------------------------------------------------------------------ loss


def _flat_pixels(config: VLAConfig, batch: Mapping[str, Any]) -> tuple[jax.Array | None, tuple | None]:
    if batch.get("pixel_values") is None:  # text-only samples
        return None, None
    pv = batch["pixel_values"]
    pv = pv.reshape(-1, pv.shape[-1])
    n_img, rem = divmod(pv.shape[0], config.patches_per_image)
    if rem:
        raise ValueError(
            f"batch 'pixel_values': {pv.shape[0]} patches is not a multiple of {config.patches_per_image} "
            f"(image_size {config.image_size})"
        )
    grid = config.image_grid(n_img)
    given = batch.get("image_grid_thw")
    if given is not None and not isinstance(given, jax.core.Tracer):
        if not np.array_equal(np.asarray(given).reshape(-1, 3), np.asarray(grid).reshape(-1, 3)):
            raise ValueError(f"batch 'image_grid_thw' differs from the config's {grid[:1]} x {n_img}")
    return pv, grid


def action_loss(
    policy: VLAPolicy, batch: Mapping[str, Any], rng: jax.Array | None = None
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Masked cross-entropy over the target tokens and per-token-kind accuracy (pure; ``loss_fn`` form).

    Logits are computed only at the first ``config.max_targets`` target positions of each sample (the
    reply is short), not over the whole prompt; ``dropped_targets`` counts any beyond them.
    """
    del rng
    cfg = policy.config
    model = policy.model
    ids = batch["input_ids"]
    B, L = ids.shape
    pv, grid = _flat_pixels(cfg, batch)
    h = model.hidden_states(
        ids,
        attention_mask=batch["attention_mask"],
        pixel_values=pv,
        image_grid_thw=grid,
        regime=jnp.asarray(batch["regime"], jnp.int32).reshape(B),
    )
    mask = batch["loss_mask"] > 0
    K = min(cfg.max_targets, L)
    order = jnp.argsort(~mask, axis=1, stable=True)[:, :K]  # target positions first, in order
    h_k = jnp.take_along_axis(h, order[..., None], axis=1)
    labels = jnp.take_along_axis(batch["targets"], order, axis=1)
    valid = jnp.take_along_axis(mask, order, axis=1)
    logits = model.logits(h_k)  # [B, K, V]
    loss, n = masked_cross_entropy(logits, labels, valid)
    group = jnp.asarray(cfg.vocab.group_table(logits.shape[-1]))[labels]
    acc, counts = grouped_accuracy(logits, labels, valid, group, len(METRIC_GROUPS))
    metrics = {
        "action_ce": loss,
        "action_exact": sequence_exact_match(logits, labels, valid),
        "n_targets": n,
        "dropped_targets": mask.sum().astype(jnp.float32) - n,
    }
    for i, name in enumerate(METRIC_GROUPS):
        metrics[f"acc/{name}"] = acc[i]
        metrics[f"count/{name}"] = counts[i]
    return loss, metrics


# ------------------------------------------------------------------------------------------------- act


@functools.lru_cache(maxsize=8)
def _grammar(vocab_ids: tuple[int, ...], codebook: str, vocab_size: int) -> G.ActionGrammar:
    return G.build_grammar(ActionVocab(get_codebook(codebook), np.asarray(vocab_ids)), vocab_size)


def grammar_of(config: VLAConfig) -> G.ActionGrammar:
    """The constrained-decoding automaton of a policy (cached per vocabulary)."""
    return _grammar(tuple(config.vocab.ids.tolist()), config.codebook, config.vocab_size)


class Actor:
    """``act`` for a control loop: one policy, its graph walked once (``qwen2_5_vl.Sampler``), the grammar
    and token ids looked up once. Weights are read from the policy's variables on every call, so
    in-place updates (optimizer steps, ``nnx.update`` on a weight sync) are seen; after structural
    changes call ``refresh()``. ``act(policy, ...)`` keeps one per policy and refreshes it itself when the
    policy's model or config was replaced."""

    def __init__(self, policy: VLAPolicy):
        # A weak reference: ``act``'s per-policy cache must not keep its key alive. What a call needs (the
        # model, the config) is held strongly.
        self._policy = weakref.ref(policy)
        self.refresh()

    def refresh(self) -> None:
        policy = self._policy()
        if policy is None:
            raise RuntimeError("Actor.refresh: the policy no longer exists")
        cfg = policy.config
        self.sampler = Sampler(policy.model)
        self.config = cfg
        self.model = policy.model
        self.grammar = grammar_of(cfg)
        vocab = cfg.vocab
        self.end = vocab.id_of(vocab.slots.end)
        self.max_len = vocab.max_len

    def stale(self) -> bool:
        """Whether the policy's model, config or model config were replaced since ``refresh``."""
        p = self._policy()
        if p is not None and (p.model is not self.model or p.config is not self.config):
            return True
        return self.sampler.stale()

    def __call__(
        self,
        input_ids: np.ndarray,
        attention_mask: np.ndarray,
        pixel_values: np.ndarray | None,
        regime: Sequence[int] | np.ndarray | int,
        rng: jax.Array,
        *,
        temperature: float = 1.0,
        greedy: bool = False,
    ) -> np.ndarray:
        """As :func:`act`."""
        input_ids = as_input(input_ids, np.int32)
        regime = np.broadcast_to(np.asarray(regime, np.int32), (input_ids.shape[0],))
        pv, grid = _flat_pixels(self.config, {"pixel_values": pixel_values})
        out = self.sampler(
            input_ids,
            attention_mask,
            pixel_values=None if pv is None else as_input(pv, np.float32),
            image_grid_thw=grid,
            regime=regime,
            max_new_tokens=self.max_len,
            temperature=0.0 if greedy else temperature,
            stop_token_ids=(self.end,),
            rng=rng,
            constraint=G.ActionConstraint(self.grammar, regime),
            pad_token_id=self.end,  # rows that finish early read END after
        )
        return np.asarray(out.tokens)


_ACTORS: weakref.WeakKeyDictionary[VLAPolicy, Actor] = weakref.WeakKeyDictionary()


def act(
    policy: VLAPolicy,
    input_ids: np.ndarray,
    attention_mask: np.ndarray,
    pixel_values: np.ndarray | None,
    regime: Sequence[int] | np.ndarray | int,
    rng: jax.Array,
    *,
    temperature: float = 1.0,
    greedy: bool = False,
) -> np.ndarray:
    """Sample one action per row: [B, T] prompts (any padding) -> [B, max_len] action token ids.

    Decoding is constrained by the action grammar of each row's regime, so row b reads (``TYPE ... END``
    then END padding) as a well-formed action of ``regime[b]``; decode it with ``ActionVocab.decode``
    (see :func:`decode_actions`). Runs on the policy's :class:`Actor` (kept per policy).
    """
    actor = _ACTORS.get(policy)
    if actor is None:
        actor = _ACTORS[policy] = Actor(policy)
    elif actor.stale():
        actor.refresh()
    return actor(input_ids, attention_mask, pixel_values, regime, rng, temperature=temperature, greedy=greedy)


def decode_actions(config: VLAConfig, tokens: np.ndarray) -> list[tuple[dict[str, Any], Regime]]:
    """[B, max_len] sampled ids (END-padded) -> env-format actions and regimes (ValueError if malformed)."""
    vocab = config.vocab
    end = vocab.id_of(vocab.slots.end)
    out = []
    for row in np.asarray(tokens):
        stop = np.flatnonzero(row == end)
        if not stop.size:
            raise ValueError(f"decode_actions: no {token_strings(config.codebook)[2]} in {row.tolist()}")
        out.append(vocab.decode(row[: stop[0] + 1]))
    return out


def policy_processor(config: VLAConfig, tokenizer: Any) -> Any:
    """A ``data.prompts.QwenVLProcessor`` whose images are exactly ``config.image_size``."""
    from histeve_jax.data.image_processing import VisionPreprocessConfig
    from histeve_jax.data.prompts import QwenVLProcessor

    h, w = config.image_size
    return QwenVLProcessor(tokenizer, image_config=VisionPreprocessConfig(min_pixels=h * w, max_pixels=h * w))


def observation_inputs(
    config: VLAConfig,
    processor: Any,
    observations: Sequence[tuple[Sequence[np.ndarray], str]],
    *,
    id_map: np.ndarray | None = None,
) -> dict[str, np.ndarray]:
    """(frames, instruction) per row -> left-padded ``input_ids``/``attention_mask`` and ``pixel_values``.

    Each row needs ``config.num_frames`` frames (oldest first), resized to ``config.image_size``.
    ``id_map`` (tokenizer id -> model id, e.g. ``data.pipeline.CompactVocab.table``) serves tiny models.
    """
    from histeve_jax.data.image_processing import as_rgb_uint8, resize_image
    from histeve_jax.data.prompts import pad_batch

    h, w = config.image_size
    samples = []
    for i, (frames, instruction) in enumerate(observations):
        if len(frames) != config.num_frames:
            raise ValueError(f"observation {i}: {len(frames)} frames, the policy takes {config.num_frames}")
        frames = [
            resize_image(as_rgb_uint8(f, f"observation {i} frame {j}"), h, w) for j, f in enumerate(frames)
        ]
        samples.append(
            processor.from_messages(observation_messages(frames, instruction), add_generation_prompt=True)
        )
    batch = pad_batch(samples, side="left")
    ids = batch["input_ids"].astype(np.int32)
    if id_map is not None:
        ids = np.asarray(id_map)[ids].astype(np.int32)
    return {
        "input_ids": ids,
        "attention_mask": batch["attention_mask"].astype(np.int32),
        "pixel_values": batch["pixel_values"].astype(np.float32),
    }


def act_on_observations(
    policy: VLAPolicy,
    processor: Any,
    observations: Sequence[tuple[Sequence[np.ndarray], str]],
    regimes: Sequence[Any],
    rng: jax.Array,
    *,
    id_map: np.ndarray | None = None,
    temperature: float = 1.0,
    greedy: bool = False,
) -> list[tuple[dict[str, Any], Regime]]:
    """Frames + instruction per row -> one env-format action per row, in that row's regime.

    ``regimes``: per row anything :func:`~histeve_jax.actions.regime_of` reads (an env ``info`` dict with
    ``is_gui_open``, a bool, 0/1, "NG"/"GUI").
    """
    inputs = observation_inputs(policy.config, processor, observations, id_map=id_map)
    regime = regime_array(regimes)
    tokens = act(
        policy,
        inputs["input_ids"],
        inputs["attention_mask"],
        inputs["pixel_values"],
        regime,
        rng,
        temperature=temperature,
        greedy=greedy,
    )
    return decode_actions(policy.config, tokens)


def regime_array(regimes: Sequence[Any]) -> np.ndarray:
    """Normalise each row's regime source (``is_gui_open``, ``isGuiOpen``, bool, 0/1, name) -> int32 [B]."""
    return np.asarray([int(regime_of(r)) for r in regimes], np.int32)
