"""Configuration of Qwen2.5-VL: one class with text and vision parts, read from/written to HF config.json."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import jax.numpy as jnp

REMAT_POLICIES = ("none", "full", "save_dots")
LAYER_LOOPS = ("auto", "scan", "unroll")


@dataclasses.dataclass(frozen=True)
class VisionConfig:
    """The vision tower (HF `Qwen2_5_VLVisionConfig`)."""

    depth: int = 32
    hidden_size: int = 1280
    intermediate_size: int = 3420
    num_heads: int = 16
    in_channels: int = 3
    patch_size: int = 14
    spatial_merge_size: int = 2
    temporal_patch_size: int = 2
    tokens_per_second: int = 2
    window_size: int = 112
    out_hidden_size: int = 3584
    fullatt_block_indexes: tuple[int, ...] = (7, 15, 23, 31)
    rope_theta: float = 10000.0
    hidden_act: str = "silu"

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size * self.patch_size


@dataclasses.dataclass(frozen=True)
class TextConfig:
    """The language model (HF `Qwen2_5_VLTextConfig`)."""

    vocab_size: int = 152064
    hidden_size: int = 3584
    intermediate_size: int = 18944
    num_hidden_layers: int = 28
    num_attention_heads: int = 28
    num_key_value_heads: int = 4
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1000000.0
    mrope_section: tuple[int, ...] = (16, 24, 24)
    max_position_embeddings: int = 128000
    hidden_act: str = "silu"
    bos_token_id: int | None = 151643
    eos_token_id: int | tuple[int, ...] | None = 151645
    pad_token_id: int | None = None

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


@dataclasses.dataclass(frozen=True)
class Qwen2_5_VLConfig:
    """Qwen2.5-VL: text + vision + special tokens, plus our (non-HF) compute options."""

    text: TextConfig = dataclasses.field(default_factory=TextConfig)
    vision: VisionConfig = dataclasses.field(default_factory=VisionConfig)
    image_token_id: int = 151655
    video_token_id: int = 151656
    vision_start_token_id: int = 151652
    vision_end_token_id: int = 151653
    tie_word_embeddings: bool = False
    # Non-HF fields.
    dtype: Any = jnp.float32  # compute dtype
    param_dtype: Any = jnp.float32
    # Decoder layers as stacked [L, ...] parameters (True) or separate per-layer ones; `load_hf` picks by
    # backend when not told (`weights.default_scan_layers`: per-layer on CPU).
    scan_layers: bool = True
    # How stacked (scan_layers) layers run: "scan" (lax.scan), "unroll" (the stacks split once, the layers
    # called one by one: XLA:CPU copies a scanned layer's weights out of the stack and zero-fills stacked
    # residual and gradient buffers), or "auto": unroll on the CPU backend, scan elsewhere.
    layer_loop: str = "auto"
    remat: str = "none"
    norm_regimes: int = 1

    def __post_init__(self):
        t, v = self.text, self.vision
        if t.hidden_size % t.num_attention_heads:
            raise ValueError(
                f"text_config.hidden_size={t.hidden_size} is not divisible by num_attention_heads="
                f"{t.num_attention_heads}"
            )
        if t.num_attention_heads % t.num_key_value_heads:
            raise ValueError(
                f"text_config.num_attention_heads={t.num_attention_heads} is not divisible by "
                f"num_key_value_heads={t.num_key_value_heads}"
            )
        if sum(t.mrope_section) * 2 != t.head_dim:
            raise ValueError(
                f"text_config.rope_parameters.mrope_section={list(t.mrope_section)} must sum to head_dim/2="
                f"{t.head_dim // 2}"
            )
        if v.hidden_size % v.num_heads or v.head_dim % 4:
            raise ValueError(
                f"vision_config.hidden_size={v.hidden_size} / num_heads={v.num_heads} is invalid"
            )
        if v.out_hidden_size != t.hidden_size:
            raise ValueError(
                f"vision_config.out_hidden_size={v.out_hidden_size} must equal text hidden_size="
                f"{t.hidden_size}"
            )
        if any(not 0 <= i < v.depth for i in v.fullatt_block_indexes):
            raise ValueError(f"vision_config.fullatt_block_indexes={v.fullatt_block_indexes} out of range")
        if self.layer_loop not in LAYER_LOOPS:
            raise ValueError(f"layer_loop={self.layer_loop!r}; expected one of {LAYER_LOOPS}")
        if self.remat not in REMAT_POLICIES:
            raise ValueError(f"remat={self.remat!r}; expected one of {REMAT_POLICIES}")
        if self.norm_regimes < 1:
            raise ValueError(f"norm_regimes={self.norm_regimes} must be >= 1")
        if t.hidden_act != "silu" or v.hidden_act != "silu":
            raise ValueError(
                f"hidden_act must be 'silu' (got text {t.hidden_act!r}, vision {v.hidden_act!r})"
            )

    def replace(self, **kw: Any) -> Qwen2_5_VLConfig:
        """A copy with top-level fields replaced; `text=`/`vision=` accept dicts of sub-fields too."""
        for part in ("text", "vision"):
            if isinstance(kw.get(part), dict):
                kw[part] = dataclasses.replace(getattr(self, part), **kw[part])
        return dataclasses.replace(self, **kw)

    # ------------------------------------------------------------------ HF config.json

    @classmethod
    def from_hf_dict(
        cls, d: dict[str, Any], *, source: str = "config.json", **overrides: Any
    ) -> Qwen2_5_VLConfig:
        """Parses a HF `config.json` dict (nested `text_config` as transformers 5 writes, or the legacy flat
        layout of the published checkpoints). Raises naming the key and `source` when one is missing/bad."""
        if d.get("model_type", "qwen2_5_vl") != "qwen2_5_vl":
            raise ValueError(f"{source}: key 'model_type' is {d.get('model_type')!r}, expected 'qwen2_5_vl'")
        td = d.get("text_config") or {}
        if not isinstance(td, dict):
            raise ValueError(f"{source}: key 'text_config' must be a dict")
        # Legacy layout: text fields at top level; nested ones win when both exist.
        td = {**{k: v for k, v in d.items() if k not in ("text_config", "vision_config")}, **td}
        vd = d.get("vision_config")
        if not isinstance(vd, dict):
            raise ValueError(f"{source}: missing key 'vision_config'")

        def get(src: dict, prefix: str, key: str, typ: type | tuple, default: Any = KeyError) -> Any:
            if src.get(key) is None:
                if default is KeyError:
                    raise KeyError(f"{source}: missing key '{prefix}{key}'")
                return default
            val = src[key]
            ok = isinstance(val, typ) and not (isinstance(val, bool) and typ in (int, float, (int, float)))
            if not ok:
                raise ValueError(f"{source}: key '{prefix}{key}' has bad value {val!r}")
            return val

        rope = td.get("rope_parameters") or td.get("rope_scaling") or {}
        if not isinstance(rope, dict):
            raise ValueError(f"{source}: key 'text_config.rope_parameters' must be a dict")
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "mrope"):
            raise ValueError(
                f"{source}: key 'text_config.rope_parameters.rope_type'={rope_type!r} unsupported"
            )
        theta = rope.get("rope_theta", td.get("rope_theta", 1000000.0))
        if not isinstance(theta, (int, float)):
            raise ValueError(
                f"{source}: key 'text_config.rope_parameters.rope_theta' has bad value {theta!r}"
            )
        if "mrope_section" not in rope:
            raise KeyError(f"{source}: missing key 'text_config.rope_parameters.mrope_section'")
        msec = rope["mrope_section"]
        if not (isinstance(msec, list) and len(msec) == 3 and all(isinstance(s, int) for s in msec)):
            raise ValueError(
                f"{source}: key 'text_config.rope_parameters.mrope_section' has bad value {msec!r}"
            )
        if td.get("use_sliding_window"):
            raise ValueError(f"{source}: key 'text_config.use_sliding_window'=true is not supported")
        p = "text_config."
        eos = td.get("eos_token_id")
        text = TextConfig(
            vocab_size=get(td, p, "vocab_size", int),
            hidden_size=get(td, p, "hidden_size", int),
            intermediate_size=get(td, p, "intermediate_size", int),
            num_hidden_layers=get(td, p, "num_hidden_layers", int),
            num_attention_heads=get(td, p, "num_attention_heads", int),
            num_key_value_heads=get(td, p, "num_key_value_heads", int),
            rms_norm_eps=float(get(td, p, "rms_norm_eps", (int, float))),
            rope_theta=float(theta),
            mrope_section=tuple(msec),
            max_position_embeddings=get(td, p, "max_position_embeddings", int, 128000),
            hidden_act=get(td, p, "hidden_act", str, "silu"),
            bos_token_id=td.get("bos_token_id"),
            eos_token_id=tuple(eos) if isinstance(eos, list) else eos,
            pad_token_id=td.get("pad_token_id"),
        )
        p = "vision_config."
        vrope = vd.get("rope_parameters") or {}
        fab = get(vd, p, "fullatt_block_indexes", list)
        vision = VisionConfig(
            depth=get(vd, p, "depth", int),
            hidden_size=get(vd, p, "hidden_size", int),
            intermediate_size=get(vd, p, "intermediate_size", int),
            num_heads=get(vd, p, "num_heads", int),
            in_channels=get(vd, p, "in_channels", int, 3),
            patch_size=get(vd, p, "patch_size", int),
            spatial_merge_size=get(vd, p, "spatial_merge_size", int),
            temporal_patch_size=get(vd, p, "temporal_patch_size", int),
            tokens_per_second=get(vd, p, "tokens_per_second", int),
            window_size=get(vd, p, "window_size", int),
            out_hidden_size=get(vd, p, "out_hidden_size", int),
            fullatt_block_indexes=tuple(fab),
            rope_theta=float(vrope.get("rope_theta", 10000.0)),
            hidden_act=get(vd, p, "hidden_act", str, "silu"),
        )
        tie = d.get("tie_word_embeddings", td.get("tie_word_embeddings", False))
        if not isinstance(tie, bool):
            raise ValueError(f"{source}: key 'tie_word_embeddings' has bad value {tie!r}")
        kw = dict(
            text=text,
            vision=vision,
            image_token_id=get(d, "", "image_token_id", int, 151655),
            video_token_id=get(d, "", "video_token_id", int, 151656),
            vision_start_token_id=get(d, "", "vision_start_token_id", int, 151652),
            vision_end_token_id=get(d, "", "vision_end_token_id", int, 151653),
            tie_word_embeddings=tie,
        )
        kw.update(overrides)
        try:
            return cls(**kw)
        except ValueError as e:
            raise ValueError(f"{source}: {e}") from e

    @classmethod
    def from_pretrained_dir(cls, path: str, **overrides: Any) -> Qwen2_5_VLConfig:
        """Reads `<path>/config.json`."""
        fn = os.path.join(path, "config.json")
        if not os.path.exists(fn):
            raise FileNotFoundError(f"{fn}: no config.json in the model directory")
        with open(fn) as f:
            return cls.from_hf_dict(json.load(f), source=fn, **overrides)

    def to_hf_dict(self) -> dict[str, Any]:
        """The HF `config.json` dict (the layout transformers 5.24 writes)."""
        t, v = self.text, self.vision
        eos = list(t.eos_token_id) if isinstance(t.eos_token_id, tuple) else t.eos_token_id
        return {
            "architectures": ["Qwen2_5_VLForConditionalGeneration"],
            "model_type": "qwen2_5_vl",
            "dtype": jnp.dtype(self.param_dtype).name,
            "image_token_id": self.image_token_id,
            "video_token_id": self.video_token_id,
            "vision_start_token_id": self.vision_start_token_id,
            "vision_end_token_id": self.vision_end_token_id,
            "tie_word_embeddings": self.tie_word_embeddings,
            "text_config": {
                "model_type": "qwen2_5_vl_text",
                "vocab_size": t.vocab_size,
                "hidden_size": t.hidden_size,
                "intermediate_size": t.intermediate_size,
                "num_hidden_layers": t.num_hidden_layers,
                "num_attention_heads": t.num_attention_heads,
                "num_key_value_heads": t.num_key_value_heads,
                "hidden_act": t.hidden_act,
                "max_position_embeddings": t.max_position_embeddings,
                "rms_norm_eps": t.rms_norm_eps,
                "rope_parameters": {
                    "rope_type": "default",
                    "rope_theta": t.rope_theta,
                    "mrope_section": list(t.mrope_section),
                },
                "use_sliding_window": False,
                "sliding_window": None,
                "attention_dropout": 0.0,
                "bos_token_id": t.bos_token_id,
                "eos_token_id": eos,
                "pad_token_id": t.pad_token_id,
                "tie_word_embeddings": self.tie_word_embeddings,
            },
            "vision_config": {
                "model_type": "qwen2_5_vl_vision",
                "depth": v.depth,
                "hidden_size": v.hidden_size,
                "intermediate_size": v.intermediate_size,
                "num_heads": v.num_heads,
                "in_channels": v.in_channels,
                "patch_size": v.patch_size,
                "spatial_merge_size": v.spatial_merge_size,
                "temporal_patch_size": v.temporal_patch_size,
                "tokens_per_second": v.tokens_per_second,
                "window_size": v.window_size,
                "out_hidden_size": v.out_hidden_size,
                "fullatt_block_indexes": list(v.fullatt_block_indexes),
                "hidden_act": v.hidden_act,
                "rope_parameters": {"rope_type": "axial", "rope_theta": v.rope_theta},
            },
        }


# ---------------------------------------------------------------------- named shapes


def qwen2_5_vl_7b(**kw: Any) -> Qwen2_5_VLConfig:
    """Qwen/Qwen2.5-VL-7B-Instruct."""
    return Qwen2_5_VLConfig(
        text=TextConfig(
            vocab_size=152064,
            hidden_size=3584,
            intermediate_size=18944,
            num_hidden_layers=28,
            num_attention_heads=28,
            num_key_value_heads=4,
            max_position_embeddings=128000,
        ),
        vision=VisionConfig(out_hidden_size=3584),
        tie_word_embeddings=False,
        **kw,
    )


def qwen2_5_vl_3b(**kw: Any) -> Qwen2_5_VLConfig:
    """Qwen/Qwen2.5-VL-3B-Instruct."""
    return Qwen2_5_VLConfig(
        text=TextConfig(
            vocab_size=151936,
            hidden_size=2048,
            intermediate_size=11008,
            num_hidden_layers=36,
            num_attention_heads=16,
            num_key_value_heads=2,
            max_position_embeddings=128000,
        ),
        vision=VisionConfig(out_hidden_size=2048),
        tie_word_embeddings=True,
        **kw,
    )


def tiny(**kw: Any) -> Qwen2_5_VLConfig:
    """A few-layer random model for tests: small vocab with the special tokens remapped into it."""
    return Qwen2_5_VLConfig(
        text=TextConfig(
            vocab_size=320,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            mrope_section=(2, 3, 3),
            max_position_embeddings=4096,
            bos_token_id=None,
            eos_token_id=None,
        ),
        vision=VisionConfig(
            depth=3,
            hidden_size=32,
            intermediate_size=64,
            num_heads=2,
            out_hidden_size=64,
            window_size=56,
            fullatt_block_indexes=(1,),
        ),
        image_token_id=300,
        video_token_id=301,
        vision_start_token_id=302,
        vision_end_token_id=303,
        **kw,
    )


def small(**kw: Any) -> Qwen2_5_VLConfig:
    """``tiny``'s vocabulary and special ids at 2-4x its widths and depths: the largest random policy that
    trains in minutes on a 2-core CPU and still resolves a 16 px cursor on 112x196 frames."""
    base = tiny(**kw)
    return base.replace(
        text={"hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 4, "num_attention_heads": 4,
              "num_key_value_heads": 2, "mrope_section": (4, 6, 6)},
        vision={"depth": 4, "hidden_size": 96, "intermediate_size": 256, "num_heads": 4,
                "out_hidden_size": 128, "fullatt_block_indexes": (1, 3)},
    )
