"""HiSTEVE's completion detector in PyTorch, reading the exported policy it was trained beside.

This file is copied into an exported directory's ``detector/`` sub-directory (with its ``config.json`` and
safetensors) and loaded there with ``AutoModel.from_pretrained(f"{dir}/detector", trust_remote_code=True)``;
it imports only torch and transformers (no JAX, nothing from histeve_jax). It is the port of
``histeve_jax.detector`` (``model.Detector`` and ``coupled.CoupledDetector``)::

    import sys; sys.path.insert(0, f"{export_dir}/detector")
    from modeling_histeve_detector import load_coupled_detector
    coupled = load_coupled_detector(export_dir)     # the policy from export_dir, the detector from detector/
    p = coupled.probability(**batch)                 # [B] P(the instruction is complete)

* ``HiSteveDetectorConfig``: the detector decoder's Qwen2.5-VL config (its vision part only gives M-RoPE's
  merge size: frames are encoded by the policy's tower) plus ``policy_hidden_size``,
  ``cross_attention_every``, ``num_frames``, ``image_size`` and ``frame_slots`` (the query's frame slots
  as steps before the query, each clamped to the invocation's first step, so the offset 1000000 of an
  anchored detector is that first frame; and which of them each model reads), and ``detail_size``
  (``[H, W]`` of the detail crops the detector also reads, after its frames: of the slots
  ``frame_slots["detail"]``, cut and resized by the caller; ``pixel_values`` holds them after the frames).
* ``HiSteveDetector``: transformers' ``Qwen2_5_VLTextModel`` (embedding, decoder layers, M-RoPE rotary
  embedding, final norm) run layer by layer with a ``HiSteveCrossAttention`` block after every n-th layer;
  image embeddings and the policy's states projected to its width where the widths differ; the last real
  token's state to 2 logits. ``forward(input_ids, attention_mask, image_embeds, context, context_mask)``.
* ``HiSteveCoupledDetector``: the exported policy (``HiSteveForConditionalGeneration``) and the detector;
  ``logits(pixel_values, input_ids, attention_mask, policy_input_ids, policy_attention_mask, regime)``
  takes ``CoupledDetector.logits``'s batch: every frame slot encoded once by the policy's vision tower, the
  policy's final-layer hidden states of its prompt (its RS-Norm row ``regime``) the cross-attention context.
"""

from __future__ import annotations

import os

import torch
from torch import nn
from transformers import AutoModel, AutoModelForImageTextToText, Qwen2_5_VLConfig
from transformers.masking_utils import create_causal_mask
from transformers.modeling_outputs import BaseModelOutputWithPooling
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
    Qwen2_5_VLModel,
    Qwen2_5_VLPreTrainedModel,
    Qwen2_5_VLRMSNorm,
    Qwen2_5_VLTextModel,
)

NUM_CLASSES = 2  # incomplete, complete
SUBFOLDER = "detector"


class HiSteveDetectorConfig(Qwen2_5_VLConfig):
    """The detector decoder's Qwen2.5-VL config plus what it reads of the policy and its query's frames."""

    model_type = "histeve_detector"
    policy_hidden_size: int = 0
    cross_attention_every: int = 4
    num_frames: int = 4
    policy_num_frames: int = 2
    image_size: list | None = None  # [H, W] of every frame
    # {"offsets": [...], "detector": [slot, ...], "policy": [slot, ...], "detail": [slot, ...]}
    frame_slots: dict | None = None
    detail_size: list | None = None  # [H, W] of each detail crop; None: the detector reads none
    histeve: dict | None = None


class HiSteveCrossAttention(nn.Module):
    """``z + o(MHA(RMSNorm(z), h, h))``: the decoder's head count, no bias, no RoPE (the policy's states
    carry their positions); a context position whose mask is 0 is not attended."""

    def __init__(self, config: HiSteveDetectorConfig):
        super().__init__()
        t = config.text_config
        self.heads, self.head_dim = t.num_attention_heads, t.hidden_size // t.num_attention_heads
        width = self.heads * self.head_dim
        self.norm = Qwen2_5_VLRMSNorm(t.hidden_size, eps=t.rms_norm_eps)
        self.q_proj = nn.Linear(t.hidden_size, width, bias=False)
        self.k_proj = nn.Linear(t.hidden_size, width, bias=False)
        self.v_proj = nn.Linear(t.hidden_size, width, bias=False)
        self.o_proj = nn.Linear(width, t.hidden_size, bias=False)

    def forward(self, z: torch.Tensor, context: torch.Tensor, context_mask: torch.Tensor) -> torch.Tensor:
        """z [B, T, E], context [B, S, E], context_mask [B, S] (1 = a real token) -> [B, T, E]."""
        B, T, _ = z.shape
        split = lambda x: x.view(B, x.shape[1], self.heads, self.head_dim).transpose(1, 2)  # [B, H, *, D]
        q = split(self.q_proj(self.norm(z)))
        k, v = split(self.k_proj(context)), split(self.v_proj(context))
        s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * self.head_dim**-0.5
        # The most negative float, not -inf, as the JAX attention: a row with no context stays finite.
        s = s.masked_fill(~context_mask.bool()[:, None, None, :], torch.finfo(torch.float32).min)
        o = torch.matmul(torch.softmax(s, dim=-1).to(v.dtype), v)
        return z + self.o_proj(o.transpose(1, 2).reshape(B, T, -1))


def image_grids(config: HiSteveDetectorConfig) -> list[list[int]]:
    """[t, h, w] patch grids of one query's images in prompt order: its frames, then its detail crops."""
    (h, w), p = config.image_size, config.vision_config.patch_size
    out = [[1, h // p, w // p]] * config.num_frames
    if config.detail_size:
        dh, dw = config.detail_size
        out += [[1, dh // p, dw // p]] * len(config.frame_slots.get("detail", []))
    return out


def last_token(h: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """h [B, T, E] at each row's last real token (left or right padding) -> [B, E]."""
    T = h.shape[1]
    last = T - 1 - torch.argmax(attention_mask.flip(1).to(torch.int32), dim=1)
    return h[torch.arange(h.shape[0], device=h.device), last]


class HiSteveDetector(Qwen2_5_VLPreTrainedModel):
    """``detector(input_ids, attention_mask, image_embeds, context, context_mask) -> logits [B, 2]``."""

    config_class = HiSteveDetectorConfig
    base_model_prefix = "detector"
    # M-RoPE positions of the detector's prompt: transformers' own code, on this config's merge size.
    get_rope_index = Qwen2_5_VLModel.get_rope_index
    get_vision_position_ids = Qwen2_5_VLModel.get_vision_position_ids

    def __init__(self, config: HiSteveDetectorConfig):
        super().__init__(config)
        t = config.text_config
        E, Ep = t.hidden_size, config.policy_hidden_size
        n = config.cross_attention_every
        if n < 0 or (n and t.num_hidden_layers % n):
            raise ValueError(f"HiSTEVE detector: cross_attention_every={n} must be 0 or divide "
                             f"num_hidden_layers={t.num_hidden_layers}")
        self.language_model = Qwen2_5_VLTextModel._from_config(t)
        self.cross = nn.ModuleList(HiSteveCrossAttention(config)
                                   for _ in range(t.num_hidden_layers // n if n else 0))
        self.projects = Ep != E
        if self.projects:
            self.image_proj = nn.Linear(Ep, E, bias=False)
            if n:
                self.context_proj = nn.Linear(Ep, E, bias=False)
        self.head = nn.Linear(E, NUM_CLASSES)
        self.post_init()

    def _project(self, x: torch.Tensor, name: str) -> torch.Tensor:
        x = x.to(self.head.weight.dtype)
        return getattr(self, name)(x) if self.projects else x

    def forward(self, input_ids: torch.LongTensor, attention_mask: torch.Tensor, image_embeds: torch.Tensor,
                context: torch.Tensor | None = None,
                context_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [B, 2] of the detector prompt ``input_ids`` [B, T] whose images per row (``num_frames``
        frames, then any detail crops) take ``image_embeds`` [B * image tokens per row, policy width]
        (row-major), attending to the policy's
        ``context`` [B, S, policy width] where ``context_mask`` [B, S] is 1."""
        cfg, lm = self.config, self.language_model
        B = input_ids.shape[0]
        x = lm.embed_tokens(input_ids)
        is_image = input_ids == cfg.image_token_id
        rows = self._project(image_embeds, "image_proj").to(x.dtype)
        if int(is_image.sum()) != rows.shape[0]:
            raise ValueError(f"HiSTEVE detector: {int(is_image.sum())} image tokens in input_ids but "
                             f"{rows.shape[0]} image embeddings")
        x = x.masked_scatter(is_image[..., None], rows)
        grid = torch.tensor(image_grids(cfg) * B, device=input_ids.device)
        positions, _ = self.get_rope_index(input_ids, is_image.to(torch.int32), image_grid_thw=grid,
                                           attention_mask=attention_mask)
        rope = lm.rotary_emb(x, positions)
        mask = create_causal_mask(config=lm.config, inputs_embeds=x, attention_mask=attention_mask,
                                  cache=None)
        if self.cross:
            if context is None or context_mask is None:
                raise ValueError("HiSTEVE detector: cross_attention_every > 0 needs the policy's context "
                                 "and its mask")
            context = self._project(context, "context_proj")
        n = cfg.cross_attention_every
        for i, layer in enumerate(lm.layers):
            x = layer(x, attention_mask=mask, position_embeddings=rope)
            if n and (i + 1) % n == 0:
                x = self.cross[(i + 1) // n - 1](x, context, context_mask)
        z = last_token(lm.norm(x), attention_mask).float()
        return z @ self.head.weight.float().T + self.head.bias.float()


class HiSteveCoupledDetector(nn.Module):
    """The exported policy and the detector: ``logits(**batch)`` / ``probability(**batch)`` of a query
    batch laid out as ``histeve_jax.detector.coupled``'s (frame slots oldest first, prompts padded)."""

    def __init__(self, policy: nn.Module, detector: HiSteveDetector):
        super().__init__()
        width = policy.config.text_config.hidden_size
        if width != detector.config.policy_hidden_size:
            raise ValueError(f"HiSTEVE detector: the policy has hidden width {width}, the detector reads "
                             f"width {detector.config.policy_hidden_size}")
        self.policy, self.detector = policy, detector

    def _grid(self, n: int, device: torch.device, detail: bool = False) -> torch.Tensor:
        grids = image_grids(self.detector.config)
        return torch.tensor([grids[-1 if detail else 0]] * n, device=device)

    def frame_embeds(self, pixel_values: torch.Tensor, n_frames: int, detail: bool = False) -> torch.Tensor:
        """The policy's vision tower on ``n_frames`` frames (``detail``: detail crops):
        [n_frames, tokens, policy width]."""
        visual = self.policy.model.visual
        pixels = pixel_values.reshape(-1, pixel_values.shape[-1]).to(visual.dtype)
        out = visual(pixels, grid_thw=self._grid(n_frames, pixels.device, detail)).pooler_output
        return out.reshape(n_frames, -1, out.shape[-1])

    def policy_context(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, regime: torch.Tensor,
                       image_embeds: torch.Tensor) -> torch.Tensor:
        """The policy's final-layer hidden states of its prompt [B, Lp, width], its frames given as image
        embeddings [B * frames * tokens, width], its RS-Norm row ``regime`` [B]."""
        B = input_ids.shape[0]
        grid = self._grid(B * self.detector.config.policy_num_frames, input_ids.device)
        image = BaseModelOutputWithPooling(pooler_output=(image_embeds,))
        return self.policy.hidden_states(
            input_ids=input_ids, attention_mask=attention_mask, image_grid_thw=grid,
            mm_token_type_ids=(input_ids == self.policy.config.image_token_id).to(torch.int32),
            mm_encoder_outputs={"image": image}, regime=regime)

    def logits(self, pixel_values: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor,
               policy_input_ids: torch.Tensor, policy_attention_mask: torch.Tensor,
               regime: torch.Tensor) -> torch.Tensor:
        """Logits [B, 2]: pixel_values [B, slots * patches (+ detail crops * their patches), 1176], the
        detector's prompt [B, L], the policy's [B, Lp] and its regime [B] (0 NG, 1 GUI)."""
        cfg = self.detector.config
        slots, grids = cfg.frame_slots, image_grids(cfg)
        B, S, D = input_ids.shape[0], len(slots["offsets"]), len(slots.get("detail", []))
        n = S * grids[0][1] * grids[0][2]
        want = n + D * grids[-1][1] * grids[-1][2]
        if pixel_values.shape[1] != want:
            raise ValueError(f"HiSTEVE detector: pixel_values has {pixel_values.shape[1]} patches per query; "
                             f"the detector's {S} frames and {D} detail crops have {want}")
        embeds = self.frame_embeds(pixel_values[:, :n], B * S)
        embeds = embeds.reshape(B, S, *embeds.shape[1:])
        flat = lambda e: e.reshape(-1, e.shape[-1])
        det_img = embeds[:, slots["detector"]].reshape(B, -1, embeds.shape[-1])
        if D:
            detail = self.frame_embeds(pixel_values[:, n:], B * D, detail=True)
            det_img = torch.cat([det_img, detail.reshape(B, -1, detail.shape[-1])], dim=1)
        det_img = flat(det_img)
        context = mask = None
        if self.detector.cross:
            pol_img = flat(embeds[:, slots["policy"]])
            regime = torch.as_tensor(regime, dtype=torch.long, device=input_ids.device).reshape(B)
            context = self.policy_context(policy_input_ids, policy_attention_mask, regime, pol_img)
            mask = policy_attention_mask
        return self.detector(input_ids, attention_mask, det_img, context, mask)

    def probability(self, **batch: torch.Tensor) -> torch.Tensor:
        """P(complete) [B] of a batch (``logits``' arguments)."""
        return torch.softmax(self.logits(**batch), dim=-1)[:, 1]

    forward = logits


def load_coupled_detector(path: str, *, policy: nn.Module | None = None, dtype: torch.dtype | None = None,
                          device: str | torch.device = "cpu") -> HiSteveCoupledDetector:
    """The exported directory's policy (or ``policy``) and its ``detector/``, in eval mode."""
    if not os.path.isdir(os.path.join(path, SUBFOLDER)):
        raise FileNotFoundError(f"{path}: no {SUBFOLDER}/ (exported without a completion detector)")
    kw = {} if dtype is None else {"dtype": dtype}
    if policy is None:
        policy = AutoModelForImageTextToText.from_pretrained(path, trust_remote_code=True, **kw)
    # detector/ is a directory of its own (config, weights, this file): transformers looks for remote code
    # at the directory it loads, not in a subfolder.
    detector = AutoModel.from_pretrained(os.path.join(path, SUBFOLDER), trust_remote_code=True, **kw)
    return HiSteveCoupledDetector(policy, detector).to(device).eval()


__all__ = ["HiSteveCoupledDetector", "HiSteveCrossAttention", "HiSteveDetector", "HiSteveDetectorConfig",
           "load_coupled_detector"]
