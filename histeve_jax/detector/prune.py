"""Structured FFN pruning of a pretrained Qwen2.5-VL decoder into a detector, and the pruned detector's I/O.

Importance of intermediate channel j of a layer (data-free, from the weights): with x = gamma * n the
pre-MLP RMSNorm's output (n of unit RMS, gamma its scale), channel j adds
``down[j, :] * silu(x . gate[:, j]) * (x . up[:, j])`` to the layer's output, and since |silu(a)| <= |a|,
Cauchy-Schwarz bounds its norm by ``||down[j,:]|| * ||gamma * gate[:,j]|| * ||gamma * up[:,j]|| * ||n||^2``.
The score is that bound's weight factor: the channels kept are those that can move the residual stream
most for any input. It needs no calibration data (the detector is pruned before any detector data is
chosen, and the pruned 3B then trains on it); an activation-weighted score on calibration prompts would
rank by what typical inputs do instead, at the cost of running the unpruned 3B over them.

``prune_hf`` reads a Hugging Face Qwen2.5-VL directory (``qwen2_5_vl.load_hf``), keeps the top
``round(keep * intermediate_size)`` channels of every layer (rounded to ``multiple_of``, in their original
order), copies every other decoder weight unchanged, and initialises the detector's own parameters
(cross-attention, projections, head). ``save_detector`` writes ``detector.json`` + ``model.safetensors``
(parameters by their path, and the kept channel indices); ``load_detector`` reads it back, placed on a mesh.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from histeve_jax.detector.config import DetectorConfig, pruned_width
from histeve_jax.detector.model import Detector
from histeve_jax.models.qwen2_5_vl import Qwen2_5_VLConfig, VisionConfig, load_hf
from histeve_jax.models.qwen2_5_vl.weights import SafetensorsFile, write_safetensors
from histeve_jax.parallel import axes

CONFIG_FILE, WEIGHTS_FILE, KEPT_KEY = "detector.json", "model.safetensors", "pruning/kept_channels"


def channel_importance(gate: np.ndarray, up: np.ndarray, down: np.ndarray, gamma: np.ndarray) -> np.ndarray:
    """Scores [L, F] of stacked layers' gate/up [L, E, F], down [L, F, E] and pre-MLP scale gamma [L, E]."""
    g = np.asarray(gamma, np.float64)[:, :, None]
    col = lambda w: np.linalg.norm(np.asarray(w, np.float64) * g, axis=1)  # [L, F]
    return col(gate) * col(up) * np.linalg.norm(np.asarray(down, np.float64), axis=2)


def top_channels(scores: np.ndarray, k: int) -> np.ndarray:
    """[L, k] indices of each layer's ``k`` highest scores, ascending (the original channel order)."""
    if not 0 < k <= scores.shape[1]:
        raise ValueError(f"prune: keep {k} channels of {scores.shape[1]}")
    top = np.argsort(-scores, axis=1, kind="stable")[:, :k]
    return np.sort(top, axis=1)


def _check_base(source: Qwen2_5_VLConfig, where: str) -> None:
    if source.norm_regimes != 1:
        raise ValueError(f"{where}: expected a plain Qwen2.5-VL decoder (norm_regimes=1)")


def prune_hf(path: str, template: DetectorConfig, *, keep: float = 1 / 3, multiple_of: int = 1,
             seed: int = 0, dtype: Any = jnp.float32) -> tuple[Detector, np.ndarray]:
    """(the detector pruned from the Hugging Face directory ``path``, the kept channels [L, k]).

    The decoder's shape is the directory's (its FFN pruned to ``keep``); everything else is ``template``'s.
    """
    model = load_hf(path, dtype=dtype, config_overrides={"scan_layers": True})  # [L, ...] stacks to score
    src = model.config
    _check_base(src, path)
    lm = model.language_model
    k = pruned_width(src.text.intermediate_size, keep, multiple_of)
    base = src.replace(text={"intermediate_size": k}, scan_layers=True, dtype=template.base.dtype,
                       param_dtype=template.base.param_dtype, remat=template.base.remat)
    config = dataclasses.replace(template, base=base)
    mlp = lm.layers.mlp
    gate, up, down = (np.asarray(getattr(mlp, n).get_value()) for n in ("gate", "up", "down"))
    gamma = np.asarray(lm.layers.post_attn_norm.scale.get_value())
    kept = top_channels(channel_importance(gate, up, down, gamma), k)
    detector = Detector(config, rngs=nnx.Rngs(seed))
    target = dict(nnx.to_flat_state(nnx.state(detector.language_model, nnx.Param)))
    sliced = {("layers", "mlp", "gate"): np.take_along_axis(gate, kept[:, None, :], axis=2),
              ("layers", "mlp", "up"): np.take_along_axis(up, kept[:, None, :], axis=2),
              ("layers", "mlp", "down"): np.take_along_axis(down, kept[:, :, None], axis=1)}
    for p, var in nnx.to_flat_state(nnx.state(lm, nnx.Param)):
        value = sliced.get(p, var.get_value())
        if tuple(target[p].shape) != tuple(np.shape(value)):
            raise ValueError(f"{path}: decoder tensor {'/'.join(map(str, p))} has shape {np.shape(value)}, "
                             f"the detector expects {tuple(target[p].shape)}")
        target[p].set_value(jnp.asarray(value, target[p].dtype))
    return detector, kept


# ---------------------------------------------------------------------- the pruned detector on disk


def config_to_dict(config: DetectorConfig) -> dict[str, Any]:
    out = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    out["base"] = config.base.to_hf_dict()
    out["policy_vision"] = dataclasses.asdict(config.policy_vision)
    out["image_size"] = list(config.image_size)
    return out


def config_from_dict(d: dict[str, Any], *, source: str = CONFIG_FILE,
                     **base_overrides: Any) -> DetectorConfig:
    """The inverse of ``config_to_dict``; ``base_overrides`` set compute fields (dtype, remat)."""
    try:
        base = Qwen2_5_VLConfig.from_hf_dict(d["base"], source=f"{source}: base", **base_overrides)
        vision = VisionConfig(**{**d["policy_vision"],
                                 "fullatt_block_indexes": tuple(d["policy_vision"]["fullatt_block_indexes"])})
        rest = {k: v for k, v in d.items() if k not in ("base", "policy_vision")}
        rest["image_size"] = tuple(rest["image_size"])
        return DetectorConfig(base=base, policy_vision=vision, **rest)
    except (KeyError, TypeError) as e:
        raise ValueError(f"{source}: not a detector config ({type(e).__name__}: {e})") from e


def save_detector(detector: Detector, path: str, kept: np.ndarray | None = None) -> None:
    """``detector.json`` and ``model.safetensors`` (each parameter under its path) in ``path``."""
    os.makedirs(path, exist_ok=True)
    tensors = {"/".join(map(str, p)): np.asarray(jax.device_get(v.get_value()))
               for p, v in nnx.to_flat_state(nnx.state(detector, nnx.Param))}
    if kept is not None:
        tensors[KEPT_KEY] = np.asarray(kept, np.int32)
    write_safetensors(os.path.join(path, WEIGHTS_FILE), tensors)
    with open(os.path.join(path, CONFIG_FILE), "w") as f:
        json.dump(config_to_dict(detector.config), f, indent=2, default=str)


def read_config(path: str, **base_overrides: Any) -> DetectorConfig:
    fn = os.path.join(path, CONFIG_FILE)
    if not os.path.exists(fn):
        raise FileNotFoundError(f"{fn}: no detector config (not a pruned detector directory)")
    with open(fn) as f:
        return config_from_dict(json.load(f), source=fn, **base_overrides)


def load_detector(path: str, *, mesh: jax.sharding.Mesh | None = None, rules: axes.Rules = axes.RULES,
                  config: DetectorConfig | None = None) -> Detector:
    """The detector saved in ``path`` (``config``: its config with other compute fields), each tensor
    placed by its logical names on ``mesh`` as the train state's shardings put it."""
    config = config or read_config(path)
    abstract = nnx.eval_shape(lambda: Detector(config, rngs=nnx.Rngs(0)))
    f = SafetensorsFile(os.path.join(path, WEIGHTS_FILE))
    try:
        for p, var in nnx.to_flat_state(nnx.state(abstract, nnx.Param)):
            key = "/".join(map(str, p))
            if key not in f.header:
                raise ValueError(f"{os.path.join(path, WEIGHTS_FILE)}: missing tensor {key!r}")
            a = f.get(key)
            if tuple(a.shape) != tuple(var.shape):
                raise ValueError(f"{os.path.join(path, WEIGHTS_FILE)}: tensor {key!r} has shape {a.shape}, "
                                 f"{CONFIG_FILE} says {tuple(var.shape)}")
            a = a.astype(var.dtype)
            if mesh is None:
                var.set_value(jnp.asarray(a))
                continue
            names = var.get_metadata().get("out_sharding") or (None,) * a.ndim
            sh = jax.sharding.NamedSharding(mesh, axes.partition_spec(a.shape, names, mesh, rules, where=key))
            var.set_value(jax.make_array_from_callback(a.shape, sh, lambda idx, a=a: a[idx]))
    finally:
        f.close()
    return abstract


def kept_channels(path: str) -> np.ndarray:
    """The kept channel indices [L, k] a pruned detector directory records."""
    f = SafetensorsFile(os.path.join(path, WEIGHTS_FILE))
    try:
        return f.get(KEPT_KEY)
    finally:
        f.close()
