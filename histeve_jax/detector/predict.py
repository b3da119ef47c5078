"""Probabilities of a trained detector over query batches, and the trained module back from a workdir."""

from __future__ import annotations

import itertools
import os
from typing import Any

import jax
import numpy as np
from flax import nnx

from histeve_jax.detector.coupled import CoupledDetector
from histeve_jax.detector.loss import completion_probability
from histeve_jax.train import optimizer as optimizer_lib
from histeve_jax.train import state as state_lib
from histeve_jax.train.checkpoint import Checkpointer
from histeve_jax.train.setup import Stage
from histeve_jax.train.specs import RunSpec


@nnx.jit
def _probabilities(module: CoupledDetector, batch: dict[str, jax.Array]) -> jax.Array:
    return completion_probability(module.logits(batch))


def predict(module: CoupledDetector, batches: Any,
            max_batches: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(P(complete) [N], labels [N]) over a batch iterator (one pass, or ``max_batches``)."""
    probs, labels = [], []
    for batch in itertools.islice(batches, max_batches):
        dev = {k: v for k, v in batch.items() if k != "label"}
        probs.append(np.asarray(_probabilities(module, dev)))
        labels.append(np.asarray(batch["label"]))
    if not probs:
        return np.zeros((0,), np.float32), np.zeros((0,), np.int32)
    return np.concatenate(probs), np.concatenate(labels)


def load_trained(spec: RunSpec, stage: Stage, step: int | None = None) -> CoupledDetector:
    """The coupled detector of a run's latest (or ``step``) checkpoint, on one device."""
    ckpt_dir = os.path.join(spec.workdir, "checkpoints")
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:1]).reshape(1, 1, 1), ("data", "fsdp", "tensor"))
    tx, _ = optimizer_lib.make_optimizer(spec.optimizer)
    abstract, _ = state_lib.abstract_train_state(stage.init_model, tx, mesh)
    with Checkpointer(ckpt_dir, async_save=False) as ck:
        step = ck.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"{spec.workdir}: no detector checkpoint under {ckpt_dir}")
        state, _, _ = ck.restore(abstract, step=step)
    return state.model()
