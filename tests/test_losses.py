"""Imitation losses on hand-computed values."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from histeve_jax.losses import grouped_accuracy, masked_cross_entropy, sequence_exact_match


def test_masked_cross_entropy_hand_computed():
    # Row 0: logits [0, ln 3] -> p(label 1) = 3/4; row 1: uniform over 2 -> ln 2; row 2 masked out.
    logits = jnp.array([[[0.0, math.log(3.0)], [0.0, 0.0], [100.0, -100.0]]])
    labels = jnp.array([[1, 0, 1]])
    mask = jnp.array([[1, 1, 0]])
    loss, n = masked_cross_entropy(logits, labels, mask)
    expected = (-math.log(0.75) + math.log(2.0)) / 2
    np.testing.assert_allclose(float(loss), expected, rtol=1e-6)
    assert float(n) == 2.0


def test_masked_cross_entropy_bf16_logits_computed_in_f32_and_empty_mask():
    logits = jnp.array([[3.0, 1.0, -2.0]], jnp.bfloat16)
    loss, _ = masked_cross_entropy(logits, jnp.array([2]), jnp.array([1]))
    lse = math.log(math.exp(3.0) + math.exp(1.0) + math.exp(-2.0))
    np.testing.assert_allclose(float(loss), lse + 2.0, rtol=1e-6)
    loss0, n0 = masked_cross_entropy(logits, jnp.array([2]), jnp.array([0]))
    assert float(loss0) == 0.0 and float(n0) == 0.0


def test_grouped_accuracy_hand_computed():
    # argmax per position: 1, 0, 2, 2; labels 1, 1, 2, 0; groups 0, 0, 1, 2; last masked.
    logits = jnp.array([[[0, 5, 0], [5, 0, 0], [0, 0, 5], [0, 0, 5]]], jnp.float32)
    labels = jnp.array([[1, 1, 2, 0]])
    group = jnp.array([[0, 0, 1, 2]])
    mask = jnp.array([[1, 1, 1, 0]])
    acc, counts = grouped_accuracy(logits, labels, mask, group, 4)
    np.testing.assert_allclose(np.asarray(acc), [0.5, 1.0, 0.0, 0.0])
    np.testing.assert_allclose(np.asarray(counts), [2, 1, 0, 0])


def test_sequence_exact_match():
    logits = jnp.array([[[0, 5], [5, 0]], [[0, 5], [0, 5]], [[5, 0], [5, 0]]], jnp.float32)
    labels = jnp.array([[1, 0], [1, 0], [1, 1]])
    mask = jnp.array([[1, 1], [1, 1], [0, 0]])
    # row 0 all right, row 1 one wrong, row 2 has nothing to predict (not counted).
    assert float(sequence_exact_match(logits, labels, mask)) == 0.5
