"""Hugging Face weight I/O: `load_hf` (safetensors dir -> model, tensor by tensor, optionally sharded on a
mesh) and `save_hf` (model -> a dir `transformers` loads), plus `resize_token_embeddings`."""

from __future__ import annotations

import dataclasses
import json
import mmap
import os
import struct
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from histeve_jax.models.qwen2_5_vl.config import Qwen2_5_VLConfig
from histeve_jax.models.qwen2_5_vl.model import Qwen2_5_VLModel
from histeve_jax.parallel import axes

SAFE_INDEX = "model.safetensors.index.json"
SAFE_SINGLE = "model.safetensors"

_ST_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
}
_ST_NAMES = {np.dtype(v): k for k, v in _ST_DTYPES.items()}


# ---------------------------------------------------------------------- safetensors (numpy; bf16: ml_dtypes)


class SafetensorsFile:
    """A memory-mapped safetensors file read tensor by tensor."""

    def __init__(self, path: str):
        self.path = path
        self._f = open(path, "rb")
        try:
            (n,) = struct.unpack("<Q", self._f.read(8))
            self.header = json.loads(self._f.read(n))
        except Exception as e:  # noqa: BLE001 - any parse failure means a broken file
            self._f.close()
            raise ValueError(f"{path}: not a safetensors file ({e})") from e
        self.header.pop("__metadata__", None)
        self._base = 8 + n
        self._mm = mmap.mmap(self._f.fileno(), 0, access=mmap.ACCESS_READ)

    def keys(self) -> list[str]:
        return list(self.header)

    def get(self, key: str) -> np.ndarray:
        info = self.header[key]
        if info["dtype"] not in _ST_DTYPES:
            raise ValueError(f"{self.path}: tensor {key!r} has unsupported dtype {info['dtype']}")
        a, b = info["data_offsets"]
        dt = np.dtype(_ST_DTYPES[info["dtype"]])
        # A copy, so no view outlives the mmap; one tensor at a time is the peak extra memory.
        buf = np.frombuffer(self._mm, dtype=dt, count=(b - a) // dt.itemsize, offset=self._base + a)
        return buf.reshape(info["shape"]).copy()

    def close(self) -> None:
        self._mm.close()
        self._f.close()


def write_safetensors(
    path: str, tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None
) -> None:
    """Writes numpy arrays (bf16 via ml_dtypes allowed) as one safetensors file."""
    header: dict[str, Any] = {"__metadata__": metadata or {"format": "pt"}}
    off = 0
    for k, a in tensors.items():
        n = a.nbytes
        header[k] = {"dtype": _ST_NAMES[a.dtype], "shape": list(a.shape), "data_offsets": [off, off + n]}
        off += n
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hb)))
        f.write(hb)
        for a in tensors.values():
            f.write(np.ascontiguousarray(a).tobytes())


# ---------------------------------------------------------------------- the name map


@dataclasses.dataclass(frozen=True)
class TensorMap:
    """One HF tensor <-> one of our parameters (or one layer slice of a stacked one).
    kind: 'id' (same layout), 'linear' (HF [out, in] -> ours [*in, *out] with `n_in` input dims),
    'bias' (flat -> shaped), 'norm' (RS-Norm: [d] -> [regimes, d]), 'patch' (Conv3d -> [C*T*P*P, E])."""

    hf: str
    path: tuple[str | int, ...]
    kind: str
    n_in: int = 1
    layer: int | None = None  # index into the LAYERS axis of a stacked parameter


def tensor_maps(cfg: Qwen2_5_VLConfig) -> Iterator[TensorMap]:
    """All tensors of the model, in the HF (legacy, as transformers 5.24 saves) naming."""
    yield TensorMap("model.embed_tokens.weight", ("language_model", "embed"), "id")
    for i in range(cfg.text.num_hidden_layers):
        hp = f"model.layers.{i}."
        base: tuple = ("language_model", "layers") if cfg.scan_layers else ("language_model", "layers", i)
        L = i if cfg.scan_layers else None
        for n in ("q", "k", "v"):
            yield TensorMap(hp + f"self_attn.{n}_proj.weight", (*base, "attn", n), "linear", 1, L)
            yield TensorMap(hp + f"self_attn.{n}_proj.bias", (*base, "attn", f"{n}_bias"), "bias", 1, L)
        yield TensorMap(hp + "self_attn.o_proj.weight", (*base, "attn", "o"), "linear", 2, L)
        for n in ("gate", "up", "down"):
            yield TensorMap(hp + f"mlp.{n}_proj.weight", (*base, "mlp", n), "linear", 1, L)
        yield TensorMap(hp + "input_layernorm.weight", (*base, "input_norm", "scale"), "norm", 1, L)
        yield TensorMap(
            hp + "post_attention_layernorm.weight", (*base, "post_attn_norm", "scale"), "norm", 1, L
        )
    yield TensorMap("model.norm.weight", ("language_model", "norm", "scale"), "id")
    if not cfg.tie_word_embeddings:
        yield TensorMap("lm_head.weight", ("lm_head",), "linear")
    yield TensorMap("visual.patch_embed.proj.weight", ("visual", "patch_embed"), "patch")
    for i in range(cfg.vision.depth):
        hp, base = f"visual.blocks.{i}.", ("visual", "blocks", i)
        yield TensorMap(hp + "attn.qkv.weight", (*base, "attn", "qkv"), "linear")
        yield TensorMap(hp + "attn.qkv.bias", (*base, "attn", "qkv_bias"), "bias")
        yield TensorMap(hp + "attn.proj.weight", (*base, "attn", "proj"), "linear", 2)
        yield TensorMap(hp + "attn.proj.bias", (*base, "attn", "proj_bias"), "bias")
        for n in ("gate", "up", "down"):
            yield TensorMap(hp + f"mlp.{n}_proj.weight", (*base, "mlp", n), "linear")
            yield TensorMap(hp + f"mlp.{n}_proj.bias", (*base, "mlp", f"{n}_bias"), "bias")
        yield TensorMap(hp + "norm1.weight", (*base, "norm1", "scale"), "id")
        yield TensorMap(hp + "norm2.weight", (*base, "norm2", "scale"), "id")
    yield TensorMap("visual.merger.ln_q.weight", ("visual", "merger", "ln_q", "scale"), "id")
    yield TensorMap("visual.merger.mlp.0.weight", ("visual", "merger", "fc1"), "linear")
    yield TensorMap("visual.merger.mlp.0.bias", ("visual", "merger", "fc1_bias"), "bias")
    yield TensorMap("visual.merger.mlp.2.weight", ("visual", "merger", "fc2"), "linear")
    yield TensorMap("visual.merger.mlp.2.bias", ("visual", "merger", "fc2_bias"), "bias")


def _hf_shape(cfg: Qwen2_5_VLConfig, m: TensorMap, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The HF tensor shape for our (per-layer) parameter shape."""
    if m.kind == "linear":
        return (int(np.prod(shape[m.n_in :])), int(np.prod(shape[: m.n_in])))
    if m.kind == "bias":
        return (int(np.prod(shape)),)
    if m.kind == "norm":
        return (shape[-1],)
    if m.kind == "patch":
        v = cfg.vision
        return (v.hidden_size, v.in_channels, v.temporal_patch_size, v.patch_size, v.patch_size)
    return shape


def _to_ours(m: TensorMap, a: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    if m.kind == "linear":
        return a.T.reshape(shape)
    if m.kind == "patch":
        return a.reshape(a.shape[0], -1).T
    if m.kind == "norm" and len(shape) == 2:  # RS-Norm: every regime starts from the pretrained scale
        return np.broadcast_to(a, shape)
    return a.reshape(shape)


def _to_hf(cfg: Qwen2_5_VLConfig, m: TensorMap, a: np.ndarray, regime: int | None) -> np.ndarray:
    if m.kind == "linear":
        n_in = int(np.prod(a.shape[: m.n_in]))
        return np.ascontiguousarray(a.reshape(n_in, -1).T)
    if m.kind == "patch":
        return np.ascontiguousarray(a.T).reshape(_hf_shape(cfg, m, a.shape))
    if m.kind == "norm" and a.ndim == 2:
        return np.ascontiguousarray(a[regime or 0])
    return np.ascontiguousarray(a).reshape(_hf_shape(cfg, m, a.shape))


def _normalize_key(k: str) -> str:
    """transformers' newer naming (`model.language_model.*`, `model.visual.*`) -> the legacy one."""
    if k.startswith("model.language_model."):
        return "model." + k[len("model.language_model.") :]
    if k.startswith("model.visual."):
        return k[len("model.") :]
    return k


# ---------------------------------------------------------------------- load


def _open_checkpoint(path: str) -> tuple[dict[str, tuple[str, str]], dict[str, SafetensorsFile]]:
    """normalized key -> (filename, key in the file), and the opened files."""
    idx_fn, one_fn = os.path.join(path, SAFE_INDEX), os.path.join(path, SAFE_SINGLE)
    if os.path.exists(idx_fn):
        with open(idx_fn) as f:
            wm = json.load(f).get("weight_map")
        if not isinstance(wm, dict):
            raise ValueError(f"{idx_fn}: missing 'weight_map'")
    elif os.path.exists(one_fn):
        wm = None
    else:
        raise FileNotFoundError(f"{path}: neither {SAFE_SINGLE} nor {SAFE_INDEX}")
    files: dict[str, SafetensorsFile] = {}
    key_file: dict[str, tuple[str, str]] = {}
    for fn in sorted(set(wm.values())) if wm else [SAFE_SINGLE]:
        full = os.path.join(path, fn)
        if not os.path.exists(full):
            raise FileNotFoundError(f"{full}: listed in {SAFE_INDEX} but missing")
        files[fn] = SafetensorsFile(full)
        for k in files[fn].keys():
            nk = _normalize_key(k)
            if nk in key_file:
                raise ValueError(f"{full}: tensor {k!r} duplicates one in {key_file[nk][0]}")
            key_file[nk] = (fn, k)
    return key_file, files


def _sharding(var: nnx.Variable, mesh, rules: axes.Rules, where: str) -> jax.sharding.Sharding | None:
    """Where the rules put this tensor on ``mesh`` (as the train state's ``tree_shardings`` does)."""
    if mesh is None:
        return None
    names = var.get_metadata().get("out_sharding") or (None,) * len(var.shape)
    return jax.sharding.NamedSharding(mesh, axes.partition_spec(var.shape, names, mesh, rules, where=where))


def default_scan_layers() -> bool:
    """The decoder layout `load_hf` gives when not told: stacked (one [L, ...] parameter per weight, run by
    `lax.scan`, compiled once per layer shape) on accelerators; separate per-layer parameters on the CPU
    backend. XLA:CPU runs the layers unrolled either way (`layer_loop="auto"`), and there a stack costs
    copies: every step slices each layer's weights out of the stacks and concatenates their gradients back,
    and a `Sampler` keeps a per-layer copy of the weights (`experiments.benchmarks.model_vs_transformers`
    measures both layouts; `--stacked` for the stacked one)."""
    return jax.default_backend() != "cpu"


def load_hf(
    path: str,
    *,
    dtype=jnp.float32,
    mesh: jax.sharding.Mesh | None = None,
    rules: axes.Rules = axes.RULES,
    config_overrides: dict[str, Any] | None = None,
) -> Qwen2_5_VLModel:
    """Loads a HF `save_pretrained` directory. Parameters (and compute) in `dtype` unless `config_overrides`
    sets `dtype`/`param_dtype`; with a mesh each tensor is placed by its logical names, shape and `rules`,
    just where a train state built from the model puts it (so building that state moves nothing).

    The decoder layers' layout is `config_overrides["scan_layers"]`, else `default_scan_layers()`: separate
    per-layer parameters on the CPU backend, stacked ones (scanned) elsewhere."""
    overrides = {"dtype": dtype, "param_dtype": dtype, "scan_layers": default_scan_layers(),
                 **(config_overrides or {})}
    cfg = Qwen2_5_VLConfig.from_pretrained_dir(path).replace(**overrides)
    model = nnx.eval_shape(lambda: Qwen2_5_VLModel(cfg, rngs=nnx.Rngs(0)))
    flat = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    key_file, files = _open_checkpoint(path)
    try:
        maps = list(tensor_maps(cfg))
        expected = {m.hf for m in maps}
        ignorable = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
        unexpected = sorted(set(key_file) - expected - ignorable)
        if unexpected:
            raise ValueError(
                f"{path}: unexpected tensor(s) {unexpected[:5]} in {key_file[unexpected[0]][0]} "
                f"({len(unexpected)} in all)"
            )
        missing = sorted(expected - set(key_file))
        if missing:
            raise ValueError(f"{path}: missing tensor(s) {missing[:5]} ({len(missing)} in all)")
        stacked: dict[tuple, np.ndarray] = {}
        done: set[tuple] = set()
        for m in maps:
            var = flat[m.path]
            full_shape = tuple(var.shape)
            shape = full_shape[1:] if m.layer is not None else full_shape
            fn, key = key_file[m.hf]
            a = files[fn].get(key)
            want = _hf_shape(cfg, m, shape)
            if tuple(a.shape) != want:
                raise ValueError(
                    f"{os.path.join(path, fn)}: tensor {key!r} has shape {tuple(a.shape)}, expected {want}"
                )
            val = _to_ours(m, a, shape).astype(var.dtype)
            if m.layer is not None:
                buf = stacked.setdefault(m.path, np.empty(full_shape, var.dtype))
                buf[m.layer] = val
                if m.layer < cfg.text.num_hidden_layers - 1:
                    continue
                val = stacked.pop(m.path)
            sh = _sharding(var, mesh, rules, "/".join(map(str, m.path)))
            if sh is None:
                var.set_value(jnp.asarray(val))
            else:
                # Each process materializes only its addressable shards (multi-host safe).
                var.set_value(jax.make_array_from_callback(val.shape, sh, lambda idx, val=val: val[idx]))
            done.add(m.path)
        left = sorted(set(flat) - done)
        if left:
            raise RuntimeError(f"internal: parameters {left[:5]} have no HF tensor")
    finally:
        for f in files.values():
            f.close()
    return model


# ---------------------------------------------------------------------- save


def _parse_size(s: int | str) -> int:
    if isinstance(s, int):
        return s
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
    s = s.strip().upper()
    for u in sorted(units, key=len, reverse=True):
        if s.endswith(u):
            return int(float(s[: -len(u)]) * units[u])
    return int(s)


def save_hf(
    model: Qwen2_5_VLModel,
    path: str,
    *,
    regime: int | None = None,
    max_shard_size: int | str = "5GB",
    dtype=None,
) -> None:
    """Writes config.json + safetensors (sharded with an index above `max_shard_size`) that
    `transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained` loads. With RS-Norm (`norm_regimes > 1`)
    `regime=` picks which scale row to export."""
    cfg = model.config
    if cfg.norm_regimes > 1 and regime is None:
        raise ValueError(
            f"save_hf: the model has norm_regimes={cfg.norm_regimes}; HF has one RMSNorm scale, "
            "pass regime=<row>"
        )
    if regime is not None and not 0 <= regime < cfg.norm_regimes:
        raise ValueError(f"save_hf: regime={regime} out of range for norm_regimes={cfg.norm_regimes}")
    os.makedirs(path, exist_ok=True)
    flat = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    out_dtype = np.dtype(dtype if dtype is not None else cfg.param_dtype)
    host: dict[tuple, np.ndarray] = {}
    limit = _parse_size(max_shard_size)
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for m in tensor_maps(cfg):
        if m.path not in host:
            host[m.path] = np.asarray(jax.device_get(flat[m.path].get_value()))
        a = host[m.path]
        if m.layer is not None:
            a = a[m.layer]
        t = _to_hf(cfg, m, a, regime).astype(out_dtype)
        if size + t.nbytes > limit and shards[-1]:
            shards.append({})
            size = 0
        shards[-1][m.hf] = t
        size += t.nbytes
        if m.layer is not None and m.layer == cfg.text.num_hidden_layers - 1:
            host.pop(m.path)
    hf_cfg = cfg.replace(param_dtype=out_dtype).to_hf_dict() if dtype is not None else cfg.to_hf_dict()
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf_cfg, f, indent=2)
    if len(shards) == 1:
        write_safetensors(os.path.join(path, SAFE_SINGLE), shards[0])
        return
    weight_map, total = {}, 0
    for i, sh in enumerate(shards):
        fn = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        write_safetensors(os.path.join(path, fn), sh)
        for k, t in sh.items():
            weight_map[k] = fn
            total += t.nbytes
    with open(os.path.join(path, SAFE_INDEX), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)


# ---------------------------------------------------------------------- vocabulary resizing


def resize_token_embeddings(
    model: Qwen2_5_VLModel,
    new_vocab: int,
    init: str | Callable[[np.ndarray, int], np.ndarray] = "mean",
) -> Qwen2_5_VLModel:
    """Grows (or truncates) the embedding and lm_head to `new_vocab` rows, in place. New rows: `"mean"` of the
    existing rows, or `init(old_rows [V, E], n_new) -> [n_new, E]` (for the embedding, then lm_head)."""
    cfg = model.config
    old = cfg.text.vocab_size

    def grow(w_ve: jax.Array) -> jax.Array:
        if new_vocab <= old:
            return w_ve[:new_vocab]
        if init == "mean":
            new = jnp.broadcast_to(jnp.mean(w_ve.astype(jnp.float32), 0), (new_vocab - old, w_ve.shape[1]))
        elif callable(init):
            new = jnp.asarray(init(np.asarray(w_ve), new_vocab - old))
        else:
            raise ValueError(f"resize_token_embeddings: init={init!r}; expected 'mean' or a callable")
        if new.shape != (new_vocab - old, w_ve.shape[1]):
            raise ValueError(f"resize_token_embeddings: init returned shape {new.shape}")
        return jnp.concatenate([w_ve, new.astype(w_ve.dtype)], 0)

    lm = model.language_model
    lm.embed.set_value(grow(lm.embed.get_value()))
    if not cfg.tie_word_embeddings:
        model.lm_head.set_value(grow(model.lm_head.get_value().T).T)
    new_cfg = cfg.replace(text={"vocab_size": new_vocab})
    model.config = new_cfg
    lm.cfg = new_cfg
    return model
