"""What the policy sees: (frames, instruction) per row -> the model's prompt inputs, exactly as in training.

The prompt is the prefix of the training sample ``data.pipeline.Featurize`` builds (the same
``data.prompts.observation_messages``), with every frame resized to the policy's ``image_size``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from histeve_jax.actions.codebook import regime_of
from histeve_jax.data.image_processing import VisionPreprocessConfig, as_rgb_uint8, resize_image
from histeve_jax.data.prompts import QwenVLProcessor, observation_messages, pad_batch
from histeve_jax.policy.config import PolicyConfig

Observation = tuple[Sequence[np.ndarray], str]  # frames (oldest first), instruction


def policy_processor(config: PolicyConfig, tokenizer: Any) -> QwenVLProcessor:
    """A ``data.prompts.QwenVLProcessor`` whose images are exactly ``config.image_size``."""
    h, w = config.image_size
    return QwenVLProcessor(tokenizer, image_config=VisionPreprocessConfig(min_pixels=h * w, max_pixels=h * w))


def observation_inputs(
    config: PolicyConfig,
    processor: QwenVLProcessor,
    observations: Sequence[Observation],
    *,
    id_map: np.ndarray | None = None,
) -> dict[str, np.ndarray]:
    """(frames, instruction) per row -> left-padded ``input_ids``/``attention_mask`` and ``pixel_values``.

    Each row needs ``config.num_frames`` frames (oldest first), resized to ``config.image_size``.
    ``id_map`` (tokenizer id -> model id, e.g. ``data.pipeline.CompactVocab.table``) serves tiny models.
    """
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


def regime_array(regimes: Sequence[Any]) -> np.ndarray:
    """Normalise each row's regime source (``is_gui_open``, ``isGuiOpen``, bool, 0/1, name) -> int32 [B]."""
    return np.asarray([int(regime_of(r)) for r in regimes], np.int32)
