"""RL losses against hand-computed values and the published formulas of TRL and Tunix, ported line for line
(trl is no dependency): TRL 1.16.0 (PyPI wheel) trl/trainer/{grpo,dpo}_trainer.py in torch, and google/tunix
at c7d8950f12a9c55a976bf2e1a0d8b447d71c20b3 tunix/rl/{algo_core,common}.py, tunix/sft/dpo/dpo_trainer.py in
numpy; file and line sit beside each port."""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from histeve_jax.losses import (
    PairLogProbs,
    RLLossConfig,
    divergence_window,
    dpo_loss,
    group_advantages,
    grpo_loss,
    masked_cross_entropy,
    pair_log_probs,
    per_token_kl,
    post_training_loss,
    reference_kl,
    token_log_probs,
    world_replay_loss,
)
from histeve_jax.models.qwen2_5_vl.generate import sample_token


def trl_group_advantages(rewards: torch.Tensor, num_generations: int) -> torch.Tensor:
    # TRL 1.16.0 grpo_trainer.py:2765-2787 (scale_rewards="group") with utils.py:1021-1044 nanstd (Bessel).
    grouped = rewards.view(-1, num_generations)
    mean = torch.nanmean(grouped, dim=1).repeat_interleave(num_generations, dim=0)
    m = torch.nanmean(grouped, dim=1, keepdim=True)
    var = torch.nanmean((grouped - m) ** 2, dim=1, keepdim=True)
    count = torch.sum(~torch.isnan(grouped), dim=1, keepdim=True)
    var = var * (count / (count - 1))
    std = torch.sqrt(var)[:, 0].repeat_interleave(num_generations, dim=0)
    return (rewards - mean) / (std + 1e-4)


def tunix_group_advantages(rewards: np.ndarray, num_generations: int) -> np.ndarray:
    # Tunix algo_core.py:639-656 compute_advantages.
    mean = rewards.reshape(-1, num_generations).mean(axis=-1).repeat(num_generations)
    std = rewards.reshape(-1, num_generations).std(axis=-1, ddof=1).repeat(num_generations)
    return (rewards - mean) / (std + 1e-6)


def trl_grpo_loss(logp, old, adv, mask, eps_low, eps_high, loss_type, beta=0.0, ref=None):
    # TRL 1.16.0 grpo_trainer.py:3083-3120 (token-level ratio, two-sided clip), 3100-3102 (k3 KL),
    # 3149-3150 (beta * kl added per token), 3154 ("grpo") / 3159 ("bnpo") aggregation.
    coef_1 = torch.exp(logp - old)
    coef_2 = torch.clamp(coef_1, 1 - eps_low, 1 + eps_high)
    per_token_loss = -torch.min(coef_1 * adv[:, None], coef_2 * adv[:, None])
    if beta != 0.0:
        per_token_loss = per_token_loss + beta * (torch.exp(ref - logp) - (ref - logp) - 1)
    if loss_type == "grpo":
        return ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    return (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)


def tunix_grpo_loss(logp, old, adv, mask, eps, eps_high, mode):
    # Tunix algo_core.py:445 (log-ratio clamp), 486-489 (pg losses, max), common.py:801-817 (aggregation).
    is_ratio = np.exp(np.clip(logp - old, -20.0, 20.0))
    pg_1 = -adv[:, None] * is_ratio
    pg_2 = -adv[:, None] * np.clip(is_ratio, 1 - eps, 1 + eps_high)
    per_token = np.maximum(pg_1, pg_2)
    if mode == "token-mean":
        return (per_token * mask).sum() / max(mask.sum(), 1.0)
    seq_mask = mask.sum(-1)  # "sequence-mean-token-mean": empty rows are not counted
    return ((per_token * mask).sum(-1) / np.clip(seq_mask, 1.0, None)).sum() / max((seq_mask > 0).sum(), 1)


def tunix_kl(logp, ref, method):
    # Tunix common.py:169-176 compute_kl_divergence.
    if method == "kl":
        return logp - ref
    if method == "mse_kl":
        return 0.5 * np.square(logp - ref)
    diff = ref - logp
    return np.exp(diff) - diff - 1


def trl_dpo(chosen, rejected, ref_chosen, ref_rejected, beta):
    # TRL 1.16.0 dpo_trainer.py:1350-1351 (log-ratios), 1388 (sigmoid), 1527 (mean), 1582-1595 (metrics).
    chosen_logratios, rejected_logratios = chosen - ref_chosen, rejected - ref_rejected
    loss = (-F.logsigmoid(beta * (chosen_logratios - rejected_logratios))).mean()
    chosen_rewards, rejected_rewards = beta * chosen_logratios, beta * rejected_logratios
    margins, accuracies = chosen_rewards - rejected_rewards, (chosen_rewards > rejected_rewards).float()
    out = {"rewards_chosen": chosen_rewards, "rewards_rejected": rejected_rewards, "margin": margins,
           "accuracy": accuracies}
    return loss, {f"dpo/{k}": v.mean() for k, v in out.items()}


def tunix_dpo(chosen, rejected, ref_chosen, ref_rejected, beta):
    # Tunix sft/dpo/dpo_trainer.py:586-590 (label_smoothing 0).
    delta = (chosen - ref_chosen) - (rejected - ref_rejected)
    return np.mean(np.logaddexp(0.0, -beta * delta))  # -log_sigmoid(x) = log(1 + e^-x)


def _t(x) -> torch.Tensor:  # references run in float64
    return torch.tensor(np.asarray(x, np.float64))


# ---------------------------------------------------------------------- log-probs and advantages


def test_token_log_probs_in_f32_and_as_the_sampler_recorded_them():
    # bf16 logits [0, 1] and [0, 0] (exact in bf16): log p = -log(1 + e^-1) = -0.313262 and -log 2.
    lp = token_log_probs(jnp.array([[[0.0, 1.0], [0.0, 0.0]]], jnp.bfloat16), jnp.array([[1, 0]]))
    assert lp.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(lp), [[-math.log1p(math.exp(-1.0)), -math.log(2.0)]], rtol=1e-6)
    # The actors record sample_token's log-prob of the temperature-scaled, grammar-masked distribution.
    rng = np.random.default_rng(11)
    logits = jnp.asarray(rng.normal(size=(6, 9)), jnp.float32)
    allowed = jnp.asarray(rng.uniform(size=(6, 9)) < 0.6).at[:, 0].set(True)
    tok, recorded = sample_token(jnp.where(allowed, logits, -jnp.inf), jax.random.key(0), 0.7, 1.0, False)
    ours = token_log_probs(logits[None], tok[None], temperature=0.7, allowed=allowed[None])[0]
    np.testing.assert_allclose(np.asarray(ours), np.asarray(recorded), rtol=1e-5, atol=1e-6)
    raw = token_log_probs(logits[None], tok[None])[0]  # the unmasked distribution: ratios would be off
    assert float(jnp.abs(raw - recorded).max()) > 0.1
    empty = token_log_probs(logits[None, :1], tok[None, :1], allowed=jnp.zeros((1, 1, 9), bool))
    assert bool(jnp.isfinite(empty).all())


def test_group_advantages_hand_computed_unbiased_std():
    # group 7: rewards 1, 0, 0, 1 -> mean 0.5, unbiased var (4 * 0.25) / 3 = 1/3 (population std would give
    # +-1 exactly); group 3 has one branch, group 9 two equal rewards: both uninformative, advantage 0.
    out = group_advantages(jnp.array([1.0, 0, 0, 1, 5, 2, 2]), jnp.array([7, 7, 7, 7, 3, 9, 9]))
    a = 0.5 / (math.sqrt(1.0 / 3.0) + 1e-4)
    np.testing.assert_allclose(np.asarray(out.advantages), [a, -a, -a, a, 0, 0, 0], rtol=1e-6)
    assert out.informative.tolist() == [True] * 4 + [False] * 3
    np.testing.assert_allclose(np.asarray(out.std)[:4], math.sqrt(1.0 / 3.0), rtol=1e-6)
    assert int(out.n_groups) == 3 and int(out.n_uninformative) == 2


def test_group_advantages_match_trl_and_tunix_in_any_order():
    rng = np.random.default_rng(0)
    rewards = np.concatenate([rng.normal(size=12), np.full(4, 0.7)]).astype(np.float32)  # 4 groups of 4
    ids = np.repeat(np.arange(4), 4)
    trl = trl_group_advantages(_t(rewards), 4).numpy()
    tunix = tunix_group_advantages(rewards.astype(np.float64), 4)
    perm = rng.permutation(16)  # our groups need not be contiguous: ids are matched, not reshaped
    ours = group_advantages(rewards[perm], ids[perm] * 10 + 3).advantages
    np.testing.assert_allclose(np.asarray(ours), trl[perm], rtol=1e-5, atol=1e-6)
    cfg6 = RLLossConfig(adv_eps=1e-6)
    ours6 = group_advantages(rewards[perm], ids[perm], config=cfg6)
    np.testing.assert_allclose(np.asarray(ours6.advantages), tunix[perm], rtol=1e-5, atol=1e-6)
    assert int(ours6.n_groups) == 4 and int(ours6.n_uninformative) == 1  # the all-0.7 group


def test_group_advantages_ignore_padded_trajectories():
    base = group_advantages(jnp.array([1.0, 3.0, 2.0]), jnp.array([0, 0, 1]))
    padded = group_advantages(
        jnp.array([1.0, 3.0, 2.0, jnp.nan, 100.0]), jnp.array([0, 0, 1, 0, 1]),
        valid=jnp.array([1, 1, 1, 0, 0], bool),
    )
    np.testing.assert_array_equal(np.asarray(padded.advantages), np.r_[np.asarray(base.advantages), 0, 0])
    assert int(padded.n_groups) == 2 and int(padded.n_uninformative) == 1


# ---------------------------------------------------------------------- GRPO

# Row 0 (A = +1): ratios 1.5, 0.5, 1.1; row 1 (A = -1): ratios 1.5, 0.5 and a padded token. Clip [0.8, 1.28]:
#   row 0: -min(r, clip r)   = -1.28 (clipped), -0.5, -1.1     row 1: -min(-r, -clip r) = 1.5, 0.8 (clipped)
#   token-mean = (-1.28 - 0.5 - 1.1 + 1.5 + 0.8) / 5 = -0.116; sequence-mean = (-2.88/3 + 2.3/2) / 2 = 0.095
#   d/dlogp (token-mean): -A r / 5 where unclipped, 0 where clipped: [[0, -0.1, -0.22], [0.3, 0, 0]]
BEHAVIOUR = jnp.log(jnp.full((2, 3), 0.4))
LOGP = jnp.log(0.4 * jnp.array([[1.5, 0.5, 1.1], [1.5, 0.5, 1.0]]))
ADV = jnp.array([1.0, -1.0])
MASK = jnp.array([[1, 1, 1], [1, 1, 0]])


def test_grpo_loss_hand_computed_token_and_sequence_mean():
    loss, m = grpo_loss(LOGP, BEHAVIOUR, ADV, MASK)
    np.testing.assert_allclose(float(loss), -0.116, rtol=1e-5)
    np.testing.assert_allclose([float(m["grpo/clip_frac_high"]), float(m["grpo/clip_frac_low"])], [0.2, 0.2])
    np.testing.assert_allclose(float(m["grpo/ratio_mean"]), 5.1 / 5, rtol=1e-5)
    seq, _ = grpo_loss(LOGP, BEHAVIOUR, ADV, MASK, RLLossConfig(aggregation="sequence-mean"))
    np.testing.assert_allclose(float(seq), 0.095, rtol=1e-5)


def test_grpo_gradient_is_zero_where_clipping_is_active_on_both_sides():
    g = jax.grad(lambda lp: grpo_loss(lp, BEHAVIOUR, ADV, MASK)[0])(LOGP)
    np.testing.assert_allclose(np.asarray(g), [[0.0, -0.1, -0.22], [0.3, 0.0, 0.0]], atol=1e-6)


@pytest.mark.parametrize("aggregation,trl_type", [("token-mean", "bnpo"), ("sequence-mean", "grpo")])
def test_grpo_matches_trl_and_tunix(aggregation, trl_type):
    rng = np.random.default_rng(1)
    old = np.log(rng.uniform(0.05, 0.9, (6, 5)))
    logp = old + rng.normal(scale=0.4, size=(6, 5))  # |log r| ~ 0.4: both clips active
    adv = rng.normal(size=6)
    mask = (rng.uniform(size=(6, 5)) < 0.8).astype(np.float64)
    mask[:, 0] = 1.0  # TRL's "grpo" mean would count an empty row, Tunix's and ours do not
    cfg = RLLossConfig(aggregation=aggregation)
    ours, m = grpo_loss(jnp.asarray(logp, jnp.float32), jnp.asarray(old, jnp.float32), adv, mask, cfg)
    assert 0 < float(m["grpo/clip_frac_high"]) and 0 < float(m["grpo/clip_frac_low"])
    logp_t = _t(logp).requires_grad_()
    trl = trl_grpo_loss(logp_t, _t(old), _t(adv), _t(mask), 0.2, 0.28, trl_type)
    trl.backward()
    tunix = tunix_grpo_loss(logp, old, adv, mask, 0.2, 0.28, aggregation)
    np.testing.assert_allclose(float(ours), [trl.item(), tunix], rtol=1e-5, atol=1e-6)
    g = jax.grad(lambda lp: grpo_loss(lp, jnp.asarray(old, jnp.float32), adv, mask, cfg)[0])
    np.testing.assert_allclose(np.asarray(g(jnp.asarray(logp, jnp.float32))), logp_t.grad.numpy(), atol=1e-6)


def test_grpo_plus_kl_in_post_loss_matches_trl_beta_term():
    rng = np.random.default_rng(2)
    old, ref = np.log(rng.uniform(0.1, 0.9, (2, 4, 6)))
    logp = old + rng.normal(scale=0.3, size=(4, 6))
    adv, mask = rng.normal(size=4), (rng.uniform(size=(4, 6)) < 0.7).astype(np.float64)
    cfg = RLLossConfig(lambda_ref=0.04)
    f32 = functools.partial(jnp.asarray, dtype=jnp.float32)
    g, _ = grpo_loss(f32(logp), f32(old), adv, mask, cfg)
    kl, _ = reference_kl(f32(logp), f32(ref), mask, cfg)
    ours, _ = post_training_loss(g, jnp.float32(0), jnp.float32(0), kl, cfg)
    trl = trl_grpo_loss(_t(logp), _t(old), _t(adv), _t(mask), 0.2, 0.28, "bnpo", beta=0.04, ref=_t(ref))
    np.testing.assert_allclose(float(ours), trl.item(), rtol=1e-5)


def _logits_batch(seed=3, B=4, K=5, V=7):
    rng = np.random.default_rng(seed)
    logits = jnp.asarray(rng.normal(size=(B, K, V)), jnp.float32)
    targets = jnp.asarray(rng.integers(0, V, (B, K)))
    mask = jnp.asarray(rng.uniform(size=(B, K)) < 0.7).at[:, 0].set(True)
    return logits, targets, mask


def test_all_equal_rewards_give_zero_advantages_and_zero_policy_gradient():
    logits, targets, mask = _logits_batch()
    adv = group_advantages(jnp.full(4, 0.3), jnp.array([0, 0, 0, 0]))
    assert float(jnp.abs(adv.advantages).max()) == 0.0 and int(adv.n_uninformative) == 1
    behaviour = token_log_probs(logits + 0.5 * jnp.sin(logits), targets)  # off-policy: ratios != 1
    loss_fn = lambda lg: grpo_loss(token_log_probs(lg, targets), behaviour, adv.advantages, mask)[0]
    loss, grad = jax.value_and_grad(loss_fn)(logits)
    assert float(loss) == 0.0 and float(jnp.abs(grad).max()) == 0.0


def test_single_branch_is_uninformative_and_trains_nothing():
    out = group_advantages(jnp.array([4.0]), jnp.array([12]))
    assert float(out.advantages[0]) == 0.0 and int(out.n_groups) == 1 and int(out.n_uninformative) == 1
    lp = jnp.log(jnp.array([[0.3, 0.6]]))
    loss, grad = jax.value_and_grad(lambda x: grpo_loss(x, lp - 0.1, out.advantages, jnp.ones((1, 2)))[0])(lp)
    assert float(loss) == 0.0 and float(jnp.abs(grad).max()) == 0.0


def _full_loss(logits, targets, mask, behaviour, ref_logp, adv, pair, chosen, ref_pairs, replay):
    lp = token_log_probs(logits, targets)
    rl_mask = mask & ~replay[:, None]
    g, _ = grpo_loss(lp, behaviour, adv, rl_mask)
    kl, _ = reference_kl(lp, ref_logp, rl_mask)
    d, _ = dpo_loss(pair_log_probs(lp, rl_mask, pair, chosen, 2), ref_pairs)
    w, _ = world_replay_loss(logits, targets, mask, replay)
    return post_training_loss(g, d, w, kl)[0]


def test_masked_tokens_contribute_nothing_whatever_their_values():
    logits, targets, mask = _logits_batch(seed=4)
    rng = np.random.default_rng(4)
    behaviour = token_log_probs(logits * 1.1, targets)
    ref_logp = token_log_probs(logits * 0.9, targets)
    adv = jnp.array([0.7, -1.2, 0.4, 0.0])
    pair, chosen = jnp.array([0, 0, 1, -1]), jnp.array([True, False, True, False])
    ref_pairs = PairLogProbs(jnp.array([-3.0, -2.0]), jnp.array([-4.0, -1.0]), jnp.array([True, True]))
    replay = jnp.array([False, False, False, True])
    args = (behaviour, ref_logp, adv, pair, chosen, ref_pairs, replay)
    loss, grad = jax.value_and_grad(_full_loss)(logits, targets, mask, *args)
    off = ~mask
    noise = jnp.asarray(rng.normal(scale=1e3, size=logits.shape), jnp.float32)
    logits2 = jnp.where(off[..., None], noise, logits)
    targets2 = jnp.where(off, (targets + 3) % 7, targets)
    behaviour2, ref2 = jnp.where(off, jnp.nan, behaviour), jnp.where(off, jnp.inf, ref_logp)
    args2 = (behaviour2, ref2, *args[2:])
    loss2, grad2 = jax.value_and_grad(_full_loss)(logits2, targets2, mask, *args2)
    assert np.isfinite(float(loss)) and float(loss2) == float(loss)
    np.testing.assert_array_equal(np.asarray(grad2), np.asarray(grad))
    assert float(jnp.abs(jnp.where(off[..., None], grad, 0.0)).max()) == 0.0


def test_empty_masks_give_zero_not_nan():
    z, lp = jnp.zeros((2, 3), bool), jnp.log(jnp.full((2, 3), 0.5))
    assert float(grpo_loss(lp, lp - 1, jnp.ones(2), z)[0]) == 0.0
    assert float(grpo_loss(lp, lp, jnp.ones(2), z, RLLossConfig(aggregation="sequence-mean"))[0]) == 0.0
    assert float(reference_kl(lp, lp - 1, z)[0]) == 0.0
    pairs = pair_log_probs(lp, z, jnp.array([0, 0]), jnp.array([True, False]), 1)
    loss, m = dpo_loss(pairs, pairs)
    assert float(loss) == 0.0 and float(m["dpo/n_pairs"]) == 0.0 and not pairs.valid.any()


# ---------------------------------------------------------------------- KL to the reference


def test_kl_estimators_hand_computed_and_match_trl_tunix():
    # pi = 0.5, ref = 0.25 at the sampled token: ref - logp = -ln 2.
    lp, ref = jnp.log(jnp.array([[0.5]])), jnp.log(jnp.array([[0.25]]))
    hand = {"k1": math.log(2), "k2": 0.5 * math.log(2) ** 2, "k3": 0.5 + math.log(2) - 1}
    for est, tunix_name in (("k1", "kl"), ("k2", "mse_kl"), ("k3", "low_var_kl")):
        np.testing.assert_allclose(float(per_token_kl(lp, ref, est)[0, 0]), hand[est], rtol=1e-6)
        rng = np.random.default_rng(5)
        a, b = np.log(rng.uniform(0.01, 1, (2, 3, 8)))
        np.testing.assert_allclose(np.asarray(per_token_kl(jnp.asarray(a), jnp.asarray(b), est)),
                                   tunix_kl(a, b, tunix_name), rtol=1e-5, atol=1e-6)
    # TRL 1.16.0 grpo_trainer.py:3100-3102.
    trl_k3 = torch.exp(_t(ref) - _t(lp)) - (_t(ref) - _t(lp)) - 1
    np.testing.assert_allclose(float(per_token_kl(lp, ref, "k3")[0, 0]), trl_k3.item(), rtol=1e-6)


def test_kl_of_identical_policies_is_zero_with_zero_gradient():
    logits, targets, mask = _logits_batch(seed=6)
    ref = token_log_probs(logits, targets)

    def kl(lg, estimator):
        return reference_kl(token_log_probs(lg, targets), ref, mask, RLLossConfig(kl_estimator=estimator))[0]

    for est in ("k2", "k3"):
        v, g = jax.value_and_grad(kl)(logits, est)
        assert float(v) == 0.0 and float(jnp.abs(g).max()) < 1e-7
    # k1 is 0 too, but its gradient is that of logp: it is unbiased only in expectation over pi's samples.
    v1, g1 = jax.value_and_grad(kl)(logits, "k1")
    assert float(v1) == 0.0 and float(jnp.abs(g1).max()) > 1e-3


def test_k1_and_k3_are_unbiased_estimators_of_kl():
    # Over every token of a 6-word vocabulary: E_pi[k] = sum_x pi(x) k(x) must equal KL(pi || ref) exactly.
    rng = np.random.default_rng(7)
    lp = jax.nn.log_softmax(jnp.asarray(rng.normal(size=6), jnp.float32))
    ref = jax.nn.log_softmax(jnp.asarray(rng.normal(size=6), jnp.float32))
    exact = float(jnp.sum(jnp.exp(lp) * (lp - ref)))
    for est in ("k1", "k3"):
        np.testing.assert_allclose(float(jnp.sum(jnp.exp(lp) * per_token_kl(lp, ref, est))), exact, rtol=1e-5)


# ---------------------------------------------------------------------- DPO and its pairs


def _pairs(c, r, valid=(True,)):
    return PairLogProbs(jnp.asarray(c, jnp.float32), jnp.asarray(r, jnp.float32), jnp.asarray(valid))


def test_dpo_at_equal_log_ratios_is_log_2():
    loss, m = dpo_loss(_pairs([-5.0, -1.0], [-2.0, -7.0], [True, True]),
                       _pairs([-4.0, -3.0], [-1.0, -9.0], [True, True]))  # log-ratios -1, 2 on both sides
    np.testing.assert_allclose([float(loss), float(m["dpo/margin"])], [math.log(2), 0.0], atol=1e-7)


def test_dpo_hand_computed_and_matches_trl_tunix():
    # pi_w - ref_w = 1, pi_l - ref_l = -1, beta 0.1: loss = log(1 + e^-0.2) = 0.598139,
    # d loss / d pi_w = -0.1 sigmoid(-0.2) = -0.045017.
    pol, ref = _pairs([-1.0], [-3.0]), _pairs([-2.0], [-2.0])
    loss, m = dpo_loss(pol, ref)
    np.testing.assert_allclose(float(loss), math.log1p(math.exp(-0.2)), rtol=1e-6)
    np.testing.assert_allclose([float(m[k]) for k in ("dpo/rewards_chosen", "dpo/rewards_rejected",
                                                       "dpo/margin", "dpo/accuracy")], [0.1, -0.1, 0.2, 1.0])
    g = jax.grad(lambda c: dpo_loss(pol._replace(chosen=c), ref)[0])(pol.chosen)
    np.testing.assert_allclose(float(g[0]), -0.1 / (1 + math.exp(0.2)), rtol=1e-6)
    rng = np.random.default_rng(8)
    c, r, rc, rr = rng.normal(scale=3.0, size=(4, 5)) - 10
    ours, mo = dpo_loss(_pairs(c, r, [True] * 5), _pairs(rc, rr, [True] * 5))
    trl, mt = trl_dpo(_t(c), _t(r), _t(rc), _t(rr), 0.1)
    np.testing.assert_allclose(float(ours), [trl.item(), tunix_dpo(c, r, rc, rr, 0.1)], rtol=1e-5)
    for k, v in mt.items():
        np.testing.assert_allclose(float(mo[k]), v.item(), rtol=1e-5, atol=1e-6)


def test_pair_log_probs_sum_each_side_over_its_steps():
    # Pair 0: chosen rows 0, 1 (-1 - 2 - 0.5; row 1's -9 is masked), rejected row 2 (-4.5); pair 1: only a
    # chosen row (row 3, -8) -> invalid; row 4 is in no pair.
    lp = jnp.array([[-1.0, -2.0], [-0.5, -9.0], [-3.0, -1.5], [-4.0, -4.0], [-8.0, -8.0]])
    mask = jnp.array([[1, 1], [1, 0], [1, 1], [1, 1], [1, 1]])
    out = pair_log_probs(lp, mask, jnp.array([0, 0, 0, 1, -1]), jnp.array([True, True, False, True, True]), 2)
    np.testing.assert_allclose(np.asarray(out.chosen), [-3.5, -8.0])
    np.testing.assert_allclose(np.asarray(out.rejected), [-4.5, 0.0])
    assert out.valid.tolist() == [True, False]
    # Against TRL's per-sequence sum (dpo_trainer.py:1304) of the side's tokens laid end to end.
    np.testing.assert_allclose(float(out.chosen[0]), _t([-1.0, -2.0, -0.5]).sum().item())


def test_divergence_window_identical_trajectories_have_none():
    steps = [np.array([3, 4]), np.array([5]), np.array([6, 7, 8])]
    assert divergence_window(steps, [s.copy() for s in steps]) is None
    assert divergence_window(np.zeros((4, 3), int), np.zeros((4, 3), int)) is None  # [T, K] arrays work too


def test_divergence_window_from_first_differing_step_clipped_to_lengths():
    s = [np.array([1]), np.array([2, 2]), np.array([3]), np.array([4]), np.array([5])]
    f = [np.array([1]), np.array([2, 2]), np.array([3, 9]), np.array([4])]  # step 2 differs in length
    w = divergence_window(s, f, RLLossConfig(dpo_window=2))
    assert (w.step, w.success, w.failure) == (2, (2, 4), (2, 4))
    w8 = divergence_window(s, f)  # default window 8, clipped to 5 and 4 steps
    assert (w8.step, w8.success, w8.failure) == (2, (2, 5), (2, 4))
    # The failure agrees on all 3 steps of the success and runs on: the success side is empty (no pair).
    w3 = divergence_window(s[:3], s, RLLossConfig(dpo_window=4))
    assert (w3.step, w3.success, w3.failure) == (3, (3, 3), (3, 5))


# ---------------------------------------------------------------------- replay, L_post, jit, config


def test_world_replay_is_masked_cross_entropy_on_replay_rows():
    logits, targets, mask = _logits_batch(seed=9)
    replay = jnp.array([True, False, True, False])
    loss, n = world_replay_loss(logits, targets, mask, replay)
    ref, n_ref = masked_cross_entropy(logits[::2], targets[::2], mask[::2])
    np.testing.assert_allclose([float(loss), float(n)], [float(ref), float(n_ref)], rtol=1e-6)


def test_post_training_loss_weights_its_parts():
    cfg = RLLossConfig(lambda_dpo=0.5, lambda_world=0.25, lambda_ref=0.1)
    loss, m = post_training_loss(jnp.float32(1.0), jnp.float32(2.0), jnp.float32(4.0), jnp.float32(10.0), cfg)
    # L_branch = 1 + 0.5 * 2 = 2; L_post = 2 + 0.25 * 4 + 0.1 * 10 = 4
    np.testing.assert_allclose([float(loss), float(m["post/branch"])], [4.0, 2.0], rtol=1e-6)


def test_every_loss_jits_and_matches_eager():
    cfg = RLLossConfig(aggregation="sequence-mean", kl_estimator="k2")
    logits, targets, mask = _logits_batch(seed=10)
    lp = token_log_probs(logits, targets)
    pairs = (lp, mask, jnp.array([0, 0, 1, 1]), jnp.array([True, False, True, False]))
    cases = [
        (token_log_probs, (logits, targets), {}),
        (group_advantages, (jnp.array([1.0, 2.0, 0.0, 4.0]), jnp.array([0, 0, 1, 1])), {"config": cfg}),
        (grpo_loss, (lp, lp * 1.1, jnp.array([1.0, -1.0, 0.5, 0.0]), mask), {"config": cfg}),
        (reference_kl, (lp, lp * 0.9, mask), {"config": cfg}),
        (pair_log_probs, pairs, {"n_pairs": 2}),
        (dpo_loss, (pair_log_probs(*pairs, 2), pair_log_probs(lp * 0.8, *pairs[1:], 2)), {"config": cfg}),
        (world_replay_loss, (logits, targets, mask, jnp.array([True, False, True, True])), {}),
        (post_training_loss, tuple(jnp.float32(x) for x in (1, 2, 3, 4)), {"config": cfg}),
    ]
    for fn, args, static in cases:
        jitted = jax.jit(functools.partial(fn, **static))
        for a, b in zip(jax.tree.leaves(jitted(*args)), jax.tree.leaves(fn(*args, **static)), strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, err_msg=fn.__name__)
    # The config is hashable, so it can also be a static argument.
    jax.jit(grpo_loss, static_argnames="config")(*cases[2][1], config=cfg)


@pytest.mark.parametrize("field,value", [("aggregation", "seq"), ("kl_estimator", "k4"), ("group_size", 1),
                                         ("dpo_window", 0), ("clip_eps_low", 1.0), ("lambda_ref", -1.0)])
def test_config_rejects_bad_values_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field if field != "clip_eps_low" else "clip"):
        dataclasses.replace(RLLossConfig(), **{field: value})
