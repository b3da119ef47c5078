"""RL samples: a branch group's trajectories as step records, and the featurizer that turns one step into a
training sample carrying its trajectory's advantage and the behaviour log-probabilities the actor recorded.

Records (the one schema of ``data.records``, ``kind="rl"``): every step of every trajectory of a group,
each with ``metadata`` holding, beside what ``eval.rollout.step_record`` puts there (``action_tokens``,
``action_logprobs``, ``seed``, ...): ``group_id``, ``branch`` (0..K-1), ``score``, ``advantage``,
``success``, ``policy_step`` (the learner step of the weights that acted) and the score's terms. The
regime is the record's ``is_gui_open``; the rewards are ``reward`` (the env's) and ``score``.

``RLFeaturize`` is ``data.pipeline.Featurize`` (same prompt, frames and padding, so an RL sample is an
imitation sample of the same step) whose targets are the *sampled* action tokens instead of the recorded
action re-encoded, plus ``behaviour_logp`` [L] aligned with ``targets`` and ``advantage`` []. Its
``loss_mask`` marks the sampled tokens only (their ``END`` included, the ``<|im_end|>`` after it not:
the actors never sampled it). The sampled ids are the model's (compact ids for tiny models); they are
mapped back to tokenizer ids for the prompt builder, which maps them forward again.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from histeve_jax.data import pipeline
from histeve_jax.data import records as R
from histeve_jax.data.tokenizer import NUM_TOKENIZER_IDS


def group_records(results: Sequence[Any], group_id: str, scores: Sequence[Any], advantages: np.ndarray,
                  policy_step: int) -> list[list[R.StepRecord]]:
    """The K episodes of one group as kind="rl" records with the group's fields in ``metadata``."""
    out = []
    for branch, (res, score, adv) in enumerate(zip(results, scores, advantages, strict=True)):
        eps = []
        for rec in res.records:
            meta = {**rec.metadata, "group_id": group_id, "branch": branch, "score": float(score.total),
                    "advantage": float(adv), "success": bool(res.success), "policy_step": int(policy_step),
                    "score_terms": score.as_dict()}
            eps.append(dataclasses.replace(rec, kind="rl", metadata=meta))
        out.append(eps)
    return out


def tokenizer_ids(model_ids: Sequence[int], compact: pipeline.CompactVocab | None) -> np.ndarray:
    """Sampled action ids (the model's) -> the tokenizer's ids (identical unless a compact remap is used)."""
    ids = np.asarray(model_ids, np.int64)
    if compact is None:
        return ids.astype(np.int32)
    if (ids < compact.action_base).any():
        raise R.RecordError(f"action_tokens {ids.tolist()}: not action ids (below {compact.action_base})")
    return (NUM_TOKENIZER_IDS + ids - compact.action_base).astype(np.int32)


class RLFeaturize(pipeline.Featurize):
    """Window of an RL step -> the ``Featurize`` arrays with the sampled tokens as targets, plus
    ``behaviour_logp`` [L] float32 and ``advantage`` [] float32 (module docstring)."""

    def _features(self, window: dict[str, Any]) -> dict[str, Any]:
        if self._processor is None:
            self._setup()
        rec = window["record"]
        meta = rec.get("metadata") or {}
        tokens, logprobs = meta.get("action_tokens"), meta.get("action_logprobs")
        if not tokens or len(tokens) != len(logprobs or ()):
            raise R.RecordError("record missing field metadata.action_tokens/action_logprobs")
        target = tokenizer_ids(tokens, self.spec.compact_vocab)
        # The demo path encodes rec["action"]; here the reply is exactly what was sampled.
        saved = self._vocab
        try:
            self._vocab = _FixedReply(target)
            out = super()._features(window)
        finally:
            self._vocab = saved
        positions = np.flatnonzero(out["loss_mask"] > 0)[: len(tokens)]
        if len(positions) != len(tokens):
            raise R.RecordError("sample too long: the sampled action was truncated")
        behaviour = np.zeros_like(out["loss_mask"])
        behaviour[positions] = np.asarray(logprobs, np.float32)
        mask = np.zeros_like(out["loss_mask"])
        mask[positions] = 1.0
        out.update(loss_mask=mask, behaviour_logp=behaviour,
                   advantage=np.asarray(float(meta["advantage"]), np.float32))
        return out


class _FixedReply:
    """Stands in for the ActionVocab in ``Featurize._features``: its ``encode`` returns the sampled ids."""

    def __init__(self, ids: np.ndarray):
        self.ids = ids

    def encode(self, action: Any, regime: Any) -> np.ndarray:
        return self.ids
