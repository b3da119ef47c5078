"""One query as arrays: the frames of its slots, the detector's prompt and the policy's prompt.

The detector's prompt is one user turn: its frames (oldest first), the instruction and the question
``DETECTOR_QUESTION``, then the generation prompt; its last token's hidden state is what the head reads.
The policy's prompt is exactly what the policy sees when it acts (``data.prompts.observation_messages``
with its own frames). Both are right-padded to fixed lengths. Token ids depend only on the instruction
(every frame has the same size), so they are built once per instruction.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from histeve_jax.data import pipeline
from histeve_jax.data.image_processing import (
    VisionPreprocessConfig,
    as_rgb_uint8,
    crop_image,
    process_images,
    resize_image,
)
from histeve_jax.data.prompts import QwenVLProcessor, observation_messages
from histeve_jax.data.tokenizer import NUM_TOKENIZER_IDS, PAD_ID, load_qwen_tokenizer
from histeve_jax.detector.config import DetectorConfig
from histeve_jax.detector.coupled import detail_slots, frame_slots
from histeve_jax.models.qwen2_5_vl import Qwen2_5_VLConfig

DETECTOR_QUESTION = "Has this instruction been completed? Answer yes or no."


def detector_messages(frames: Sequence[np.ndarray], instruction: str) -> list[dict[str, Any]]:
    """The detector's chat messages for one query: its images (frames, then any detail crops), the
    instruction, the question."""
    content: list[dict[str, Any]] = [{"type": "image", "image": f} for f in frames]
    content.append({"type": "text", "text": f"Instruction: {instruction}\n{DETECTOR_QUESTION}"})
    return [{"role": "user", "content": content}]


def compact_ids(base: Qwen2_5_VLConfig, action_base: int | None = None,
                n_action: int = 0) -> np.ndarray | None:
    """Tokenizer id -> model id for a model whose table is smaller than the tokenizer (the tiny ones;
    ``data.pipeline.CompactVocab``), else None."""
    if base.text.vocab_size >= NUM_TOKENIZER_IDS:
        return None
    cv = pipeline.CompactVocab(image_token_id=base.image_token_id, video_token_id=base.video_token_id,
                               vision_start_token_id=base.vision_start_token_id,
                               vision_end_token_id=base.vision_end_token_id,
                               action_base=base.text.vocab_size if action_base is None else action_base)
    return cv.table(n_action)


class QueryInputs:
    """Builds the arrays of one query (``coupled`` module docstring) from its slot frames (HxWx3 uint8)."""

    def __init__(self, config: DetectorConfig, policy_config: Any, tokenizer_path: str | None = None):
        self.config, self.policy_config = config, policy_config
        self.slots = frame_slots(config, policy_config.num_frames)
        self.detail_slots = detail_slots(config, policy_config.num_frames)
        h, w = config.image_size
        self.image_config = VisionPreprocessConfig(min_pixels=h * w, max_pixels=h * w)
        dh, dw = config.detail_size
        self.detail_config = VisionPreprocessConfig(min_pixels=dh * dw, max_pixels=dh * dw)
        # the processor counts each image's tokens at its own size: frames and detail crops both kept
        areas = (h * w, dh * dw) if config.detail is not None else (h * w,)
        self._prompt_config = VisionPreprocessConfig(min_pixels=min(areas), max_pixels=max(areas))
        self._tokenizer_path = tokenizer_path
        self._processor: QwenVLProcessor | None = None  # built lazily (grain workers, pickling)
        self._ids: dict[str, tuple[np.ndarray, np.ndarray, int, int]] = {}
        self.detector_ids = compact_ids(config.base)
        pb = policy_config.model_config
        self.policy_ids = compact_ids(pb, policy_config.action_token_base, len(policy_config.vocab.ids))

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_processor": None}

    def _prompt_ids(self, instruction: str) -> tuple[np.ndarray, np.ndarray, int, int]:
        """(detector ids, policy ids, their lengths) of ``instruction``, right-padded to their lengths."""
        if instruction in self._ids:
            return self._ids[instruction]
        if self._processor is None:
            self._processor = QwenVLProcessor(load_qwen_tokenizer(self._tokenizer_path),
                                              image_config=self._prompt_config)
        blank = np.zeros((*self.config.image_size, 3), np.uint8)
        details = [np.zeros((*self.config.detail_size, 3), np.uint8)] * len(self.detail_slots)
        out = []
        for images, msgs, length, remap, who in (
            ([blank] * self.config.num_frames + details, detector_messages, self.config.max_len,
             self.detector_ids, "detector"),
            ([blank] * self.policy_config.num_frames, observation_messages, self.config.policy_max_len,
             self.policy_ids, "policy"),
        ):
            ids = self._processor.from_messages(msgs(images, instruction),
                                                add_generation_prompt=True)["input_ids"]
            if len(ids) > length:
                raise ValueError(f"{who} prompt of {instruction!r} has {len(ids)} tokens > {length} "
                                 f"(DetectorConfig.{'max_len' if who == 'detector' else 'policy_max_len'})")
            padded = np.full(length, PAD_ID, np.int64)
            padded[: len(ids)] = ids
            if remap is not None:
                padded = remap[padded]
            out.append((padded.astype(np.int32), len(ids)))
        (d_ids, d_n), (p_ids, p_n) = out
        self._ids[instruction] = (d_ids, p_ids, d_n, p_n)
        return self._ids[instruction]

    def _sized(self, frames: Sequence[np.ndarray]) -> list[np.ndarray]:
        h, w = self.config.image_size
        frames = [as_rgb_uint8(f, f"query frame {i}") for i, f in enumerate(frames)]
        return [f if f.shape[:2] == (h, w) else resize_image(f, h, w) for f in frames]

    def pixels(self, frames: Sequence[np.ndarray]) -> np.ndarray:
        """Patches [len(frames) * P, 1176] of frames (HxWx3 uint8, resized to the config's image size)."""
        return process_images(self._sized(frames), self.image_config)["pixel_values"].astype(np.float32)

    def detail_pixels(self, frames: Sequence[np.ndarray]) -> np.ndarray:
        """Patches [len(frames) * P', 1176] of frames' detail crops (``DetectorConfig.detail``: cut from the
        frame at the config's image size, then resized ``detail_scale`` times)."""
        if self.config.detail is None:
            raise ValueError("QueryInputs.detail_pixels: the detector has no detail crop "
                             "(DetectorConfig.detail)")
        crops = [crop_image(f, self.config.detail, self.config.detail_scale) for f in self._sized(frames)]
        return process_images(crops, self.detail_config)["pixel_values"].astype(np.float32)

    def query_pixels(self, frames: Sequence[np.ndarray]) -> np.ndarray:
        """A query's ``pixel_values``: every slot's frame, then the detail crops of its detail slots."""
        out = self.pixels(frames)
        if self.detail_slots:
            out = np.concatenate([out, self.detail_pixels([frames[i] for i in self.detail_slots])])
        return out

    def prompts(self, instruction: str, regime: int, label: int = -1) -> dict[str, np.ndarray]:
        """The query's arrays other than its pixels."""
        d_ids, p_ids, d_n, p_n = self._prompt_ids(instruction)
        mask = lambda n, L: (np.arange(L) < n).astype(np.int32)
        return {"input_ids": d_ids, "attention_mask": mask(d_n, len(d_ids)),
                "policy_input_ids": p_ids, "policy_attention_mask": mask(p_n, len(p_ids)),
                "regime": np.asarray(int(regime), np.int32), "label": np.asarray(int(label), np.int32)}

    def __call__(self, frames: Sequence[np.ndarray], instruction: str, regime: int,
                 label: int = -1) -> dict[str, np.ndarray]:
        """One query's arrays from the frames of its slots (oldest first, ``len(self.slots[0])`` of them)."""
        if len(frames) != len(self.slots[0]):
            raise ValueError(f"query: {len(frames)} frames, the detector's slots need {len(self.slots[0])}")
        return {"pixel_values": self.query_pixels(frames), **self.prompts(instruction, regime, label)}
