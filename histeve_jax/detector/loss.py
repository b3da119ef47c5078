"""The detector's loss (two-way cross-entropy on the final token's logits), its binary metrics and the
threshold calibration on a validation split.

``completion_loss(module, batch, rng)`` is the train loop's ``loss_fn`` form (pure); ``binary_metrics``
(accuracy, precision, recall, F1, false positive and false negative rates) and ``calibrate_threshold``
work on host arrays of probabilities and labels.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from histeve_jax.losses import masked_cross_entropy


def completion_loss(module: Any, batch: Mapping[str, Any], rng: jax.Array | None = None
                    ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Mean cross-entropy of ``label`` under the coupled detector's two logits, and its accuracy."""
    del rng
    logits = module.logits(batch)  # [B, 2]
    labels = jnp.asarray(batch["label"], jnp.int32)
    valid = labels >= 0
    loss, n = masked_cross_entropy(logits[:, None], jnp.maximum(labels, 0)[:, None], valid[:, None])
    pred = jnp.argmax(logits, -1)
    hits = jnp.sum((pred == labels) & valid)
    return loss, {"completion_ce": loss, "accuracy": hits / jnp.maximum(n, 1.0),
                  "positive_rate": jnp.sum((labels == 1) & valid) / jnp.maximum(n, 1.0)}


def completion_probability(logits: jax.Array) -> jax.Array:
    """P(complete) from the two logits."""
    return jax.nn.softmax(logits.astype(jnp.float32), -1)[..., 1]


def binary_metrics(prob: np.ndarray, labels: np.ndarray, threshold: float) -> dict[str, float]:
    """Accuracy, precision, recall, F1, FPR and FNR of ``prob >= threshold`` against 0/1 ``labels``
    (0/0 counts as 0)."""
    pred = np.asarray(prob) >= threshold
    y = np.asarray(labels).astype(bool)
    tp, fp = int(np.sum(pred & y)), int(np.sum(pred & ~y))
    fn, tn = int(np.sum(~pred & y)), int(np.sum(~pred & ~y))
    div = lambda a, b: a / b if b else 0.0
    precision, recall = div(tp, tp + fp), div(tp, tp + fn)
    return {"n": float(len(y)), "accuracy": div(tp + tn, len(y)), "precision": precision, "recall": recall,
            "f1": div(2 * precision * recall, precision + recall), "fpr": div(fp, fp + tn),
            "fnr": div(fn, fn + tp), "tp": float(tp), "fp": float(fp), "fn": float(fn), "tn": float(tn)}


def calibrate_threshold(prob: np.ndarray, labels: np.ndarray) -> float:
    """The threshold with the best F1 on a validation split (ties: the one closest to 0.5), chosen among
    the midpoints between sorted distinct probabilities (and 0.5)."""
    p = np.unique(np.asarray(prob, np.float64))
    candidates = np.unique(np.r_[0.5, (p[1:] + p[:-1]) / 2 if len(p) > 1 else []])
    scores = [(binary_metrics(prob, labels, t)["f1"], -abs(t - 0.5), t) for t in candidates]
    return float(max(scores)[2])
