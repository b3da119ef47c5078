"""The imitation loss of the policy: masked cross-entropy over the reply's tokens, per-token-kind accuracy.

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

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from histeve_jax.actions.tokens import TOKEN_GROUPS
from histeve_jax.losses import grouped_accuracy, masked_cross_entropy, sequence_exact_match
from histeve_jax.policy.config import PolicyConfig

if TYPE_CHECKING:
    from histeve_jax.policy.model import Policy

METRIC_GROUPS: tuple[str, ...] = TOKEN_GROUPS + ("other",)  # "other": <|im_end|> and text targets


def flat_pixels(config: PolicyConfig, batch: Mapping[str, Any]) -> tuple[Any, tuple | None]:
    """(``pixel_values`` as [n_images * P, 1176], the static grid of its n_images frames); (None, None)
    for a text-only batch. Raises naming ``pixel_values``/``image_grid_thw`` when they do not fit."""
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
    policy: Policy, batch: Mapping[str, Any], rng: jax.Array | None = None
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
    pv, grid = flat_pixels(cfg, batch)
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
