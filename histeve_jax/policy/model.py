"""The HiSTEVE policy module: Qwen2.5-VL with RS-Norm and Dual-Mouse action-token rows.

* RS-Norm: the base model is built with ``norm_regimes=2`` (``PolicyConfig.rs_norm``; 1 in the ablation), so
  each decoder layer's pre-attention and pre-MLP RMSNorm keep a [2, d] scale (row 0 NG, row 1 GUI) chosen per
  sequence by ``regime``; ``load_hf`` copies the pretrained scale into both rows, so at initialisation the
  policy *is* the base model in either regime. Everything else is shared; the policy adds exactly 2 * L * d
  parameters.
* Dual-Mouse rows: the action rows (embedding and lm_head) start at the mean of the pretrained rows plus
  small noise: the mean keeps the new inputs in the distribution the layers were trained on and gives each
  action token about the average logit, so the pretrained text distribution barely moves; the noise makes
  the rows distinct from the first step.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from histeve_jax.models.qwen2_5_vl import Qwen2_5_VLModel, load_hf, resize_token_embeddings
from histeve_jax.policy.config import PolicyConfig
from histeve_jax.policy.loss import action_loss


def _init_rows(key: jax.Array, w_ve: jax.Array, ids: jax.Array, n_pretrained: int, noise: float) -> jax.Array:
    """``w_ve`` with rows ``ids`` set to the mean of the first ``n_pretrained`` rows plus relative noise."""
    old = w_ve[:n_pretrained].astype(jnp.float32)
    mean, std = old.mean(0), old.std(0)
    rows = mean + noise * std * jax.random.normal(key, (ids.shape[0], w_ve.shape[1]), jnp.float32)
    return w_ve.at[ids].set(rows.astype(w_ve.dtype))


def init_action_rows(model: Qwen2_5_VLModel, config: PolicyConfig, key: jax.Array) -> None:
    """Initialise the action tokens' embedding (and untied lm_head) rows in place (module docstring)."""
    ids = jnp.asarray(config.vocab.ids, jnp.int32)
    n_pre = min(config.action_token_base, config.base.text.vocab_size)
    noise = config.row_init_noise
    k_embed, k_head = jax.random.split(key)
    lm = model.language_model
    w = lm.embed.get_value()
    rows = jax.jit(_init_rows, static_argnums=(3, 4), out_shardings=w.sharding)
    lm.embed.set_value(rows(k_embed, w, ids, n_pre, noise))
    if not model.config.tie_word_embeddings:
        w = model.lm_head.get_value()  # [E, V]
        cols = jax.jit(lambda k, w, i: _init_rows(k, w.T, i, n_pre, noise).T, out_shardings=w.sharding)
        model.lm_head.set_value(cols(k_head, w, ids))


class Policy(nnx.Module):
    """Qwen2.5-VL with RS-Norm and Dual-Mouse rows; ``policy.loss(batch)`` is the imitation loss. Sample
    actions with a ``policy.sampling.ActionSampler`` the caller keeps."""

    def __init__(
        self, config: PolicyConfig, *, rngs: nnx.Rngs | None = None, model: Qwen2_5_VLModel | None = None
    ):
        self.config = config
        if model is None:
            if rngs is None:
                raise ValueError("Policy: pass rngs= (random init) or model= (a loaded base model)")
            model = Qwen2_5_VLModel(config.model_config, rngs=rngs)
        if model.config.norm_regimes != config.norm_regimes:
            raise ValueError(f"Policy: the model has norm_regimes={model.config.norm_regimes}, its config "
                             f"(rs_norm={config.rs_norm}) needs {config.norm_regimes}")
        if model.config.text.vocab_size != config.vocab_size:
            raise ValueError(
                f"Policy: model vocab_size {model.config.text.vocab_size} != config's {config.vocab_size}"
            )
        self.model = model

    @classmethod
    def from_pretrained(cls, path: str, config: PolicyConfig, *, seed: int = 0, **load_kw: Any) -> Policy:
        """The policy at initialisation from a Hugging Face Qwen2.5-VL directory (``load_hf`` keywords)."""
        # the layout the config says (the train state, its checkpoints and plans are built from it), not
        # load_hf's per-backend default
        overrides = {"norm_regimes": config.norm_regimes, "scan_layers": config.base.scan_layers,
                     **load_kw.pop("config_overrides", {})}
        model = load_hf(path, config_overrides=overrides, **load_kw)
        if model.config.text.vocab_size != config.base.text.vocab_size:
            raise ValueError(
                f"{path}: vocab_size {model.config.text.vocab_size} != PolicyConfig.base's "
                f"{config.base.text.vocab_size}"
            )
        if config.vocab_size > model.config.text.vocab_size:
            resize_token_embeddings(model, config.vocab_size)
        init_action_rows(model, config, jax.random.key(seed))
        return cls(config, model=model)

    def check_tokenizer(self, tokenizer: Any) -> None:
        """Raise unless ``tokenizer``'s action-token ids are the ones this policy was built with."""
        self.config.check_tokenizer(tokenizer)

    def loss(self, batch: Mapping[str, Any]) -> tuple[jax.Array, dict[str, jax.Array]]:
        return action_loss(self, batch)
