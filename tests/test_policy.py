"""The HiSTEVE policy: RS-Norm starts as the base model, adds 2Ld params, trains per regime; the loss."""

from __future__ import annotations

import copy

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from conftest import assert_close_to_reference, qwen_images, qwen_vision_block
from flax import nnx

from histeve_jax.actions import Regime
from histeve_jax.losses import masked_cross_entropy
from histeve_jax.models.qwen2_5_vl import Qwen2_5_VLModel, qwen2_5_vl_7b, tiny
from histeve_jax.policy import Policy, PolicyConfig, action_loss, tiny_config

IM_END = 7  # stands in for <|im_end|> in the tiny model's vocabulary


@pytest.fixture(scope="module")
def policy(qwen_tiny_dir):
    return Policy.from_pretrained(qwen_tiny_dir[2], tiny_config())


def _n_params(module) -> int:
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(module, nnx.Param)))


def make_batch(config: PolicyConfig, actions, regimes, seed: int = 0, text_len: int = 5):
    """A right-padded training batch: frames, instruction -> action tokens + <|im_end|> (Featurize's)."""
    base = config.base
    rng = np.random.default_rng(seed)
    vocab = config.vocab
    n = len(actions)
    pv, grid = qwen_images([config.image_size] * n * config.num_frames, seed=seed)
    rows = []
    for i, (a, r) in enumerate(zip(actions, regimes, strict=True)):
        prompt = [1, 2]
        for f in range(config.num_frames):
            prompt += qwen_vision_block(base, grid[i * config.num_frames + f], base.image_token_id)
        prompt += rng.integers(10, 290, size=text_len + i % 3).tolist()
        rows.append((prompt, vocab.encode(a, r).tolist() + [IM_END]))
    L = max(len(p) + len(t) for p, t in rows)
    ids = np.zeros((n, L), np.int32)
    am = np.zeros((n, L), np.int32)
    lm = np.zeros((n, L), np.float32)
    for i, (p, t) in enumerate(rows):
        seq = p + t
        ids[i, : len(seq)] = seq
        am[i, : len(seq)] = 1
        lm[i, len(p) - 1 : len(seq) - 1] = 1
    targets = np.zeros_like(ids)
    targets[:, :-1] = ids[:, 1:]
    return {
        "input_ids": ids, "attention_mask": am, "targets": targets, "loss_mask": lm,
        "regime": np.asarray(regimes, np.int32), "pixel_values": pv, "image_grid_thw": grid,
    }


ACTIONS = [
    {"forward": 1, "attack": 1, "camera": np.array([3.0, -1.0])},
    {"inventory": 1, "camera": np.array([0.0, 0.0])},
    {"hotbar.3": 1, "use": 1, "sneak": 1, "camera": np.array([-0.5, 8.0])},
]


def test_policy_equals_base_model_at_init_in_either_regime(qwen_tiny_dir, policy):
    cfg, hf, _ = qwen_tiny_dir
    config = policy.config
    # The base model with the same action rows (HF's table grown and the policy's rows copied in).
    ref = copy.deepcopy(hf)
    ref.resize_token_embeddings(config.vocab_size, mean_resizing=False)
    m = policy.model
    with torch.no_grad():
        ref.get_input_embeddings().weight.copy_(torch.tensor(np.asarray(m.language_model.embed[...])))
        ref.get_output_embeddings().weight.copy_(torch.tensor(np.asarray(m.lm_head[...]).T))
    # Each action in all-NG, all-GUI and mixed batches (rows 0-2, 3-5, 6-8), in one forward pass.
    regimes = [0, 0, 0, 1, 1, 1, 0, 1, 1]
    batch = make_batch(config, ACTIONS * 3, regimes)
    t = {k: torch.tensor(batch[k]).long() for k in ("input_ids", "attention_mask", "image_grid_thw")}
    t["pixel_values"] = torch.tensor(batch["pixel_values"])
    mm = (batch["input_ids"] == cfg.image_token_id).astype(np.int64)
    with torch.no_grad():
        want = ref(**t, mm_token_type_ids=torch.tensor(mm)).logits.numpy()
    got = np.asarray(
        m(
            jnp.asarray(batch["input_ids"]), attention_mask=jnp.asarray(batch["attention_mask"]),
            pixel_values=jnp.asarray(batch["pixel_values"]), image_grid_thw=batch["image_grid_thw"],
            regime=jnp.asarray(regimes),
        )
    )
    valid = batch["attention_mask"].astype(bool)
    assert_close_to_reference(got, want, where=valid)


def test_action_rows_start_near_the_mean_and_distinct(policy):
    config = policy.config
    w = np.asarray(policy.model.language_model.embed[...])
    old, new = w[: config.base.text.vocab_size], w[config.vocab.ids]
    assert np.abs(new - old.mean(0)).max() < 0.2 * old.std(0).max()
    assert len({r.tobytes() for r in new}) == len(new)


@pytest.mark.parametrize(
    "base, resized_rows",
    [
        (qwen2_5_vl_7b(), 0),  # 152064 rows: the action tokens sit in the spare rows
        (tiny().replace(text={"vocab_size": 400}), 0),
        (tiny(tie_word_embeddings=True).replace(text={"vocab_size": 400}), 0),
        (tiny(), 63),  # 320 rows: the 63 VPT tokens are appended to embed and lm_head
    ],
)
def test_rs_norm_adds_2Ld_params(base, resized_rows):
    config = PolicyConfig(base=base, action_token_base=151665 if base.text.vocab_size > 1000 else 304)
    if resized_rows:
        config = tiny_config(base=base)
    L, d = base.text.num_hidden_layers, base.text.hidden_size
    n_base = _n_params(nnx.eval_shape(lambda: Qwen2_5_VLModel(base, rngs=nnx.Rngs(0))))
    n_policy = _n_params(nnx.eval_shape(lambda: Policy(config, rngs=nnx.Rngs(0))))
    tables = 1 if base.tie_word_embeddings else 2
    assert n_policy - n_base == 2 * L * d + tables * resized_rows * d


def test_gui_step_changes_only_gui_rows(policy):
    from histeve_jax.train.optimizer import make_optimizer
    from histeve_jax.train.state import state_from_model
    from histeve_jax.train.step import make_train_step

    tx, schedule = make_optimizer({"learning_rate": 1e-2, "warmup_steps": 0, "total_steps": 10})
    state = state_from_model(policy, tx)
    step = jax.jit(make_train_step(action_loss, tx, schedule=schedule))
    batch = jax.tree.map(jnp.asarray, make_batch(policy.config, ACTIONS, [1, 1, 1]))
    batch.pop("image_grid_thw")  # static from the config; a traced grid would not be concrete
    new, metrics = step(state, batch, jax.random.key(0))
    assert np.isfinite(float(metrics["loss"]))
    before, after = policy, new.model()
    for name in ("input_norm", "post_attn_norm"):
        s0 = np.asarray(getattr(before.model.language_model.layers, name).scale[...])
        s1 = np.asarray(getattr(after.model.language_model.layers, name).scale[...])
        assert s0.shape == (3, 2, 64)
        np.testing.assert_array_equal(s1[:, Regime.NG], s0[:, Regime.NG])
        assert np.all(np.abs(s1[:, Regime.GUI] - s0[:, Regime.GUI]).max(-1) > 0)


def test_action_loss_is_the_masked_ce_of_the_full_logits(policy):
    batch = make_batch(policy.config, ACTIONS, [0, 1, 1], seed=3)
    loss, metrics = action_loss(policy, jax.tree.map(jnp.asarray, batch))
    logits = policy.model(
        jnp.asarray(batch["input_ids"]), attention_mask=jnp.asarray(batch["attention_mask"]),
        pixel_values=jnp.asarray(batch["pixel_values"]), image_grid_thw=batch["image_grid_thw"],
        regime=jnp.asarray(batch["regime"]),
    )
    want, n = masked_cross_entropy(logits, jnp.asarray(batch["targets"]), jnp.asarray(batch["loss_mask"]))
    np.testing.assert_allclose(float(loss), float(want), rtol=1e-5)
    # 6 + 3 + 7 action tokens (both mouse axes move in rows 0 and 2), each followed by <|im_end|>.
    assert float(metrics["n_targets"]) == float(n) == 19 and float(metrics["dropped_targets"]) == 0
    counts = {k[len("count/"):]: float(v) for k, v in metrics.items() if k.startswith("count/")}
    assert counts == {
        "type": 3, "inventory": 1, "hotbar": 1, "fore_back": 1, "left_right": 0, "sprint_sneak": 1, "use": 1,
        "drop": 0, "attack": 1, "jump": 0, "cam_pitch": 1, "cam_yaw": 1, "cur_dy": 1, "cur_dx": 1, "end": 3,
        "other": 3,
    }
    assert {"acc/type", "acc/hotbar", "acc/cur_dx", "action_exact"} <= set(metrics)


def test_bad_batch_raises_naming_the_key(policy):
    batch = make_batch(policy.config, ACTIONS[:1], [0])
    batch["pixel_values"] = batch["pixel_values"][:-3]
    with pytest.raises(ValueError, match="'pixel_values'"):
        action_loss(policy, batch)
    batch = make_batch(policy.config, ACTIONS[:1], [0])
    batch["image_grid_thw"] = np.asarray([[1, 2, 8]])
    with pytest.raises(ValueError, match="'image_grid_thw'"):
        action_loss(policy, batch)


def test_microbatched_action_loss_gradient_is_the_full_batch_one(policy):
    """Replies of 7, 4, 8 and 3 targets in 2 strided microbatches (15 vs 7 targets): the accumulated gradient
    and the loss are the full batch's masked mean, which weighting the microbatches equally is not."""
    import optax

    from histeve_jax.train.state import state_from_model
    from histeve_jax.train.step import make_train_step

    actions = [*ACTIONS, {"camera": np.array([0.0, 0.0])}]
    batch = jax.tree.map(jnp.asarray, make_batch(policy.config, actions, [0, 1, 0, 1], seed=5))
    batch.pop("image_grid_thw")
    batch["pixel_values"] = batch["pixel_values"].reshape(4, -1, batch["pixel_values"].shape[-1])  # per row
    # An "optimizer" that keeps the gradient it is given in its state (params stay), to read it back exactly.
    tx = optax.GradientTransformation(
        lambda params: jax.tree.map(jnp.zeros_like, params),
        lambda grads, state, params=None: (jax.tree.map(jnp.zeros_like, grads), grads))
    state = state_from_model(policy, tx)

    steps = {k: jax.jit(make_train_step(action_loss, tx, microbatches=k)) for k in (1, 2)}  # compiled once

    def grad_and_metrics(microbatches, b):
        new, metrics = steps[microbatches](state, b, jax.random.key(0))
        return new.opt_state, metrics

    full, full_m = grad_and_metrics(1, batch)
    micro, micro_m = grad_and_metrics(2, batch)
    # The oracle: each microbatch's own gradient of its masked mean, weighted by its target count. Rows do
    # not interact, so the full batch with the loss masked to one microbatch's rows (strided: 0, 2 and
    # 1, 3) gives that microbatch's gradient, from the same compiled step.
    def only(rows):
        keep = np.zeros((4, 1), np.float32)
        keep[list(rows)] = 1
        return {**batch, "loss_mask": batch["loss_mask"] * keep}

    (g0, m0), (g1, m1) = grad_and_metrics(1, only((0, 2))), grad_and_metrics(1, only((1, 3)))
    n0, n1 = float(m0["n_targets"]), float(m1["n_targets"])
    assert (n0, n1) == (15.0, 7.0)
    weighted = jax.tree.map(lambda a, b: (n0 * a + n1 * b) / (n0 + n1), g0, g1)
    equal = jax.tree.map(lambda a, b: (a + b) / 2, g0, g1)

    def rel(a, b):  # the largest over leaves of max|a - b| / max|b|
        return max(float(jnp.abs(x - y).max() / jnp.maximum(jnp.abs(y).max(), 1e-30))
                   for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))

    assert rel(weighted, full) < 1e-5 and rel(micro, full) < 1e-5, (rel(weighted, full), rel(micro, full))
    assert rel(equal, full) > 1e-2  # equal weights would be told apart by far
    want_loss = (n0 * float(m0["loss"]) + n1 * float(m1["loss"])) / (n0 + n1)
    np.testing.assert_allclose([float(micro_m["loss"]), float(full_m["loss"])], want_loss, rtol=1e-6)
    assert float(micro_m["n_targets"]) == float(full_m["n_targets"]) == 22


def test_without_rs_norm_the_pre_norms_have_one_shared_scale():
    """The ablation's policy (``rs_norm=False``): one [d] scale per pre-norm, 2Ld parameters fewer than with
    RS-Norm, and the same logits whatever regime the batch says."""
    shared = tiny_config(rs_norm=False)
    with_rs = tiny_config()
    L, d = shared.base.text.num_hidden_layers, shared.base.text.hidden_size
    n = {c.rs_norm: _n_params(nnx.eval_shape(lambda c=c: Policy(c, rngs=nnx.Rngs(0))))
         for c in (shared, with_rs)}
    assert n[True] - n[False] == 2 * L * d
    policy = Policy(shared, rngs=nnx.Rngs(0))
    assert policy.model.config.norm_regimes == 1
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 200, (2, 12)), jnp.int32)
    logits = [policy.model(ids, regime=jnp.full((2,), r, jnp.int32)) for r in (0, 1)]
    np.testing.assert_array_equal(np.asarray(logits[0]), np.asarray(logits[1]))


def test_rope_theta_sets_a_random_policys_mrope_base_and_only_its():
    """config.model.rope_theta: Qwen's 1e6 leaves a head_dim-16 decoder's width section turning by under
    0.002 rad across a 7-token row; a random model may take another base, a pretrained one may not."""
    from experiments.configs.imitation import get_config
    from histeve_jax.models.qwen2_5_vl.rope import mrope_cos_sin
    from histeve_jax.train import setup
    from histeve_jax.train.specs import RunSpec

    c = get_config("tiny")
    default = setup.policy_config(RunSpec.from_config(c, "/tmp/unused"))
    assert default.base.text.rope_theta == 1e6
    c.model.rope_theta = 10.0
    cfg = setup.policy_config(RunSpec.from_config(c, "/tmp/unused"))
    assert cfg.base.text.rope_theta == 10.0
    t = cfg.base.text
    pos = jnp.zeros((3, 1, 7), jnp.int32).at[2, 0].set(jnp.arange(7))  # one row of 7 columns
    for theta, lo, hi in ((1e6, 0.0, 2e-3), (10.0, 0.5, 7.0)):
        cos, sin = mrope_cos_sin(pos, t.head_dim, theta, t.mrope_section, jnp.float32)
        angle = np.arctan2(np.asarray(sin[0, -1]), np.asarray(cos[0, -1]))  # column 6 against column 0
        assert lo <= float(np.abs(angle).max()) <= hi, (theta, angle)
    c.model.kind, c.model.hf_path = "hf", "/tmp/some_checkpoint"
    with pytest.raises(ValueError, match="rope_theta"):
        RunSpec.from_config(c, "/tmp/unused")
