"""The completion detector's static description: its decoder shape, what it reads of the policy, its frames.

The detector is a Qwen2.5-VL text decoder (``base``: the 3B's shape with the FFN width pruned) that reads
the policy's image embeddings (the policy's vision tower, computed once per frame) and, through a
cross-attention block after every ``cross_attention_every``-th decoder layer, the policy's final-layer
hidden states of its prompt (the tokens before the first action token). Both inputs have the policy's
width; they are projected to the detector's where the widths differ (7B policy 3584 -> 3B detector 2048).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from histeve_jax.models import qwen2_5_vl
from histeve_jax.models.qwen2_5_vl import Qwen2_5_VLConfig, VisionConfig

NUM_CLASSES = 2  # incomplete, complete
# The frame offset of the invocation's first frame (``DetectorConfig.anchor``): every frame offset is
# clamped to the invocation's first step, so an offset this far back always reads that frame.
ANCHOR_OFFSET = 1_000_000


@dataclasses.dataclass(frozen=True)
class DetectorConfig:
    """The detector: decoder shape, the policy it reads, the frames of one query and the padded lengths."""

    base: Qwen2_5_VLConfig  # the decoder (its vision part is unused: the policy's tower encodes frames)
    policy_hidden_size: int  # width of the policy's hidden states and image embeddings
    policy_vision: VisionConfig  # the policy's image encoder, which the detector shares
    image_size: tuple[int, int] = (56, 56)  # (H, W) of every frame (the policy's)
    cross_attention_every: int = 4  # a cross-attention block after every n-th layer; 0: none (ablation)
    history_frames: int = 3  # frames before the query, ``stride`` steps apart
    stride: int = 4
    # One more slot before the history: the invocation's first frame. A subtask asked for when its product
    # is already held (mine_dirt(count=3) with two dirt in the hotbar) is done once it has *changed* since
    # the start; the recent frames alone show dirt in the hotbar either way.
    anchor: bool = False
    # A crop (top, bottom, left, right pixels of the frame at ``image_size``) shown again, ``detail_scale``
    # times larger, for the query's frame (and the anchor's): the hotbar, where a held item is a few pixels
    # the policy's tower loses at the frame's scale (README, "Where the information is lost"). None: none.
    detail: tuple[int, int, int, int] | None = None
    detail_scale: int = 2
    policy_stride: int = 4  # steps between the policy's own frames (its run's data.stride)
    max_len: int = 160  # the detector prompt's padded length
    policy_max_len: int = 112  # the policy prompt's padded length (the cross-attention's keys)

    def __post_init__(self):
        if self.detail is not None:
            object.__setattr__(self, "detail", tuple(int(x) for x in self.detail))
            t, b, l, r = self.detail
            H, W = self.image_size
            if not (0 <= t < b <= H and 0 <= l < r <= W) or self.detail_scale < 1:
                raise ValueError(f"DetectorConfig.detail {self.detail} (top, bottom, left, right) must lie "
                                 f"in the {H}x{W} frame and detail_scale={self.detail_scale} be >= 1")
            if any(s % 28 for s in self.detail_size):
                dh, dw = self.detail_size
                raise ValueError(f"DetectorConfig.detail {self.detail} at scale {self.detail_scale} is "
                                 f"{dh}x{dw}; both sides must be multiples of 28")
        n, L = self.cross_attention_every, self.base.text.num_hidden_layers
        if n < 0 or (n and L % n):
            raise ValueError(f"DetectorConfig.cross_attention_every={n} must be 0 or divide the "
                             f"decoder's num_hidden_layers={L}")
        if any(int(s) % 28 for s in self.image_size):
            raise ValueError(f"DetectorConfig.image_size {self.image_size} must be multiples of 28")
        if self.history_frames < 0 or self.stride < 1:
            raise ValueError(f"DetectorConfig: history_frames={self.history_frames} must be >= 0 and "
                             f"stride={self.stride} >= 1")
        if self.base.norm_regimes != 1:
            raise ValueError("DetectorConfig.base: the detector has one RMSNorm scale (norm_regimes=1)")

    @property
    def hidden_size(self) -> int:
        return self.base.text.hidden_size

    @property
    def projects(self) -> bool:
        """Whether the policy's width differs from the detector's (then both inputs are projected)."""
        return self.policy_hidden_size != self.hidden_size

    @property
    def num_groups(self) -> int:
        """Cross-attention blocks (one after each group of ``cross_attention_every`` layers)."""
        n = self.cross_attention_every
        return self.base.text.num_hidden_layers // n if n else 0

    @property
    def num_frames(self) -> int:
        return self.history_frames + 1 + int(self.anchor)

    @property
    def tokens_per_image(self) -> int:
        m = self.policy_vision.spatial_merge_size * self.policy_vision.patch_size
        return (self.image_size[0] // m) * (self.image_size[1] // m)

    @property
    def detail_size(self) -> tuple[int, int]:
        """(H, W) of the detail crop as the tower sees it ((0, 0) without one)."""
        if self.detail is None:
            return (0, 0)
        t, b, l, r = self.detail
        return ((b - t) * self.detail_scale, (r - l) * self.detail_scale)

    @property
    def detail_tokens(self) -> int:
        m = self.policy_vision.spatial_merge_size * self.policy_vision.patch_size
        return (self.detail_size[0] // m) * (self.detail_size[1] // m)

    def detail_offsets(self) -> tuple[int, ...]:
        """Steps before the query of the frames whose detail crop the detector also reads (after all its
        frames, in this order): the anchor's (when anchored) and the query's; () without a detail crop."""
        if self.detail is None:
            return ()
        return ((ANCHOR_OFFSET,) if self.anchor else ()) + (0,)

    def image_grids(self) -> tuple[tuple[int, int, int], ...]:
        """(t, h, w) patch grids of one query's images in prompt order: its frames, then its detail crops."""
        (h, w), (dh, dw) = self.image_size, self.detail_size
        p = self.policy_vision.patch_size
        return (((1, h // p, w // p),) * self.num_frames
                + ((1, dh // p, dw // p),) * len(self.detail_offsets()))

    def query_patches(self, slots: int) -> int:
        """Patches in one query's ``pixel_values`` row: ``slots`` frames, then the detail crops."""
        grids = self.image_grids()
        return slots * math.prod(grids[0]) + len(self.detail_offsets()) * math.prod(grids[-1])

    def frame_offsets(self) -> tuple[int, ...]:
        """Steps before the query of the detector's frames, oldest first (the query itself is 0; with
        ``anchor``, ``ANCHOR_OFFSET`` first: the invocation's first frame)."""
        recent = tuple(k * self.stride for k in range(self.history_frames, -1, -1))
        return ((ANCHOR_OFFSET,) if self.anchor else ()) + recent

    def replace(self, **kw: Any) -> DetectorConfig:
        return dataclasses.replace(self, **kw)

    def check_policy(self, policy_config: Any) -> None:
        """Raise (one line naming both) unless the policy's hidden width and image encoder are expected."""
        pc = policy_config.model_config if hasattr(policy_config, "model_config") else policy_config
        p_img = tuple(getattr(policy_config, "image_size", self.image_size))
        mine = (self.policy_hidden_size, _encoder(self.policy_vision), tuple(self.image_size))
        theirs = (pc.text.hidden_size, _encoder(pc.vision), p_img)
        if mine != theirs:
            raise ValueError(
                f"policy/detector mismatch: the policy has hidden width {theirs[0]} and image encoder "
                f"{theirs[1]} at {theirs[2]}, the detector config expects hidden width {mine[0]} and image "
                f"encoder {mine[1]} at {mine[2]}")


def _encoder(v: VisionConfig) -> str:
    """A vision tower's shape in one token: what must match for the embeddings to mean the same."""
    return (f"vision(depth={v.depth}, width={v.hidden_size}, patch={v.patch_size}, "
            f"merge={v.spatial_merge_size}, out={v.out_hidden_size})")


def tiny_base(intermediate_size: int = 96, **kw: Any) -> Qwen2_5_VLConfig:
    """The tiny detector decoder's unpruned ("3B-style") shape: 4 layers of width 32, the tiny vocab."""
    base = qwen2_5_vl.tiny(**kw)
    return base.replace(
        text={"hidden_size": 32, "intermediate_size": intermediate_size, "num_hidden_layers": 4,
              "num_attention_heads": 4, "num_key_value_heads": 2, "mrope_section": (1, 1, 2)},
        vision={"out_hidden_size": 32})


def tiny_config(policy_config: Any, **kw: Any) -> DetectorConfig:
    """A tiny detector (pruned to 32 channels) for a tiny policy: tests and the CPU run."""
    base = kw.pop("base", None) or tiny_base(intermediate_size=32)
    pc = policy_config.model_config
    return DetectorConfig(base=base, policy_hidden_size=pc.text.hidden_size, policy_vision=pc.vision,
                          image_size=tuple(policy_config.image_size), **kw)


def qwen3b_config(ffn_keep: float = 1 / 3, multiple_of: int = 128, **kw: Any) -> DetectorConfig:
    """The paper's detector: Qwen2.5-VL-3B with its FFN pruned to ``ffn_keep`` for the 7B policy."""
    base = qwen2_5_vl.qwen2_5_vl_3b()
    width = pruned_width(base.text.intermediate_size, ffn_keep, multiple_of)
    policy = qwen2_5_vl.qwen2_5_vl_7b()
    defaults = dict(image_size=(252, 448), history_frames=3, stride=5, max_len=4 * 144 + 64,
                    policy_max_len=4 * 144 + 64)
    defaults.update(kw)
    return DetectorConfig(base=base.replace(text={"intermediate_size": width}),
                          policy_hidden_size=policy.text.hidden_size, policy_vision=policy.vision, **defaults)


def pruned_width(intermediate_size: int, keep: float, multiple_of: int = 1) -> int:
    """Channels kept of ``intermediate_size`` at fraction ``keep``, rounded to ``multiple_of``."""
    if not 0 < keep <= 1:
        raise ValueError(f"ffn keep fraction {keep} must be in (0, 1]")
    k = max(multiple_of, int(round(intermediate_size * keep / multiple_of)) * multiple_of)
    return min(k, intermediate_size)
