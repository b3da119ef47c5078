"""Constrained action sampling: the caller creates an ``ActionSampler`` for a policy and keeps it.

Decoding is constrained by the action grammar of each row's regime (``actions.grammar``), so every row
reads ``TYPE ... END`` (then END padding) as a well-formed action of its regime. Each token comes with its
log-probability under the distribution it was drawn from (the grammar-masked logits at the sampling
temperature; see ``qwen2_5_vl.generate``), which RL uses as the behaviour log-probability.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from histeve_jax.actions import grammar
from histeve_jax.actions.codebook import Regime, get_codebook
from histeve_jax.actions.tokens import ActionVocab, token_strings
from histeve_jax.models.qwen2_5_vl.generate import Sampler, SamplingOptions, as_input
from histeve_jax.policy.config import PolicyConfig
from histeve_jax.policy.loss import flat_pixels
from histeve_jax.policy.model import Policy
from histeve_jax.policy.observations import Observation, observation_inputs, regime_array


@functools.lru_cache(maxsize=8)
def _grammar(vocab_ids: tuple[int, ...], codebook: str, vocab_size: int,
             dual_mouse: bool) -> grammar.ActionGrammar:
    vocab = ActionVocab(get_codebook(codebook), np.asarray(vocab_ids), dual_mouse)
    return grammar.build_grammar(vocab, vocab_size)


def grammar_of(config: PolicyConfig) -> grammar.ActionGrammar:
    """The constrained-decoding automaton of a policy (one per vocabulary, built once)."""
    return _grammar(tuple(config.vocab.ids.tolist()), config.codebook, config.vocab_size, config.dual_mouse)


class ActionTokens(NamedTuple):
    tokens: np.ndarray  # [B, max_len] int32, END-padded after each row's END
    logprobs: np.ndarray  # [B, max_len] float32, 0 after each row's END


@dataclasses.dataclass
class SampledAction:
    """One row's action: env format, regime, and the tokens it was decoded from (END included)."""

    action: dict[str, Any]
    regime: Regime
    tokens: list[int]
    logprobs: list[float]


class ActionSampler:
    """Actions of one policy for a control loop: the model's graph walked once (``qwen2_5_vl.Sampler``),
    the grammar and token ids looked up once. Weights are read from the policy's variables on every call,
    so in-place updates (optimizer steps, ``nnx.update`` on an RL weight sync) are seen; a replaced model
    or config (``resize_token_embeddings``, a new ``policy.model``) is noticed and the graph re-walked."""

    def __init__(self, policy: Policy):
        self.policy = policy
        self.refresh()

    def refresh(self) -> None:
        """Re-walk the policy's graph (done by itself when the model or config were replaced)."""
        cfg = self.policy.config
        self._sampler = Sampler(self.policy.model)
        self._config, self._model = cfg, self.policy.model
        self.grammar = grammar_of(cfg)
        vocab = cfg.vocab
        self.end = vocab.id_of(vocab.slots.end)
        self.max_len = vocab.max_len

    def _stale(self) -> bool:
        p = self.policy
        return p.model is not self._model or p.config is not self._config or self._sampler.stale()

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
        top_p: float = 1.0,
    ) -> ActionTokens:
        """Sample one action per row of [B, T] prompts (any padding): tokens and their log-probs.

        ``top_p`` < 1 samples each token from its nucleus (the most likely tokens whose mass reaches
        ``top_p``, after the grammar's mask and the temperature); the log-probs are then under that
        truncated distribution, which the RL learner cannot reproduce, so RL's actors keep ``top_p = 1``.
        """
        if self._stale():
            self.refresh()
        input_ids = as_input(input_ids, np.int32)
        regime = np.broadcast_to(np.asarray(regime, np.int32), (input_ids.shape[0],))
        pv, grid = flat_pixels(self._config, {"pixel_values": pixel_values})
        options = SamplingOptions(
            max_new_tokens=self.max_len, temperature=0.0 if greedy else temperature, top_p=top_p,
            stop_token_ids=(self.end,), pad_token_id=self.end,  # rows that finish early read END after
        )
        out = self._sampler(
            input_ids, attention_mask, options=options,
            pixel_values=None if pv is None else as_input(pv, np.float32), image_grid_thw=grid,
            regime=regime, rng=rng, constraint=grammar.ActionConstraint(self.grammar, regime),
        )
        return ActionTokens(np.asarray(out.tokens), np.asarray(out.logprobs))

    def sample(
        self,
        processor: Any,
        observations: Sequence[Observation],
        regimes: Sequence[Any],
        rng: jax.Array,
        *,
        id_map: np.ndarray | None = None,
        temperature: float = 1.0,
        greedy: bool = False,
        top_p: float = 1.0,
    ) -> list[SampledAction]:
        """(frames, instruction) per row -> one env-format action per row, in that row's regime.

        ``regimes``: per row anything ``actions.regime_of`` reads (an env ``info`` dict with
        ``is_gui_open``, a bool, 0/1, "NG"/"GUI").
        """
        inputs = observation_inputs(self._config, processor, observations, id_map=id_map)
        out = self(inputs["input_ids"], inputs["attention_mask"], inputs["pixel_values"],
                   regime_array(regimes), rng, temperature=temperature, greedy=greedy, top_p=top_p)
        decoded = decode_actions(self._config, out.tokens)
        rows = []
        for (action, regime), toks, lps in zip(decoded, out.tokens, out.logprobs, strict=True):
            n = int(np.flatnonzero(toks == self.end)[0]) + 1
            rows.append(SampledAction(action, regime, toks[:n].tolist(), lps[:n].astype(float).tolist()))
        return rows


def decode_actions(config: PolicyConfig, tokens: np.ndarray) -> list[tuple[dict[str, Any], Regime]]:
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
