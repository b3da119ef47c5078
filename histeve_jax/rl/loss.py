"""The stage-3 loss of the policy on a mixed batch, from ``losses.rl``'s pure pieces: ``L_post`` =
clipped GRPO + lambda_dpo DPO + lambda_world replay CE + lambda_ref KL to the frozen reference.

Batch rows (B = rl_rows + pair rows + replay rows; keys beside ``policy.loss.action_loss``'s)::

    behaviour_logp  float32 [B, L]  the actors' log-probs of the sampled tokens, aligned with ``targets``
    advantage       float32 [B]     the row's trajectory advantage (GRPO rows)
    rl_row          bool    [B]     GRPO + KL rows
    pair            int32   [B]     DPO pair index of the row (-1: none); ``chosen`` bool [B] its side
    replay_row      bool    [B]     world replay rows (cross-entropy on their demonstration targets)
    ref_logp        float32 [B, K]  the frozen reference's log-probs at the K gathered targets, computed
                                    before the step (``reference_log_probs``) so the step stays pure

Log-probs are those of the distribution the actors sampled from: the grammar-masked logits at the
sampling temperature (``losses.rl.token_log_probs``), the grammar state of each target walked from the
row's regime through the targets before it. Replay rows use the plain logits, as the imitation loss does.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from histeve_jax.actions import grammar as grammar_lib
from histeve_jax.actions.codebook import get_codebook
from histeve_jax.actions.grammar import ActionGrammar
from histeve_jax.actions.tokens import ActionVocab
from histeve_jax.losses import rl as rl_losses
from histeve_jax.policy.loss import flat_pixels


@functools.lru_cache(maxsize=8)
def _grammar_tables(vocab_ids: tuple[int, ...], codebook: str, vocab_size: int,
                    dual_mouse: bool) -> tuple[np.ndarray, ...]:
    # numpy, built outside any trace: a cached jnp table made inside a jit would be a leaked tracer.
    with jax.ensure_compile_time_eval():
        vocab = ActionVocab(get_codebook(codebook), np.asarray(vocab_ids), dual_mouse)
        g = grammar_lib.build_grammar(vocab, vocab_size)
        return np.asarray(g.allowed), np.asarray(g.next_state)


def policy_grammar(config: Any) -> ActionGrammar:
    """The policy's action automaton with constant (numpy-backed) tables, safe to use inside jit."""
    allowed, nxt = _grammar_tables(tuple(config.vocab.ids.tolist()), config.codebook, config.vocab_size,
                                   config.dual_mouse)
    return ActionGrammar(allowed=jnp.asarray(allowed), next_state=jnp.asarray(nxt))


def target_logits(policy: Any, batch: Mapping[str, Any]) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """(logits [B, K, V], labels [B, K], valid [B, K], order [B, K]) at each row's first K target
    positions (``loss_mask``), exactly as ``policy.loss.action_loss`` gathers them."""
    cfg = policy.config
    ids = batch["input_ids"]
    B, L = ids.shape
    pv, grid = flat_pixels(cfg, batch)
    regime = jnp.asarray(batch["regime"], jnp.int32).reshape(B)
    h = policy.model.hidden_states(ids, attention_mask=batch["attention_mask"], pixel_values=pv,
                                   image_grid_thw=grid, regime=regime)
    mask = batch["loss_mask"] > 0
    K = min(cfg.max_targets, L)
    order = jnp.argsort(~mask, axis=1, stable=True)[:, :K]
    h_k = jnp.take_along_axis(h, order[..., None], axis=1)
    labels = jnp.take_along_axis(batch["targets"], order, axis=1)
    valid = jnp.take_along_axis(mask, order, axis=1)
    return policy.model.logits(h_k), labels, valid, order


def grammar_allowed(grammar: ActionGrammar, labels: jax.Array, regime: jax.Array) -> jax.Array:
    """[B, K] target ids, [B] regimes -> [B, K, V] bool: what the action automaton allowed at each target."""
    def walk(state, token):
        return grammar.next_state[state, token], state

    start = jnp.asarray(regime, jnp.int32).reshape(-1)
    _, states = jax.lax.scan(walk, start, jnp.swapaxes(labels, 0, 1))  # [K, B] state before each target
    return grammar.allowed[jnp.swapaxes(states, 0, 1)]


def sampling_log_probs(policy: Any, batch: Mapping[str, Any], temperature: float) -> tuple[jax.Array, ...]:
    """(log-probs [B, K] under the sampling distribution, logits, labels, valid, order)."""
    logits, labels, valid, order = target_logits(policy, batch)
    allowed = grammar_allowed(policy_grammar(policy.config), labels, batch["regime"])
    logp = rl_losses.token_log_probs(logits, labels, temperature=temperature, allowed=allowed)
    return logp, logits, labels, valid, order


def reference_log_probs(reference: Any, batch: Mapping[str, Any], temperature: float) -> jax.Array:
    """The frozen reference's [B, K] log-probs of the batch's targets (no gradient; run before the step)."""
    return jax.lax.stop_gradient(sampling_log_probs(reference, batch, temperature)[0])


def rl_loss(policy: Any, batch: Mapping[str, Any], rng: jax.Array | None = None, *,
            config: rl_losses.RLLossConfig = rl_losses.DEFAULT, temperature: float = 1.0,
            n_pairs: int = 1) -> tuple[jax.Array, dict[str, jax.Array]]:
    """``L_post`` on a mixed batch (module docstring); pure, in the train loop's ``loss_fn`` form once the
    keywords are bound. ``n_pairs`` is the (static) number of DPO pairs a batch can hold."""
    del rng
    logp, logits, labels, valid, order = sampling_log_probs(policy, batch, temperature)
    behaviour = jnp.take_along_axis(batch["behaviour_logp"], order, axis=1)
    rl_mask = valid & jnp.asarray(batch["rl_row"], bool)[:, None]
    grpo, m_grpo = rl_losses.grpo_loss(logp, behaviour, batch["advantage"], rl_mask, config)
    kl, m_kl = rl_losses.reference_kl(logp, batch["ref_logp"], rl_mask, config)
    pair = jnp.asarray(batch["pair"], jnp.int32)
    pair_mask = valid & (pair >= 0)[:, None]
    chosen = jnp.asarray(batch["chosen"], bool)
    pol = rl_losses.pair_log_probs(logp, pair_mask, pair, chosen, n_pairs)
    ref = rl_losses.pair_log_probs(batch["ref_logp"], pair_mask, pair, chosen, n_pairs)
    dpo, m_dpo = rl_losses.dpo_loss(pol, ref, config)
    world, n_world = rl_losses.world_replay_loss(logits, labels, valid, batch["replay_row"])
    loss, metrics = rl_losses.post_training_loss(grpo, dpo, world, kl, config)
    return loss, {**metrics, **m_grpo, **m_kl, **m_dpo, "world/n_tokens": n_world}
