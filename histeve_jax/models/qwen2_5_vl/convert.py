"""Convert between a HF `save_pretrained` dir and an orbax checkpoint of our parameters.

    python -m histeve_jax.models.qwen2_5_vl.convert hf2orbax --src HF_DIR --dst CKPT [--dtype bfloat16]
    python -m histeve_jax.models.qwen2_5_vl.convert orbax2hf --src CKPT --dst HF_DIR [--regime 0]

The orbax dir holds `params/` (the nnx.Param state) and `config.json` (HF fields + our `histeve` extras).
"""

from __future__ import annotations

import argparse
import json
import os

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from flax import nnx

from histeve_jax.models.qwen2_5_vl.config import Qwen2_5_VLConfig
from histeve_jax.models.qwen2_5_vl.model import Qwen2_5_VLModel
from histeve_jax.models.qwen2_5_vl.weights import load_hf, save_hf
from histeve_jax.parallel import axes

_EXTRAS = ("scan_layers", "remat", "norm_regimes")


def save_orbax(model: Qwen2_5_VLModel, path: str) -> None:
    """Writes `path/params` (orbax) and `path/config.json`."""
    path = os.path.abspath(path)
    os.makedirs(path, exist_ok=True)
    cfg = model.config
    d = cfg.to_hf_dict()
    d["histeve"] = {k: getattr(cfg, k) for k in _EXTRAS} | {"dtype": jnp.dtype(cfg.dtype).name}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(d, f, indent=2)
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(os.path.join(path, "params"), nnx.state(model, nnx.Param), force=True)


def load_orbax(
    path: str, *, mesh: jax.sharding.Mesh | None = None, rules: axes.Rules = axes.RULES, **overrides
) -> Qwen2_5_VLModel:
    """Reads a checkpoint written by `save_orbax` (parameters restored in their saved dtype; with a mesh, each
    placed by its logical names, shape and `rules`, as `load_hf` places it)."""
    path = os.path.abspath(path)
    fn = os.path.join(path, "config.json")
    with open(fn) as f:
        d = json.load(f)
    extras = d.pop("histeve", {})
    kw = {k: extras[k] for k in _EXTRAS if k in extras}
    if "dtype" in extras:
        kw["dtype"] = jnp.dtype(extras["dtype"])
    kw["param_dtype"] = jnp.dtype(d.get("dtype", "float32"))
    cfg = Qwen2_5_VLConfig.from_hf_dict(d, source=fn).replace(**{**kw, **overrides})
    model = nnx.eval_shape(lambda: Qwen2_5_VLModel(cfg, rngs=nnx.Rngs(0)))
    abstract = nnx.state(model, nnx.Param)
    if mesh is not None:

        def with_sharding(path, v):
            names = v.get_metadata().get("out_sharding") or (None,) * len(v.shape)
            where = jax.tree_util.keystr(path, simple=True, separator="/")
            spec = axes.partition_spec(v.shape, names, mesh, rules, where=where)
            sh = jax.sharding.NamedSharding(mesh, spec)
            # Keep the Variable around it: the restore target must have the saved tree's structure.
            return v.replace(jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sh))

        abstract = jax.tree_util.tree_map_with_path(
            with_sharding, abstract, is_leaf=lambda x: isinstance(x, nnx.Variable)
        )
    with ocp.StandardCheckpointer() as ckpt:
        state = ckpt.restore(os.path.join(path, "params"), abstract)
    nnx.update(model, state)
    return model


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("direction", choices=["hf2orbax", "orbax2hf"])
    p.add_argument("--src", required=True)
    p.add_argument("--dst", required=True)
    p.add_argument("--dtype", default="float32", help="parameter dtype when reading HF weights")
    p.add_argument("--no_scan", action="store_true", help="keep decoder layers unstacked")
    p.add_argument("--regime", type=int, default=None, help="RS-Norm row to export (orbax2hf)")
    p.add_argument("--max_shard_size", default="5GB")
    a = p.parse_args(argv)
    if a.direction == "hf2orbax":
        model = load_hf(a.src, dtype=jnp.dtype(a.dtype), config_overrides={"scan_layers": not a.no_scan})
        save_orbax(model, a.dst)
    else:
        model = load_orbax(a.src)
        save_hf(model, a.dst, regime=a.regime, max_shard_size=a.max_shard_size)
    print(f"{a.direction}: {a.src} -> {a.dst}")


if __name__ == "__main__":
    main()
