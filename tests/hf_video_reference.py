"""transformers' Qwen2-VL video-processor code, run without torchvision (test-only oracle).

``Qwen2VLVideoProcessor`` imports torchvision at module level, which is not installed here. Its patch
stacking and frame sampling are plain torch, so we compile those methods verbatim from the installed
transformers source and run them; only resizing (torchvision) is left out, for which the tests use
transformers' PIL image processor per frame.
"""

from __future__ import annotations

import ast
import importlib.util
import math
import types
from typing import Any

import numpy as np
import torch
from transformers.video_utils import VideoMetadata

_MODULE = "transformers.models.qwen2_vl.video_processing_qwen2_vl"


def _method(name: str) -> Any:
    path = importlib.util.find_spec(_MODULE).origin
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), filename=path)
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == "Qwen2VLVideoProcessor":
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == name:
                    namespace = {"torch": torch, "math": math, "VideoMetadata": VideoMetadata}
                    exec(compile(ast.Module(body=[item], type_ignores=[]), path, "exec"), namespace)
                    return namespace[name]
    raise LookupError(f"{_MODULE}.Qwen2VLVideoProcessor.{name} not found")


def hf_video_patchify(frames_fchw: np.ndarray, patch_size=14, merge_size=2, temporal_patch_size=2):
    """transformers' video patchify on one video [F, C, H, W] float32 -> (patches, grid_t, grid_h, grid_w)."""
    patchify = _method("patchify")
    videos = torch.from_numpy(np.ascontiguousarray(frames_fchw))[None]
    patches, t, h, w = patchify(None, videos, patch_size, merge_size, temporal_patch_size)
    return patches[0].numpy(), t, h, w


def hf_sample_frames(metadata: VideoMetadata, **kwargs) -> np.ndarray:
    """transformers' Qwen2-VL frame sampling with the processor's default attributes."""
    sample_frames = _method("sample_frames")
    defaults = types.SimpleNamespace(
        num_frames=None, fps=None, temporal_patch_size=2, min_frames=4, max_frames=768
    )
    return sample_frames(defaults, metadata, **kwargs).numpy()
