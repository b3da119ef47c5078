"""HiSTEVE's policy as a transformers model: Qwen2.5-VL whose decoder pre-norms hold both RS-Norm rows.

This file is copied into every exported directory and loaded there by
``AutoModelForImageTextToText.from_pretrained(dir, trust_remote_code=True)``; it imports only torch and
transformers (no JAX, nothing from histeve_jax).

* ``HiSteveConfig``: ``Qwen2_5_VLConfig`` plus ``norm_regimes`` (2) and the ``histeve`` metadata block.
* ``HiSteveRSNorm``: RMSNorm with a [regimes, d] scale; row ``regime[b]`` scales sequence b (row 0 NG,
  row 1 GUI), exactly as ``histeve_jax.models.qwen2_5_vl.layers.RMSNorm`` with ``regimes > 1``.
* ``HiSteveForConditionalGeneration``: ``Qwen2_5_VLForConditionalGeneration`` whose every decoder layer's
  ``input_layernorm`` and ``post_attention_layernorm`` are RS-Norms; ``forward(..., regime=[B] long)``.
  ``generate(..., regime=...)`` passes the regime to every step (it is a forward argument, so generate
  keeps it and expands it with the batch). Without ``regime`` every row uses row 0 (NG), as ours does.
  ``hidden_states(..., regime=...)``: the final-layer states (what the completion detector reads).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration


class HiSteveConfig(Qwen2_5_VLConfig):
    """Qwen2.5-VL's config with the RS-Norm row count and HiSTEVE's export metadata."""

    model_type = "histeve"
    norm_regimes: int = 2
    histeve: dict | None = None


class _RegimeSlot:
    """The current forward's per-sequence regime, shared by all RS-Norms of one model (set by forward)."""

    def __init__(self) -> None:
        self.value: torch.Tensor | None = None


class HiSteveRSNorm(nn.Module):
    """RMSNorm with one scale row per regime, picked per sequence from the model's regime slot; with one
    regime (a policy trained without RS-Norm) a plain [d] scale that every regime shares."""

    def __init__(self, hidden_size: int, eps: float, regimes: int, slot: _RegimeSlot):
        super().__init__()
        shape = (regimes, hidden_size) if regimes > 1 else (hidden_size,)
        self.weight = nn.Parameter(torch.ones(shape))
        self.variance_epsilon = eps
        self._slot = slot

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        x = hidden_states.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        if self.weight.dim() == 1:
            return self.weight * x.to(input_dtype)
        B = hidden_states.shape[0]
        regime = self._slot.value
        if regime is None:
            regime = torch.zeros(B, dtype=torch.long, device=hidden_states.device)
        if regime.shape != (B,):
            raise ValueError(f"HiSTEVE: regime has shape {tuple(regime.shape)}, the batch has {B} rows")
        w = self.weight[regime].view(B, *([1] * (hidden_states.dim() - 2)), -1)
        return w * x.to(input_dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"


class HiSteveForConditionalGeneration(Qwen2_5_VLForConditionalGeneration):
    """Qwen2.5-VL with RS-Norm decoder pre-norms; ``forward``/``generate`` take ``regime`` ([B] long)."""

    config_class = HiSteveConfig

    def __init__(self, config: HiSteveConfig):
        super().__init__(config)
        self._regime = _RegimeSlot()
        t = config.text_config
        for layer in self.model.language_model.layers:
            layer.input_layernorm = HiSteveRSNorm(t.hidden_size, t.rms_norm_eps, config.norm_regimes,
                                                  self._regime)
            layer.post_attention_layernorm = HiSteveRSNorm(t.hidden_size, t.rms_norm_eps,
                                                           config.norm_regimes, self._regime)
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, HiSteveRSNorm):  # as the base's RMSNorms: ones (then the checkpoint's rows)
            with torch.no_grad():
                module.weight.fill_(1.0)
            return
        super()._init_weights(module)

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache=None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        pixel_values: torch.Tensor | None = None,
        pixel_values_videos: torch.Tensor | None = None,
        image_grid_thw: torch.LongTensor | None = None,
        video_grid_thw: torch.LongTensor | None = None,
        mm_token_type_ids: torch.IntTensor | None = None,
        second_per_grid_ts: torch.Tensor | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        mm_encoder_outputs: dict | None = None,
        regime: torch.LongTensor | None = None,
        **kwargs,
    ):
        """Qwen2.5-VL's forward; ``regime`` [B] (0 = NG, 1 = GUI) picks each sequence's RS-Norm row."""
        self._regime.value = self._check_regime(regime)
        try:
            return super().forward(
                input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, cache=cache,
                inputs_embeds=inputs_embeds, labels=labels, use_cache=use_cache, pixel_values=pixel_values,
                pixel_values_videos=pixel_values_videos, image_grid_thw=image_grid_thw,
                video_grid_thw=video_grid_thw, mm_token_type_ids=mm_token_type_ids,
                second_per_grid_ts=second_per_grid_ts, logits_to_keep=logits_to_keep,
                mm_encoder_outputs=mm_encoder_outputs, **kwargs,
            )
        finally:
            self._regime.value = None

    def hidden_states(self, input_ids: torch.LongTensor | None = None, *,
                      regime: torch.LongTensor | None = None, **kwargs) -> torch.Tensor:
        """Final-layer hidden states [B, T, E] (after the final norm, no lm_head) in ``regime``'s rows;
        keyword arguments as ``Qwen2_5_VLModel.forward`` (e.g. ``mm_encoder_outputs`` for given image
        embeddings). The completion detector's cross-attention context."""
        self._regime.value = self._check_regime(regime)
        try:
            return self.model(input_ids=input_ids, **kwargs).last_hidden_state
        finally:
            self._regime.value = None

    def _check_regime(self, regime: torch.LongTensor | None) -> torch.Tensor | None:
        if regime is None:
            return None
        regime = torch.as_tensor(regime, dtype=torch.long, device=self.lm_head.weight.device).reshape(-1)
        if int(regime.min()) < 0 or int(regime.max()) >= max(self.config.norm_regimes, 2):
            raise ValueError(f"HiSTEVE: regime values {regime.tolist()} outside 0..1 (NG, GUI)")
        return regime


__all__ = ["HiSteveConfig", "HiSteveForConditionalGeneration", "HiSteveRSNorm"]
