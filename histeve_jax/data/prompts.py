"""Qwen2.5-VL prompts as model inputs: the numpy equivalent of ``transformers.Qwen2_5_VLProcessor``.

Chat messages are rendered exactly as Qwen2.5-VL's chat template renders them, tokenised once, and every
``<|image_pad|>`` / ``<|video_pad|>`` is expanded to ``t*h*w / merge**2`` copies from its grid. Expanding
ids rather than text gives the same ids as the reference (the pads are special tokens, which the tokenizer
splits out before BPE) without tokenising thousands of pad strings.

For training, assistant turns may carry token ids (the policy's action tokens) instead of text; the
returned ``assistant_mask`` marks the positions the model should learn to produce: each assistant turn's
content and its closing ``<|im_end|>``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from histeve_jax.data import image_processing
from histeve_jax.data.image_processing import IMAGE_CONFIG, VIDEO_CONFIG, VisionPreprocessConfig
from histeve_jax.data.tokenizer import (
    DEFAULT_SYSTEM_PROMPT,
    IM_END,
    IM_END_ID,
    IM_START,
    IMAGE_PAD_ID,
    IMAGE_TOKEN,
    PAD_ID,
    VIDEO_PAD_ID,
    VIDEO_TOKEN,
    VISION_END,
    VISION_START,
    load_qwen_tokenizer,
)

Message = Mapping[str, Any]

# Keys that depend on the sequence (padded by pad_batch) and keys concatenated over a batch.
SEQUENCE_KEYS = ("input_ids", "attention_mask", "assistant_mask", "mm_token_type_ids")
VISION_KEYS = (
    "pixel_values",
    "image_grid_thw",
    "pixel_values_videos",
    "video_grid_thw",
    "second_per_grid_ts",
)


class _Pieces:
    """A prompt under construction: text runs and id runs, each flagged assistant or not."""

    def __init__(self) -> None:
        self.parts: list[tuple[str | np.ndarray, bool]] = []

    def text(self, text: str, assistant: bool = False) -> None:
        if text:
            self.parts.append((text, assistant))

    def ids(self, ids: Sequence[int] | np.ndarray, assistant: bool) -> None:
        ids = np.asarray(ids)
        if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"token ids must be a 1-D integer sequence, got {ids.dtype} {ids.shape}")
        if ids.size:
            self.parts.append((ids.astype(np.int64), assistant))


def _is_image(item: Mapping[str, Any]) -> bool:
    # The template's own test: content['type'] == 'image' or 'image' in content or 'image_url' in content.
    return item.get("type") == "image" or "image" in item or "image_url" in item


def _is_video(item: Mapping[str, Any]) -> bool:
    return item.get("type") == "video" or "video" in item


def observation_messages(frames: Sequence[Any], instruction: str) -> list[dict[str, Any]]:
    """The policy's chat messages for one observation: one user turn, the frames (oldest first), then the
    instruction. Training samples (``data.pipeline``) and acting (``models.vla``) both build prompts here."""
    content: list[dict[str, Any]] = [{"type": "image", "image": f} for f in frames]
    content.append({"type": "text", "text": instruction})
    return [{"role": "user", "content": content}]


class QwenVLProcessor:
    """Tokenizer + image/video preprocessing for one sample, as ``Qwen2_5_VLProcessor`` builds it.

    ``image_config`` / ``video_config`` set min/max pixels and the patch geometry; the defaults are the
    transformers classes' defaults.
    """

    def __init__(
        self,
        tokenizer: Any = None,
        image_config: VisionPreprocessConfig = IMAGE_CONFIG,
        video_config: VisionPreprocessConfig = VIDEO_CONFIG,
    ) -> None:
        self.tokenizer = tokenizer if tokenizer is not None else load_qwen_tokenizer()
        self.image_config = image_config
        self.video_config = video_config
        # The tokenizers-library object: one call gives ids and character offsets.
        self._backend = self.tokenizer.backend_tokenizer

    # ---------------------------------------------------------------- rendering

    def render(
        self,
        messages: Sequence[Message],
        *,
        add_generation_prompt: bool = False,
        add_vision_id: bool = False,
    ) -> str:
        """The chat-template text of ``messages`` (token-id content rendered as nothing, as the template)."""
        pieces, _, _ = self._render(messages, add_generation_prompt, add_vision_id)
        return "".join(part for part, _ in pieces.parts if isinstance(part, str))

    def _render(
        self, messages: Sequence[Message], add_generation_prompt: bool, add_vision_id: bool
    ) -> tuple[_Pieces, list[Any], list[tuple[Any, float | None]]]:
        """Pieces of the prompt, and the images and (video, fps) pairs in the order they appear.

        Mirrors tokenizer.QWEN2_5_VL_CHAT_TEMPLATE line for line; tests check the two agree.
        """
        pieces = _Pieces()
        images: list[Any] = []
        videos: list[tuple[Any, float | None]] = []
        for index, message in enumerate(messages):
            role = message.get("role")
            if role not in ("system", "user", "assistant", "tool"):
                raise ValueError(f"messages[{index}]: unknown role {role!r}")
            if index == 0 and role != "system":
                pieces.text(f"{IM_START}system\n{DEFAULT_SYSTEM_PROMPT}{IM_END}\n")
            pieces.text(f"{IM_START}{role}\n")
            assistant = role == "assistant"
            content = message.get("content")
            if isinstance(content, str):
                pieces.text(content, assistant)
            elif isinstance(content, Sequence):
                for item_index, item in enumerate(content):
                    if not isinstance(item, Mapping):
                        raise ValueError(
                            f"messages[{index}].content[{item_index}] must be a dict, got {item!r}"
                        )
                    if _is_image(item):
                        if add_vision_id:
                            pieces.text(f"Picture {len(images) + 1}: ", assistant)
                        pieces.text(f"{VISION_START}{IMAGE_TOKEN}{VISION_END}", assistant)
                        images.append(item.get("image", item.get("image_url")))
                    elif _is_video(item):
                        if add_vision_id:
                            pieces.text(f"Video {len(videos) + 1}: ", assistant)
                        pieces.text(f"{VISION_START}{VIDEO_TOKEN}{VISION_END}", assistant)
                        videos.append((item.get("video"), item.get("fps")))
                    elif "text" in item:
                        pieces.text(item["text"], assistant)
                    elif item.get("type") == "token_ids":
                        pieces.ids(item["ids"], assistant)
                    else:
                        raise ValueError(
                            f"messages[{index}].content[{item_index}]: unknown item {sorted(item)}"
                        )
            else:
                raise ValueError(f"messages[{index}].content must be a str or a list, got {type(content)}")
            # The closing <|im_end|> of an assistant turn is a target too: the model must learn to stop.
            pieces.text(IM_END, assistant)
            pieces.text("\n")
        if add_generation_prompt:
            pieces.text(f"{IM_START}assistant\n")
        return pieces, images, videos

    # ---------------------------------------------------------------- tokenising

    def _tokenize(self, pieces: _Pieces) -> tuple[np.ndarray, np.ndarray]:
        """(ids [T] int64, assistant mask [T] bool); adjacent text runs are tokenised together."""
        ids_out: list[np.ndarray] = []
        mask_out: list[np.ndarray] = []
        run: list[tuple[str, bool]] = []

        def flush() -> None:
            if not run:
                return
            text = "".join(t for t, _ in run)
            encoding = self._backend.encode(text, add_special_tokens=False)
            ids = np.asarray(encoding.ids, dtype=np.int64)
            mask = np.zeros(len(ids), dtype=bool)
            if any(a for _, a in run):
                offsets = np.asarray(encoding.offsets, dtype=np.int64).reshape(-1, 2)
                position = 0
                for t, a in run:
                    # A token that overlaps an assistant span is a target. BPE can merge across the
                    # span's start only when the content begins with whitespace ("\n" + "\n...").
                    if a:
                        mask |= (offsets[:, 0] < position + len(t)) & (offsets[:, 1] > position)
                    position += len(t)
            ids_out.append(ids)
            mask_out.append(mask)
            run.clear()

        for part, assistant in pieces.parts:
            if isinstance(part, str):
                run.append((part, assistant))
            else:
                flush()
                ids_out.append(part)
                mask_out.append(np.full(len(part), assistant))
        flush()
        if not ids_out:
            return np.zeros(0, np.int64), np.zeros(0, bool)
        return np.concatenate(ids_out), np.concatenate(mask_out)

    def _encode(
        self, pieces: _Pieces, images: Sequence[Any], videos: Sequence[tuple[Any, float | None]]
    ) -> dict[str, np.ndarray]:
        ids, assistant_mask = self._tokenize(pieces)
        out: dict[str, np.ndarray] = {}
        repeats = np.ones(len(ids), dtype=np.int64)
        for pad_id, kind, items in ((IMAGE_PAD_ID, "image", images), (VIDEO_PAD_ID, "video", videos)):
            positions = np.flatnonzero(ids == pad_id)
            if len(positions) != len(items):
                token = IMAGE_TOKEN if kind == "image" else VIDEO_TOKEN
                raise ValueError(
                    f"the prompt has {len(positions)} {token} tokens but {len(items)} {kind}s were given"
                )
            if not items:
                continue
            if kind == "image":
                vision = image_processing.process_images(list(items), self.image_config)
                grids, merge = vision["image_grid_thw"], self.image_config.merge_size
            else:
                frames = [video for video, _ in items]
                vision = image_processing.process_videos(frames, [fps for _, fps in items], self.video_config)
                grids, merge = vision["video_grid_thw"], self.video_config.merge_size
            repeats[positions] = grids.prod(axis=1) // merge**2
            out.update(vision)
        ids = np.repeat(ids, repeats)
        assistant_mask = np.repeat(assistant_mask, repeats)
        mm_token_type_ids = np.zeros(len(ids), dtype=np.int32)
        mm_token_type_ids[ids == IMAGE_PAD_ID] = 1
        mm_token_type_ids[ids == VIDEO_PAD_ID] = 2
        return {
            "input_ids": ids.astype(np.int32),
            "attention_mask": np.ones(len(ids), dtype=np.int32),
            "assistant_mask": assistant_mask,
            "mm_token_type_ids": mm_token_type_ids,
            **out,
        }

    # ---------------------------------------------------------------- public entry points

    def __call__(
        self,
        text: str,
        images: Sequence[Any] | None = None,
        videos: Sequence[np.ndarray] | None = None,
        video_fps: float | Sequence[float | None] | None = None,
    ) -> dict[str, np.ndarray]:
        """One sample from text with ``<|image_pad|>`` / ``<|video_pad|>`` placeholders, as the HF processor.

        Returns ``input_ids`` [T] int32, ``attention_mask`` [T], ``mm_token_type_ids`` [T] (0 text,
        1 image, 2 video), ``assistant_mask`` [T] (all False here), and the vision fields of
        ``image_processing.process_images`` / ``process_videos`` for the images / videos given.
        """
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text)}")
        images = list(images or [])
        videos = list(videos or [])
        if video_fps is None or isinstance(video_fps, (int, float)):
            video_fps = [video_fps] * len(videos)
        if len(video_fps) != len(videos):
            raise ValueError(f"got {len(video_fps)} video_fps values for {len(videos)} videos")
        pieces = _Pieces()
        pieces.text(text)
        return self._encode(pieces, images, list(zip(videos, video_fps, strict=True)))

    def from_messages(
        self,
        messages: Sequence[Message],
        *,
        target_ids: Sequence[int] | np.ndarray | None = None,
        append_im_end: bool = True,
        add_generation_prompt: bool | None = None,
        add_vision_id: bool = False,
    ) -> dict[str, np.ndarray]:
        """One sample from chat messages; images and videos are given inside the messages.

        Content items: ``{"type": "text", "text": ...}``, ``{"type": "image", "image": HxWx3 uint8}``,
        ``{"type": "video", "video": FxHxWx3 uint8, "fps": float}`` and, in assistant turns,
        ``{"type": "token_ids", "ids": [...]}``. With ``target_ids`` the prompt ends with the generation
        prompt, then those ids (and ``<|im_end|>`` if ``append_im_end``) as the assistant's reply; they are
        marked in ``assistant_mask`` like every assistant turn. ``add_generation_prompt`` defaults to True
        when ``target_ids`` is given or the last message is not the assistant's.
        """
        if not messages:
            raise ValueError("from_messages: no messages")
        if add_generation_prompt is None:
            add_generation_prompt = target_ids is not None or messages[-1].get("role") != "assistant"
        if target_ids is not None and not add_generation_prompt:
            raise ValueError("target_ids are the assistant's reply and need add_generation_prompt=True")
        pieces, images, videos = self._render(messages, add_generation_prompt, add_vision_id)
        if target_ids is not None:
            pieces.ids(target_ids, assistant=True)
            if append_im_end:
                pieces.ids([IM_END_ID], assistant=True)
        return self._encode(pieces, images, videos)


def pad_batch(
    samples: Sequence[Mapping[str, np.ndarray]],
    length: int | None = None,
    *,
    side: str = "right",
    pad_id: int = PAD_ID,
) -> dict[str, np.ndarray]:
    """Stack samples to [B, length], padding ``input_ids`` with ``pad_id`` and the masks with 0.

    Vision fields are concatenated in sample order, as the HF processor batches them. ``length`` defaults
    to the longest sample; a longer sample raises (truncating would cut image tokens from their patches).
    """
    if side not in ("left", "right"):
        raise ValueError(f"side must be 'left' or 'right', got {side!r}")
    if not samples:
        raise ValueError("pad_batch: no samples")
    lengths = [len(s["input_ids"]) for s in samples]
    length = max(lengths) if length is None else length
    if max(lengths) > length:
        raise ValueError(f"pad_batch: a sample has {max(lengths)} tokens, more than length={length}")
    batch: dict[str, np.ndarray] = {}
    for key in SEQUENCE_KEYS:
        if not all(key in s for s in samples):
            continue
        dtype = samples[0][key].dtype
        out = np.full((len(samples), length), pad_id if key == "input_ids" else 0, dtype=dtype)
        for row, sample in enumerate(samples):
            n = len(sample[key])
            if side == "right":
                out[row, :n] = sample[key]
            else:
                out[row, length - n :] = sample[key]
        batch[key] = out
    for key in VISION_KEYS:
        parts = [s[key] for s in samples if key in s]
        if parts:
            batch[key] = np.concatenate(parts, axis=0)
    return batch
