"""What a run trains and where it starts: the stage (its module and loss), the policy config from the run
spec and its base, and the train state: resumed, from a previous stage, from Hugging Face weights or fresh.

The loop (``train.loop``) and the AOT plan (``experiments.plan``) both build through here, so any base
(tiny, 3B, 7B) and any stage that plans is the one that trains.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from absl import logging
from flax import nnx

from histeve_jax.data import pipeline
from histeve_jax.data.tokenizer import NUM_TOKENIZER_IDS
from histeve_jax.models import qwen2_5_vl
from histeve_jax.policy import Policy, PolicyConfig, action_loss, tiny_config
from histeve_jax.train import data as data_lib
from histeve_jax.train import state as state_lib
from histeve_jax.train.checkpoint import Checkpointer
from histeve_jax.train.specs import RunSpec

LossFn = Callable[[nnx.Module, Any, jax.Array], tuple[jax.Array, dict[str, jax.Array]]]

# Base shapes by name, for ``config.model.base`` when no Hugging Face config.json is at hand (planning).
NAMED_BASES: dict[str, Callable[[], qwen2_5_vl.Qwen2_5_VLConfig]] = {
    "tiny": qwen2_5_vl.tiny,
    "small": qwen2_5_vl.small,
    "qwen2_5_vl_3b": qwen2_5_vl.qwen2_5_vl_3b,
    "qwen2_5_vl_7b": qwen2_5_vl.qwen2_5_vl_7b,
}
RANDOM_BASES = ("tiny", "small")  # the shapes with tiny's small vocabulary, for random (kind "tiny") runs


@dataclasses.dataclass(frozen=True)
class Stage:
    """What the loop trains: the module (random init, or pretrained), its loss and the data it reads.

    ``init_model()`` builds the module from random weights (traced for abstract and sharded init);
    ``pretrained(mesh, rules)`` loads it, placed, from pretrained weights (None: the stage has none);
    ``loss_fn(module, batch, rng) -> (loss, metrics)`` is pure; ``device_keys`` are the batch keys it reads;
    ``batches(dirs, data, train)`` is the stage's own batch iterator where its samples are not the policy's
    windows (None: ``train.data.make_iterator`` over ``features``).
    """

    name: str
    init_model: Callable[[], nnx.Module]
    loss_fn: LossFn
    features: pipeline.FeatureSpec
    device_keys: tuple[str, ...]
    pretrained: Callable[[Any, Any], nnx.Module] | None = None
    batches: Callable[[list[str], Any, bool], Any] | None = None

    def make_iterator(self, dirs: list[str], data: Any, *, train: bool) -> Any:
        """This host's batch iterator over ``dirs`` (``metrics``/``get_state``/``set_state`` as
        ``pipeline.Batches``)."""
        if self.batches is not None:
            return self.batches(dirs, data, train)
        return data_lib.make_iterator(dirs, data, self.features, train=train)


# Batch keys the policy reads; the rest (image_grid_thw) stay on the host.
POLICY_KEYS = ("input_ids", "attention_mask", "targets", "loss_mask", "regime", "pixel_values")


def _base_config(spec: RunSpec, *, named_base: bool) -> qwen2_5_vl.Qwen2_5_VLConfig:
    m = spec.model
    if m.kind == "tiny":  # a random model: tiny's vocabulary, at the shape config.model.base names
        if m.base not in RANDOM_BASES:
            raise ValueError(f"config.model.base={m.base!r}: a random (kind 'tiny') model is one of "
                             f"{RANDOM_BASES}")
        return NAMED_BASES[m.base]()
    path = os.path.join(m.hf_path, "config.json")
    if m.hf_path and os.path.exists(path):
        with open(path) as f:
            return qwen2_5_vl.Qwen2_5_VLConfig.from_hf_dict(json.load(f), source=path)
    if named_base:
        if m.base not in NAMED_BASES:
            raise ValueError(f"config.model.base={m.base!r}: choose one of {sorted(NAMED_BASES)}")
        return NAMED_BASES[m.base]()
    raise FileNotFoundError(f"config.model.hf_path={m.hf_path!r}: no config.json (a Qwen2.5-VL "
                            "save_pretrained directory is needed; models cannot be downloaded here)")


def model_overrides(spec: RunSpec) -> dict[str, Any]:
    """The base config fields the run sets: compute and parameter dtypes, remat, and a random model's
    M-RoPE base (``config.model.rope_theta``)."""
    m = spec.model
    out: dict[str, Any] = dict(dtype=jnp.dtype(m.dtype), param_dtype=jnp.dtype(m.param_dtype), remat=m.remat)
    if m.rope_theta:
        out["text"] = {"rope_theta": float(m.rope_theta)}
    return out


def policy_config(spec: RunSpec, *, named_base: bool = False) -> PolicyConfig:
    """The policy's config: tiny random, or the base read from the Hugging Face directory's config.json
    (``named_base``: or, without one, the shape ``config.model.base`` names, for planning)."""
    d = spec.data
    base = _base_config(spec, named_base=named_base).replace(**model_overrides(spec))
    kw = dict(codebook=d.codebook, history_frames=d.history if d.kind == "demo" else 0,
              image_size=d.image_size, max_targets=spec.model.max_targets, rs_norm=spec.model.rs_norm,
              dual_mouse=spec.model.dual_mouse)
    if spec.model.kind == "tiny":
        return tiny_config(base=base, **kw)
    return PolicyConfig(base=base, **kw)


def feature_spec(spec: RunSpec, cfg: PolicyConfig) -> pipeline.FeatureSpec:
    """The pipeline's FeatureSpec; a model whose table is smaller than the tokenizer (the tiny test models)
    gets the compact id remap (see ``pipeline.CompactVocab``)."""
    d, b = spec.data, cfg.base
    compact = None
    if b.text.vocab_size < NUM_TOKENIZER_IDS:
        compact = pipeline.CompactVocab(
            image_token_id=b.image_token_id, video_token_id=b.video_token_id,
            vision_start_token_id=b.vision_start_token_id, vision_end_token_id=b.vision_end_token_id,
            action_base=cfg.action_token_base)
    return pipeline.FeatureSpec(kind=d.kind, history=d.history, stride=d.stride, image_size=d.image_size,
                                max_len=d.max_len, codebook=d.codebook, dual_mouse=cfg.dual_mouse,
                                tokenizer_path=d.tokenizer_path or None, compact_vocab=compact,
                                skip_null_actions=d.skip_null_actions, history_in_regime=d.history_in_regime)


def policy_stage(spec: RunSpec, cfg: PolicyConfig | None = None) -> Stage:
    """World knowledge and imitation: the policy and its action loss (``cfg``: the policy_config's)."""
    cfg = cfg or policy_config(spec)
    seed = spec.loop.seed

    def pretrained(mesh: Any, rules: Any) -> Policy:
        return Policy.from_pretrained(spec.model.hf_path, cfg, seed=seed, mesh=mesh, rules=rules,
                                      config_overrides=model_overrides(spec))

    return Stage(
        name=spec.stage, init_model=lambda: Policy(cfg, rngs=nnx.Rngs(seed)), loss_fn=action_loss,
        features=feature_spec(spec, cfg), device_keys=POLICY_KEYS,
        pretrained=pretrained if spec.model.kind == "hf" else None,
    )


def restore_params(workdir: str, abstract: state_lib.TrainState, *, what: str = "config.init_from") -> Any:
    """The latest params of another run (its TrainState must have the same parameter tree)."""
    ckpt_dir = os.path.join(workdir, "checkpoints")
    with Checkpointer(ckpt_dir, async_save=False) as ck:
        if ck.latest_step() is None:
            raise FileNotFoundError(f"{what}={workdir!r}: no checkpoint under {ckpt_dir}")
        restored, _, _ = ck.restore(abstract)
        logging.info("%s: params of %s step %d", what, workdir, ck.latest_step())
        return restored.params


def build_state(spec: RunSpec, stage: Stage, tx: Any, mesh: Any, rules: Any,
                ckpt: Checkpointer) -> tuple[state_lib.TrainState, Any, Any]:
    """(state, its shardings, data iterator state or None): resumed, initialised from init_from, or fresh."""
    abstract, shardings = state_lib.abstract_train_state(stage.init_model, tx, mesh, rules)
    if ckpt.latest_step() is not None:
        state, data_state, _ = ckpt.restore(abstract)
        logging.info("resuming from %s step %d", ckpt.directory, int(state.step))
        return state, shardings, data_state
    init_from = spec.loop.init_from
    # With init_from the previous stage's params replace the initial ones: a random sharded init is then
    # enough, and no host reads the Hugging Face weights (15 GB for the 7B) only to drop them.
    if stage.pretrained is not None and not init_from:
        state, shardings = state_lib.shard_model_state(stage.pretrained(mesh, rules), tx, mesh, rules)
    else:
        state, shardings = state_lib.create_train_state(stage.init_model, tx, mesh, rules)
    if init_from:
        state = state.replace(params=restore_params(init_from, abstract))  # fresh optimizer and step 0
    return state, shardings, None
