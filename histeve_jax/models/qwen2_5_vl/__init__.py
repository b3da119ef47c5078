"""Flax NNX port of Qwen2.5-VL (transformers' `Qwen2_5_VLForConditionalGeneration`), logit-exact.

- `Qwen2_5_VLConfig` (+ `qwen2_5_vl_3b()`, `qwen2_5_vl_7b()`, `tiny()`, `small()`) reads/writes HF
  config.json.
- `Qwen2_5_VLModel(cfg, rngs=...)`: `model(input_ids, attention_mask=..., pixel_values=...,
  image_grid_thw=...)` -> logits; `model.hidden_states(...)` for final hidden states. Grids (`*_grid_thw`)
  must be concrete (numpy or tuples): they fix the number of vision tokens.
- `load_hf` / `save_hf`: HF safetensors directories, tensor by tensor, sharded placement with a mesh.
- `generate` / `Sampler`: one jitted program (prefill + `lax.while_loop` decode with a KV cache), greedy or
  top-p, constraint masks; `Sampler` keeps the graph for repeated calls.
- RS-Norm hook: `norm_regimes > 1` gives the decoder pre-norms a [regimes, d] scale picked by `regime[b]`.
"""

from histeve_jax.models.qwen2_5_vl.config import (
    Qwen2_5_VLConfig,
    TextConfig,
    VisionConfig,
    qwen2_5_vl_3b,
    qwen2_5_vl_7b,
    small,
    tiny,
)
from histeve_jax.models.qwen2_5_vl.generate import GenerateOutput, Sampler, SamplingOptions, generate
from histeve_jax.models.qwen2_5_vl.model import Qwen2_5_VLModel
from histeve_jax.models.qwen2_5_vl.rope import get_rope_index
from histeve_jax.models.qwen2_5_vl.weights import load_hf, resize_token_embeddings, save_hf

__all__ = [
    "GenerateOutput",
    "generate",
    "Sampler",
    "SamplingOptions",
    "Qwen2_5_VLConfig",
    "Qwen2_5_VLModel",
    "TextConfig",
    "VisionConfig",
    "get_rope_index",
    "load_hf",
    "resize_token_embeddings",
    "save_hf",
    "qwen2_5_vl_3b",
    "qwen2_5_vl_7b",
    "small",
    "tiny",
]
