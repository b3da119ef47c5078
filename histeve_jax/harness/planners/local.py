"""The local planner: a Flax Qwen2.5-VL (any ``save_pretrained`` directory) that answers chat messages with
JSON-schema-constrained decoding (``json_constraint``), in process (``LocalPlanner``) or served over the
OpenAI-compatible HTTP API (``harness.server``, ``python -m experiments.serve``).

``LocalModel.chat`` takes chat-completions messages (string content, or ``text`` and ``image_url`` items
with base64 data URLs), renders them with Qwen2.5-VL's chat template (``data.prompts.QwenVLProcessor``;
images resized to ``image_pixels``), left-pads the prompt to a multiple of ``PROMPT_BUCKET`` tokens so few
shapes compile, and samples until ``<|im_end|>`` or ``max_tokens``.
"""

from __future__ import annotations

import base64
import dataclasses
import io
import json
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from histeve_jax.harness.planners.base import (
    PlannerUnavailable,
    PlanningContext,
    PlanResult,
    TokenCount,
    plan_with_retries,
)

PROMPT_BUCKET = 64


@dataclasses.dataclass
class ChatOutput:
    """One completion."""

    text: str
    finish_reason: str  # "stop" | "length"
    prompt_tokens: int
    completion_tokens: int


def decode_image_url(url: str) -> np.ndarray:
    """An HxWx3 uint8 array from a ``data:image/...;base64,`` URL (the only kind a local model can read)."""
    from PIL import Image

    if not url.startswith("data:image/") or ";base64," not in url:
        raise ValueError("image_url: only base64 data URLs (data:image/...;base64,...) are supported here")
    try:
        raw = base64.b64decode(url.split(";base64,", 1)[1], validate=True)
        return np.asarray(Image.open(io.BytesIO(raw)).convert("RGB"))
    except Exception as e:  # noqa: BLE001 (binascii, PIL: any undecodable image is the same bad input)
        raise ValueError(f"image_url: not a decodable image: {e}") from None


def processor_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Chat-completions messages -> ``QwenVLProcessor.from_messages`` messages; ValueError naming bad ones."""
    out = []
    for i, m in enumerate(messages):
        role, content = m.get("role"), m.get("content")
        if role not in ("system", "user", "assistant"):
            raise ValueError(f"messages[{i}].role: must be system, user or assistant, got {role!r}")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise ValueError(f"messages[{i}].content: must be a string or a list of parts")
        parts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, Mapping) else None
            if kind == "text":
                parts.append({"type": "text", "text": str(part.get("text", ""))})
            elif kind == "image_url":
                url = part.get("image_url", {})
                url = url.get("url", "") if isinstance(url, Mapping) else str(url)
                try:
                    parts.append({"type": "image", "image": decode_image_url(url)})
                except ValueError as e:
                    raise ValueError(f"messages[{i}].content[{j}].{e}") from None
            else:
                raise ValueError(f"messages[{i}].content[{j}].type: must be text or image_url, got {kind!r}")
        out.append({"role": role, "content": parts})
    return out


class LocalModel:
    """A Qwen2.5-VL checkpoint ready to answer chats (keep one; calls are serialised by a lock)."""

    def __init__(self, path: str, *, tokenizer: Any = None, image_pixels: int = 28 * 28 * 4, name: str = ""):
        from histeve_jax.data.image_processing import VisionPreprocessConfig
        from histeve_jax.data.prompts import QwenVLProcessor
        from histeve_jax.data.tokenizer import load_qwen_tokenizer
        from histeve_jax.models.qwen2_5_vl import Sampler, load_hf

        if not (Path(path) / "config.json").is_file():
            raise FileNotFoundError(f"{path}: not a Hugging Face model directory (no config.json)")
        self.path, self.name = path, name or Path(path).name
        self.model = load_hf(path)
        self.sampler = Sampler(self.model)
        has_tok = (Path(path) / "tokenizer.json").is_file()
        self.tokenizer = tokenizer or load_qwen_tokenizer(path if has_tok else None)
        self.processor = QwenVLProcessor(self.tokenizer, image_config=VisionPreprocessConfig(
            min_pixels=image_pixels, max_pixels=image_pixels))
        self.vocab_size = int(self.model.config.text.vocab_size)
        self._constraints: dict[str, Any] = {}
        self._lock = threading.Lock()

    def constraint(self, schema: Any) -> Any:
        """The (cached) decoding constraint of a JSON Schema; UnsupportedSchema outside the subset."""
        from histeve_jax.data.tokenizer import IM_END_ID
        from histeve_jax.harness.json_constraint import schema_constraint

        key = json.dumps(schema, sort_keys=True)
        if key not in self._constraints:
            self._constraints[key] = schema_constraint(schema, self.tokenizer, IM_END_ID, self.vocab_size)
        return self._constraints[key]

    def inputs(self, messages: Sequence[Mapping[str, Any]]) -> dict[str, np.ndarray]:
        """The prompt (generation prompt appended), left-padded to the bucket."""
        from histeve_jax.data.tokenizer import IMAGE_PAD_ID, PAD_ID

        sample = self.processor.from_messages(processor_messages(messages), add_generation_prompt=True)
        ids = sample["input_ids"].astype(np.int32)
        if "pixel_values" in sample and int(self.model.config.image_token_id) != IMAGE_PAD_ID:
            raise ValueError(f"{self.path}: the model's image_token_id {self.model.config.image_token_id} is "
                             f"not the tokenizer's {IMAGE_PAD_ID}; it cannot take images")
        if int(ids.max()) >= self.vocab_size:
            raise ValueError(f"{self.path}: the prompt has token ids up to {int(ids.max())}, beyond the "
                             f"model's vocabulary of {self.vocab_size}")
        pad = -len(ids) % PROMPT_BUCKET
        out = {"input_ids": np.pad(ids, (pad, 0), constant_values=PAD_ID)[None],
               "attention_mask": np.pad(np.ones(len(ids), np.int32), (pad, 0))[None], "n": len(ids)}
        if "pixel_values" in sample:
            out["pixel_values"] = sample["pixel_values"].astype(np.float32)
            out["image_grid_thw"] = sample["image_grid_thw"]
        return out

    def chat(self, messages: Sequence[Mapping[str, Any]], *, schema: Any = None, max_tokens: int = 128,
             temperature: float = 0.0, seed: int = 0) -> ChatOutput:
        """One completion; ``schema`` (a JSON Schema) constrains it. ValueError for bad input."""
        import jax

        from histeve_jax.data.tokenizer import ENDOFTEXT_ID, IM_END_ID, PAD_ID
        from histeve_jax.models.qwen2_5_vl import SamplingOptions

        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"max_tokens: must be a positive integer, got {max_tokens!r}")
        constraint = self.constraint(schema) if schema is not None else None
        x = self.inputs(messages)
        opts = SamplingOptions(max_new_tokens=max_tokens, temperature=float(temperature),
                               stop_token_ids=(IM_END_ID, ENDOFTEXT_ID), pad_token_id=PAD_ID)
        with self._lock:
            out = self.sampler(x["input_ids"], x["attention_mask"], options=opts,
                               pixel_values=x.get("pixel_values"), image_grid_thw=x.get("image_grid_thw"),
                               rng=jax.random.key(seed), constraint=constraint)
        n = int(out.lengths[0])
        toks = np.asarray(out.tokens[0, :n]).tolist()
        stopped = bool(toks) and toks[-1] in (IM_END_ID, ENDOFTEXT_ID)
        text = self.tokenizer.decode(toks[:-1] if stopped else toks, skip_special_tokens=False)
        return ChatOutput(text, "stop" if stopped else "length", x["n"], n)


class LocalPlanner:
    """The planner on an in-process ``LocalModel`` (the same prompt, validation and retries as the
    endpoint planner)."""

    def __init__(self, model: LocalModel, *, max_attempts: int = 3, max_tokens: int = 128,
                 temperature: float = 0.0, max_frames: int = 2):
        self.model, self.max_attempts, self.max_tokens = model, max_attempts, max_tokens
        self.temperature, self.max_frames = temperature, max_frames
        self.name = f"local:{model.name}"
        self._calls = 0
        self.tokens = TokenCount()

    def complete(self, messages: list[dict[str, Any]], response_format: dict[str, Any]) -> tuple[str, str]:
        self._calls += 1
        try:
            out = self.model.chat(messages, schema=response_format["json_schema"]["schema"],
                                  max_tokens=self.max_tokens, temperature=self.temperature, seed=self._calls)
        except ValueError as e:
            raise PlannerUnavailable(f"local planner {self.model.name} failed: {e}") from None
        self.tokens.add(out.prompt_tokens, out.completion_tokens)
        return out.text, out.finish_reason

    def plan(self, ctx: PlanningContext) -> PlanResult:
        self.tokens = TokenCount()
        return self.tokens.into(plan_with_retries(
            self.complete, ctx, name=self.name, max_attempts=self.max_attempts, max_tokens=self.max_tokens,
            max_frames=self.max_frames))
