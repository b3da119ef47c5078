"""The policy's weights as the exported model's safetensors, written tensor by tensor.

Names and layouts come from ``models.qwen2_5_vl.weights.tensor_maps`` (the plain Qwen2.5-VL map that
``save_hf`` uses), with two differences: the RS-Norm scales keep both rows ([regimes, d]: the exported
``HiSteveRSNorm`` holds them), and names are the module paths of transformers 5's classes
(``model.language_model.*``, ``model.visual.*``), because transformers applies its legacy-name renames only
to its own classes, not to remote code.

Memory: shard boundaries are planned from shapes alone, so each shard's header is written first and each
tensor is then produced (sliced from its device array, transposed, cast), written and dropped: one
converted tensor at a time is all the export adds to the loaded model.
"""

from __future__ import annotations

import dataclasses
import json
import os
import struct
from typing import Any

import jax
import numpy as np
from flax import nnx

from histeve_jax.models.qwen2_5_vl import weights as hf_weights


def module_name(legacy: str) -> str:
    """A ``tensor_maps`` (legacy) name -> the transformers 5 module path (inverse of ``_normalize_key``)."""
    if legacy.startswith("model."):
        return "model.language_model." + legacy[len("model."):]
    if legacy.startswith("visual."):
        return "model." + legacy
    return legacy


@dataclasses.dataclass(frozen=True)
class PlannedTensor:
    """One tensor of the export: its name, shape and dtype, and where it comes from in our tree."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    source: hf_weights.TensorMap

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * self.dtype.itemsize


def policy_maps(cfg: Any) -> list[hf_weights.TensorMap]:
    """The policy's tensors, each map's ``hf`` its exported (transformers 5 module path) name."""
    return [dataclasses.replace(m, hf=module_name(m.hf)) for m in hf_weights.tensor_maps(cfg)]


def plan_tensors(model: nnx.Module, dtype: Any = None,
                 maps: list[hf_weights.TensorMap] | None = None) -> list[PlannedTensor]:
    """Every exported tensor (name, shape, dtype) from the model's parameter shapes; nothing is read.
    ``maps``: the tensors and their exported names (default: the policy's, ``policy_maps``)."""
    cfg = model.config
    flat = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    out = []
    for m in policy_maps(cfg) if maps is None else maps:
        var = flat[m.path]
        shape = tuple(var.shape[1:] if m.layer is not None else var.shape)
        if m.kind == "norm" and len(shape) == 2:
            hf_shape = shape  # both RS-Norm rows
        else:
            hf_shape = hf_weights._hf_shape(cfg, m, shape)
        out_dtype = np.dtype(dtype if dtype is not None else var.dtype)
        out.append(PlannedTensor(m.hf, tuple(int(s) for s in hf_shape), out_dtype, m))
    return out


def _tensor(model: nnx.Module, flat: dict, t: PlannedTensor) -> np.ndarray:
    """One planned tensor's values on the host, in its exported layout and dtype."""
    m = t.source
    value = flat[m.path].get_value()
    if m.layer is not None:
        value = value[m.layer]  # sliced on the device: only this layer comes to the host
    a = np.asarray(jax.device_get(value))
    if m.kind == "norm" and a.ndim == 2:
        a = np.ascontiguousarray(a)
    else:
        a = hf_weights._to_hf(model.config, m, a, None)
    if a.shape != t.shape:
        raise RuntimeError(f"internal: tensor {t.name} has shape {a.shape}, planned {t.shape}")
    return np.ascontiguousarray(a.astype(t.dtype, copy=False))


def shard_plan(tensors: list[PlannedTensor], max_shard_size: int | str) -> list[list[PlannedTensor]]:
    """Tensors grouped into shards of at most ``max_shard_size`` bytes (a larger tensor is alone)."""
    limit = hf_weights._parse_size(max_shard_size)
    shards: list[list[PlannedTensor]] = [[]]
    size = 0
    for t in tensors:
        if size + t.nbytes > limit and shards[-1]:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.nbytes
    return shards


def _header(tensors: list[PlannedTensor]) -> bytes:
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    off = 0
    for t in tensors:
        header[t.name] = {"dtype": hf_weights._ST_NAMES[t.dtype], "shape": list(t.shape),
                          "data_offsets": [off, off + t.nbytes]}
        off += t.nbytes
    hb = json.dumps(header, separators=(",", ":")).encode()
    return hb + b" " * (-len(hb) % 8)


def write_weights(model: nnx.Module, path: str, *, dtype: Any = None, max_shard_size: int | str = "5GB",
                  maps: list[hf_weights.TensorMap] | None = None) -> list[str]:
    """Writes the model's safetensors (and the index when sharded) into the existing directory ``path``;
    returns the file names. ``dtype``: the exported dtype (default: each parameter's own); ``maps``: as
    ``plan_tensors`` (the detector passes its own)."""
    written: list[str] = []
    flat = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    shards = shard_plan(plan_tensors(model, dtype, maps), max_shard_size)
    names = ([hf_weights.SAFE_SINGLE] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    for fn, shard in zip(names, shards, strict=True):
        with open(os.path.join(path, fn), "wb") as f:
            hb = _header(shard)
            f.write(struct.pack("<Q", len(hb)))
            f.write(hb)
            for t in shard:
                f.write(_tensor(model, flat, t).reshape(-1).view(np.uint8))  # no bytes copy
        written.append(fn)
    if len(shards) > 1:
        weight_map = {t.name: fn for fn, shard in zip(names, shards, strict=True) for t in shard}
        total = sum(t.nbytes for shard in shards for t in shard)
        with open(os.path.join(path, hf_weights.SAFE_INDEX), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
        written.append(hf_weights.SAFE_INDEX)
    return written
