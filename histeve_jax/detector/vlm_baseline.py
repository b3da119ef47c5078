"""A prompted general-purpose VLM as a completion detector (the paper's baselines), through any
OpenAI-compatible chat-completions endpoint: the query's frames and the instruction, asked yes or no."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from histeve_jax.eval.suites.vlm_judge import JudgeSpec, image_url

PROMPT = ("These are first-person frames of a game, oldest first; the last is the current one. "
          "Instruction given to the player: {instruction}\n"
          "Has the instruction been completed in the last frame? Answer with one word: yes or no.")


class PromptedVLM:
    """``vlm(frames, instruction) -> 1.0 (yes), 0.0 (no) or None (no usable answer)``."""

    def __init__(self, spec: JudgeSpec):
        from openai import OpenAI

        reason = spec.missing()
        if reason:
            raise ValueError(reason)
        self.spec = spec.resolved()
        self.client = OpenAI(base_url=self.spec.base_url or None, api_key=self.spec.api_key,
                             timeout=self.spec.timeout_s, max_retries=self.spec.connection_retries)

    def __call__(self, frames: Sequence[bytes | np.ndarray], instruction: str) -> float | None:
        content = [{"type": "image_url", "image_url": {"url": image_url(f)}} for f in frames]
        content.append({"type": "text", "text": PROMPT.format(instruction=instruction)})
        out = self.client.chat.completions.create(model=self.spec.model, temperature=0.0,
                                                  messages=[{"role": "user", "content": content}])
        text = (out.choices[0].message.content or "").strip().lower() if out.choices else ""
        if text.startswith("yes"):
            return 1.0
        if text.startswith("no"):
            return 0.0
        return None
