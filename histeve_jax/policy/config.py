"""The policy's static description: base Qwen2.5-VL shape, action codebook and token ids, one observation.

The action tokens (``histeve_jax.actions.tokens``) take ids ``action_token_base ..``, right after the
tokenizer's own ids. Qwen2.5-VL's 3B/7B tables have spare rows there (151936 / 152064 > 151665 + 103), so
nothing is resized; a smaller table grows (:attr:`PolicyConfig.vocab_size`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from histeve_jax.actions.tokens import ActionVocab, token_strings
from histeve_jax.data.tokenizer import NUM_TOKENIZER_IDS
from histeve_jax.models.qwen2_5_vl import Qwen2_5_VLConfig
from histeve_jax.models.qwen2_5_vl import tiny as tiny_base


@dataclasses.dataclass(frozen=True)
class PolicyConfig:
    """The policy: base Qwen2.5-VL shape, action codebook and token ids, and what one observation is."""

    base: Qwen2_5_VLConfig
    codebook: str = "vpt"
    # First action token id: the Qwen tokenizer's length before add_action_tokens (its own ids end there).
    action_token_base: int = NUM_TOKENIZER_IDS
    history_frames: int = 0  # frames before the current one in each prompt
    image_size: tuple[int, int] = (56, 56)  # (H, W) of every frame, multiples of 28
    max_targets: int = 16  # target positions per sample at which the loss computes logits
    row_init_noise: float = 0.02  # std of the action rows' noise, relative to the rows' per-dim std
    # The paper's two GUI ideas, on by default; off, they are the ablation's rows: ``rs_norm=False`` gives
    # every decoder pre-norm one scale (norm_regimes 1), ``dual_mouse=False`` writes GUI cursor motion with
    # the camera's tokens and no regime type token (``ActionVocab.dual_mouse``).
    rs_norm: bool = True
    dual_mouse: bool = True

    def __post_init__(self):
        if any(int(s) % 28 for s in self.image_size):
            raise ValueError(f"PolicyConfig.image_size {self.image_size} must be multiples of 28")
        if self.max_targets < self.vocab.max_len + 1:
            raise ValueError(f"PolicyConfig.max_targets={self.max_targets} < one action + <|im_end|>")

    @property
    def vocab(self) -> ActionVocab:
        return ActionVocab.contiguous(self.codebook, self.action_token_base, dual_mouse=self.dual_mouse)

    def check_tokenizer(self, tokenizer: Any) -> None:
        """Raise unless ``tokenizer`` (after ``add_action_tokens``) gives the action tokens these ids."""
        got = ActionVocab.from_tokenizer(tokenizer, self.codebook).ids
        if not np.array_equal(got, self.vocab.ids):
            raise ValueError(
                f"tokenizer action ids start at {int(got[0])}, PolicyConfig.action_token_base is "
                f"{self.action_token_base}"
            )

    @property
    def vocab_size(self) -> int:
        """Rows of the policy's tables: the base's, or more if the action tokens do not fit."""
        return max(self.base.text.vocab_size, self.action_token_base + len(token_strings(self.codebook)))

    @property
    def model_config(self) -> Qwen2_5_VLConfig:
        return self.base.replace(norm_regimes=self.norm_regimes, text={"vocab_size": self.vocab_size})

    @property
    def norm_regimes(self) -> int:
        """Scale rows of every decoder pre-norm: 2 with RS-Norm (NG, GUI), 1 shared."""
        return 2 if self.rs_norm else 1

    @property
    def num_frames(self) -> int:
        return self.history_frames + 1

    @property
    def patches_per_image(self) -> int:
        return (self.image_size[0] // 14) * (self.image_size[1] // 14)

    def image_grid(self, n_images: int) -> tuple[tuple[int, int, int], ...]:
        """The (static) grid of ``n_images`` frames."""
        return ((1, self.image_size[0] // 14, self.image_size[1] // 14),) * n_images


def tiny_config(**kw: Any) -> PolicyConfig:
    """The tiny random policy of tests and CPU benchmarks (vocab 320: the action rows are appended)."""
    base = kw.pop("base", None) or tiny_base()
    return PolicyConfig(base=base, action_token_base=kw.pop("action_token_base", base.text.vocab_size), **kw)
