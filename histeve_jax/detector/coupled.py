"""The policy-coupled detector: the frozen policy and the detector as one module, one forward for training
and for the loop.

Each frame of a query is encoded once by the policy's vision tower; the policy's prompt (its own frames
and the instruction, as it acts) takes its frames' embeddings and gives the final-layer hidden states of
every prompt token (the tokens before the first action token); the detector's prompt takes its frames'
embeddings and attends to those states. The policy's parameters are ``Frozen`` variables, not
``nnx.Param``: the train state keeps them with the non-trainable state, so the optimizer neither updates
nor holds moments for them and no gradient is taken with respect to them (``stop_gradient`` on its
outputs says so again).

Batch (``CoupledDetector.logits`` / ``detector.loss``); B queries, S frame slots (the union of both
models' frame offsets, ``frame_slots``), P patches per frame::

    pixel_values        float32 [B, S * P + D * P', 1176]  the query's frames, oldest first, then the
                                         detail crops (``DetectorConfig.detail``) of its D detail slots
    input_ids           int32   [B, L]   the detector's prompt (right-padded)
    attention_mask      int32   [B, L]
    policy_input_ids    int32   [B, Lp]  the policy's prompt at the query (right-padded)
    policy_attention_mask int32 [B, Lp]
    regime              int32   [B]      the policy's RS-Norm row at the query
    label               int32   [B]      1: the instruction is complete at the query
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from histeve_jax.detector.config import DetectorConfig
from histeve_jax.detector.model import Detector
from histeve_jax.policy import Policy


class Frozen(nnx.Variable):
    """A parameter that is not trained (the policy's, inside the detector's train state)."""


def freeze(module: nnx.Module) -> nnx.Module:
    """The same module with every ``nnx.Param`` made a ``Frozen`` variable (values and metadata kept)."""
    graphdef, state = nnx.split(module)

    def one(v: Any) -> Any:
        if not isinstance(v, nnx.Param):
            return v
        meta = {**v.get_metadata(), "eager_sharding": False}
        return Frozen(v.get_value(), **meta)

    return nnx.merge(graphdef, jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable)))


def frame_slots(config: DetectorConfig, policy_frames: int) -> tuple[tuple[int, ...], tuple[int, ...],
                                                                      tuple[int, ...]]:
    """(offsets of the frame slots before the query, oldest first; the detector's slots; the policy's).

    The policy's ``policy_frames`` frames are ``config.policy_stride`` steps apart, as it acts; slots are the
    union of both layouts, so a frame both models see is encoded once."""
    det = config.frame_offsets()
    pol = tuple(k * config.policy_stride for k in range(policy_frames - 1, -1, -1))
    union = tuple(sorted(set(det) | set(pol), reverse=True))
    return union, tuple(union.index(o) for o in det), tuple(union.index(o) for o in pol)


def detail_slots(config: DetectorConfig, policy_frames: int) -> tuple[int, ...]:
    """The frame slots (``frame_slots``' union) whose detail crops the detector reads, in prompt order."""
    union = frame_slots(config, policy_frames)[0]
    return tuple(union.index(o) for o in config.detail_offsets())


class CoupledDetector(nnx.Module):
    """The frozen policy and the trainable detector (see the module docstring)."""

    def __init__(self, policy: Policy, detector: Detector):
        detector.config.check_policy(policy.config)
        self.policy = freeze(policy)
        self.detector = detector
        self.slots = frame_slots(detector.config, policy.config.num_frames)

    @property
    def config(self) -> DetectorConfig:
        return self.detector.config

    def frame_embeds(self, pixel_values: jax.Array, n_frames: int, detail: bool = False) -> jax.Array:
        """The policy's vision tower on ``n_frames`` frames (``detail``: detail crops):
        [n_frames, tokens, policy width]."""
        cfg = self.config
        grid = cfg.image_grids()[-1 if detail else 0]
        pixels = pixel_values.reshape(-1, pixel_values.shape[-1])
        out = self.policy.model.visual(pixels, (grid,) * n_frames)
        return jax.lax.stop_gradient(out.reshape(n_frames, -1, out.shape[-1]))

    def policy_context(self, input_ids: jax.Array, attention_mask: jax.Array, regime: jax.Array,
                       image_embeds: jax.Array) -> jax.Array:
        """The policy's final-layer hidden states of its prompt [B, Lp, policy width] (the tokens before the
        first action token), its images given as embeddings [B * frames * tokens, width]."""
        B = input_ids.shape[0]
        grid = self.policy.config.image_grid(B * self.policy.config.num_frames)
        h = self.policy.model.hidden_states(input_ids, attention_mask=attention_mask, image_grid_thw=grid,
                                            image_embeds=image_embeds, regime=regime.reshape(B))
        return jax.lax.stop_gradient(h)

    def logits_from_embeds(self, embeds: jax.Array, batch: Mapping[str, Any],
                           detail: jax.Array | None = None) -> jax.Array:
        """Logits [B, 2] given the frame-slot embeddings [B, S, tokens, policy width] of the batch and, for
        a detector with a detail crop, its crops' embeddings [B, D, detail tokens, policy width]."""
        _, det_slots, pol_slots = self.slots
        B = embeds.shape[0]
        flat = lambda e: e.reshape(-1, e.shape[-1])
        det_img = embeds[:, jnp.asarray(det_slots)].reshape(B, -1, embeds.shape[-1])
        if self.config.detail is not None:
            if detail is None:
                raise ValueError("CoupledDetector: a detector with a detail crop needs its crops' embeddings")
            det_img = jnp.concatenate([det_img, detail.reshape(B, -1, detail.shape[-1])], axis=1)
        det_img = flat(det_img)
        context = mask = None
        if self.config.num_groups:
            pol_img = flat(embeds[:, jnp.asarray(pol_slots)])
            context = self.policy_context(batch["policy_input_ids"], batch["policy_attention_mask"],
                                          jnp.asarray(batch["regime"], jnp.int32), pol_img)
            mask = batch["policy_attention_mask"]
        return self.detector(batch["input_ids"], batch["attention_mask"], det_img, context, mask)

    def logits(self, batch: Mapping[str, Any]) -> jax.Array:
        """Logits [B, 2] of a batch (module docstring): frames encoded once, then both models."""
        B = batch["input_ids"].shape[0]
        S, D = len(self.slots[0]), len(self.config.detail_offsets())
        pixels = batch["pixel_values"]
        n = S * math.prod(self.config.image_grids()[0])  # the frames' patches in a row; the crops' follow
        want = self.config.query_patches(S)
        if pixels.shape[1] != want:
            raise ValueError(f"CoupledDetector: pixel_values has {pixels.shape[1]} patches per query; the "
                             f"detector's {S} frames and {D} detail crops have {want}")
        embeds = self.frame_embeds(pixels[:, :n], B * S)
        detail = self.frame_embeds(pixels[:, n:], B * D, detail=True) if D else None
        return self.logits_from_embeds(embeds.reshape(B, S, *embeds.shape[1:]), batch,
                                       None if detail is None else detail.reshape(B, D, *detail.shape[1:]))
