"""RL losses of stage 3 as pure functions of arrays: group-relative advantages, clipped token-level GRPO, the
per-token KL to a frozen reference, sigmoid DPO on divergent step windows, world replay, and ``L_post``.

Shapes: B samples (one control step of one trajectory each, or a stage-1 replay sample), K target positions
per sample (the logits the policy computes at its reply's targets, as ``policy.loss.action_loss`` gathers
them), V the vocabulary, N trajectories, P preference pairs. Per-token log-probs come from
``token_log_probs``; the behaviour log-probs are the ones the actors recorded while sampling, the reference
log-probs come from the frozen reference model (computed before the step, as Tunix does, so the step stays
pure). All math is float32; masked positions contribute nothing to a loss or its gradient, whatever their
log-prob values (recorded behaviour/reference ones may even be inf/NaN); an empty mask gives 0, never NaN.
The hyperparameters the paper leaves open are ``RLLossConfig``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from histeve_jax.losses.tokens import masked_cross_entropy

AGGREGATIONS = ("token-mean", "sequence-mean")
KL_ESTIMATORS = ("k1", "k2", "k3")
_MAX_LOG_RATIO = 20.0  # Tunix algo_core.grpo_loss_fn clamps the log-ratio to +-20 so exp stays finite


@dataclasses.dataclass(frozen=True)
class RLLossConfig:
    """The stage-3 choices the paper leaves open, with why each default.

    group_size K = 8: TRL's ``GRPOConfig.num_generations`` default; with a success rate p a group of 8 is
      all-equal (uninformative) with probability p^8 + (1-p)^8, 0.8% at p = 0.5 and 17% at p = 0.8.
    adv_eps = 1e-4: TRL's ``std_rewards + 1e-4`` (Tunix uses 1e-6); zero-spread groups are zeroed anyway, so
      it only guards near-zero spreads, where the larger value amplifies less.
    min_reward_std = 1e-6: a group whose (unbiased) reward std is at or below it is uninformative (advantage
      0, counted); it absorbs float noise of equal rewards, as TRL's ``torch.isclose(std, 0)`` does.
    clip_eps_low = 0.2, clip_eps_high = 0.28: the ratio is clipped to [0.8, 1.28]; 0.2 is PPO/GRPO's, TRL's
      and Tunix's ``epsilon``; 0.28 is DAPO's clip-higher (recommended in TRL's docs), which keeps rarely
      sampled tokens (precise GUI cursor moves) able to grow.
    aggregation = "token-mean": the loss is the mean over all target tokens of the batch (DAPO, TRL's default
      ``loss_type="dapo"``/``"bnpo"``, Tunix ``"token-mean"``): no length bias, and the same per-token
      scale as the imitation and world-replay cross-entropy it is added to. "sequence-mean" (TRL ``"grpo"``,
      Tunix's default ``"sequence-mean-token-mean"``) weights every step equally instead.
    kl_estimator = "k3": exp(ref - logp) - (ref - logp) - 1, unbiased, non-negative and low-variance (TRL's
      GRPO; Tunix ``"low_var_kl"``); its gradient is 0 where the policies agree. "k1" (logp - ref) and
      "k2" (0.5 * (logp - ref)^2, Tunix ``"mse_kl"``) are options.
    dpo_beta = 0.1: TRL's and Tunix's ``DPOConfig.beta`` (the DPO paper's value).
    dpo_window = 8 steps (0.4 s at 20 Hz): from the first divergent step, long enough for a cursor move and
      a click, short enough that a pair's 2 x 8 step samples fit in a small batch.
    lambda_dpo = 1.0: ``L_branch = L_GRPO + lambda_dpo * L_DPO`` (our reading: the paper's branch term is
      both its group updates and its local pairs); DPO's own scale is set by beta.
    lambda_world = 1.0: replay cross-entropy per token is on the same gradient scale as the policy-gradient
      term (|A| ~ 1 after std normalisation), so neither dominates; the batch mix sets how many samples.
    lambda_ref = 0.04: the KL coefficient of DeepSeekMath's GRPO and Tunix's ``GRPOConfig.beta`` (TRL
      defaults to 0, dropping the reference, which the paper keeps).
    """

    group_size: int = 8
    adv_eps: float = 1e-4
    min_reward_std: float = 1e-6
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.28
    aggregation: str = "token-mean"
    kl_estimator: str = "k3"
    dpo_beta: float = 0.1
    dpo_window: int = 8
    lambda_dpo: float = 1.0
    lambda_world: float = 1.0
    lambda_ref: float = 0.04

    def __post_init__(self):
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(f"RLLossConfig.aggregation {self.aggregation!r} is not one of {AGGREGATIONS}")
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(f"RLLossConfig.kl_estimator {self.kl_estimator!r} is not one of {KL_ESTIMATORS}")
        if self.group_size < 2:
            raise ValueError(f"RLLossConfig.group_size must be >= 2 (got {self.group_size})")
        if self.dpo_window < 1:
            raise ValueError(f"RLLossConfig.dpo_window must be >= 1 (got {self.dpo_window})")
        if not 0.0 <= self.clip_eps_low < 1.0 or self.clip_eps_high < 0.0:
            raise ValueError(
                f"RLLossConfig clip range [1 - {self.clip_eps_low}, 1 + {self.clip_eps_high}] is not a range "
                "around 1 (need 0 <= clip_eps_low < 1 and clip_eps_high >= 0)"
            )
        for name in ("adv_eps", "min_reward_std", "dpo_beta", "lambda_dpo", "lambda_world", "lambda_ref"):
            if getattr(self, name) < 0:
                raise ValueError(f"RLLossConfig.{name} must be >= 0 (got {getattr(self, name)})")


DEFAULT = RLLossConfig()


def _check_same_shape(**arrays) -> None:
    shapes = {k: tuple(jnp.shape(v)) for k, v in arrays.items()}
    if len(set(shapes.values())) > 1:
        raise ValueError(f"shapes differ: {shapes}")


def _masked(x: jax.Array, mask: jax.Array) -> jax.Array:
    # where, not multiply: a masked inf/NaN would survive 0 * x, and the zeroed input keeps gradients finite.
    return jnp.where(mask, jnp.asarray(x, jnp.float32), 0.0)


def _aggregate(per_token: jax.Array, mask: jax.Array, mode: str) -> jax.Array:
    """Masked [B, K] -> scalar by ``mode``; rows without tokens do not count in "sequence-mean"."""
    m = mask.astype(jnp.float32)
    if mode == "token-mean":
        return (per_token * m).sum() / jnp.maximum(m.sum(), 1.0)
    if mode == "sequence-mean":
        n_row = m.sum(-1)
        row = (per_token * m).sum(-1) / jnp.maximum(n_row, 1.0)
        has = (n_row > 0).astype(jnp.float32)
        return (row * has).sum() / jnp.maximum(has.sum(), 1.0)
    raise ValueError(f"aggregation {mode!r} is not one of {AGGREGATIONS}")


def _masked_mean(x: jax.Array, mask: jax.Array) -> jax.Array:
    m = mask.astype(jnp.float32)
    return (jnp.where(mask, x, 0.0) * m).sum() / jnp.maximum(m.sum(), 1.0)


def token_log_probs(
    logits: jax.Array, targets: jax.Array, temperature: float = 1.0, allowed: jax.Array | None = None
) -> jax.Array:
    """log pi(target): logits [B, K, V] (any float dtype), targets [B, K] int -> [B, K] float32.

    ``temperature`` and ``allowed`` [B, K, V] bool (the action grammar's mask) give the distribution the
    actors sampled from, so that ratios to their recorded log-probs are 1 at equal weights (``generate``
    records log-probs after both; its top-p truncation cannot be reproduced here, so actors use top_p = 1).
    """
    if logits.shape[:-1] != targets.shape:
        raise ValueError(f"logits {logits.shape} and targets {targets.shape} differ before the vocab axis")
    lg = logits.astype(jnp.float32) / temperature
    if allowed is not None:
        if allowed.shape != logits.shape:
            raise ValueError(f"allowed {allowed.shape} must be the shape of logits {logits.shape}")
        # A row allowing nothing (a padded position) stays unmasked: an all -inf row would give NaN.
        allowed = allowed | ~allowed.any(-1, keepdims=True)
        lg = jnp.where(allowed, lg, -jnp.inf)
    logp = jax.nn.log_softmax(lg, axis=-1)
    return jnp.take_along_axis(logp, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]


class GroupAdvantages(NamedTuple):
    """Per trajectory [N]: advantage, informative flag, group mean/std; totals over valid trajectories."""

    advantages: jax.Array
    informative: jax.Array
    mean: jax.Array
    std: jax.Array
    n_groups: jax.Array
    n_uninformative: jax.Array


def group_advantages(
    rewards: jax.Array, group_ids: jax.Array, valid: jax.Array | None = None, config: RLLossConfig = DEFAULT
) -> GroupAdvantages:
    """A_i = (R_i - mean_g) / (std_g + adv_eps) over each branch group g (any int ids, in any order).

    std is the unbiased (Bessel, ddof = 1) sample std, as TRL (``nanstd``) and Tunix (``std(ddof=1)``) both
    use. Groups of one, or with std <= ``min_reward_std``, are uninformative: advantage exactly 0, counted.
    ``valid`` [N] bool drops padded trajectories (their rewards may be anything).
    """
    rewards, group_ids = jnp.asarray(rewards), jnp.asarray(group_ids)
    if rewards.ndim != 1:
        raise ValueError(f"rewards must be [N], got shape {rewards.shape}")
    valid = jnp.ones(rewards.shape, bool) if valid is None else jnp.asarray(valid, bool)
    _check_same_shape(rewards=rewards, group_ids=group_ids, valid=valid)
    r = _masked(rewards, valid)
    # An [N, N] same-group matrix instead of a segment sum: ids need no remapping and no static group count,
    # and N (trajectories per batch) is small. Sums are broadcast-multiply-add, not matmuls, so TPU's
    # default bf16 matmul precision never touches the rewards.
    same = (group_ids[:, None] == group_ids[None, :]) & valid[:, None] & valid[None, :]
    sf = same.astype(jnp.float32)
    count = sf.sum(1)
    mean = (sf * r[None, :]).sum(1) / jnp.maximum(count, 1.0)
    var = (sf * (r[None, :] - mean[:, None]) ** 2).sum(1) / jnp.maximum(count - 1.0, 1.0)
    std = jnp.sqrt(var)
    informative = valid & (count >= 2) & (std > config.min_reward_std)
    adv = jnp.where(informative, (r - mean) / (std + config.adv_eps), 0.0)
    earlier = jnp.tril(same, k=-1).any(1)  # a trajectory counts its group once: the first member does
    first = valid & ~earlier
    return GroupAdvantages(
        advantages=adv,
        informative=informative,
        mean=mean,
        std=std,
        n_groups=first.sum(),
        n_uninformative=(first & ~informative).sum(),
    )


def grpo_loss(
    logp: jax.Array,
    behaviour_logp: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    config: RLLossConfig = DEFAULT,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Clipped token-level GRPO: -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A), r = exp(logp - behaviour).

    logp, behaviour_logp, mask [B, K]; advantages [B] (the sample's trajectory's) or [B, K]. Aggregated by
    ``config.aggregation``. The behaviour log-probs are data (no gradient).
    """
    _check_same_shape(logp=logp, behaviour_logp=behaviour_logp, mask=mask)
    mask = mask > 0
    adv = jnp.asarray(advantages, jnp.float32)
    if adv.shape not in (mask.shape[:1], mask.shape):
        raise ValueError(f"advantages {adv.shape} must be [B] or [B, K] for logp {mask.shape}")
    adv = adv[:, None] if adv.ndim == 1 else adv
    adv = jnp.where(mask, jnp.broadcast_to(adv, mask.shape), 0.0)
    log_ratio = _masked(logp, mask) - jax.lax.stop_gradient(_masked(behaviour_logp, mask))
    ratio = jnp.exp(jnp.clip(log_ratio, -_MAX_LOG_RATIO, _MAX_LOG_RATIO))
    lo, hi = 1.0 - config.clip_eps_low, 1.0 + config.clip_eps_high
    per_token = -jnp.minimum(ratio * adv, jnp.clip(ratio, lo, hi) * adv)
    loss = _aggregate(per_token, mask, config.aggregation)
    # Where the clipped term is the min, the token's gradient is 0: upper side for A > 0, lower for A < 0.
    clip_high = (adv > 0) & (ratio > hi)
    clip_low = (adv < 0) & (ratio < lo)
    metrics = {
        "grpo/loss": loss,
        "grpo/clip_frac_high": _masked_mean(clip_high.astype(jnp.float32), mask),
        "grpo/clip_frac_low": _masked_mean(clip_low.astype(jnp.float32), mask),
        "grpo/ratio_mean": _masked_mean(ratio, mask),
        # k3 of the behaviour policy from the current one: how far the learner has moved off the actors.
        "grpo/behaviour_kl": _masked_mean(ratio - 1.0 - log_ratio, mask),
        "grpo/n_tokens": mask.sum().astype(jnp.float32),
    }
    return loss, metrics


def per_token_kl(logp: jax.Array, ref_logp: jax.Array, estimator: str = "k3") -> jax.Array:
    """Per-token estimate of KL(pi || pi_ref) at tokens sampled from pi: [B, K] -> [B, K] float32.

    k1 = logp - ref; k2 = 0.5 (logp - ref)^2; k3 = exp(ref - logp) - (ref - logp) - 1 (Schulman's).
    """
    d = jnp.asarray(ref_logp, jnp.float32) - jnp.asarray(logp, jnp.float32)
    if estimator == "k1":
        return -d
    if estimator == "k2":
        return 0.5 * d * d
    if estimator == "k3":
        return jnp.exp(d) - d - 1.0
    raise ValueError(f"kl estimator {estimator!r} is not one of {KL_ESTIMATORS}")


def reference_kl(
    logp: jax.Array, ref_logp: jax.Array, mask: jax.Array, config: RLLossConfig = DEFAULT
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """``config.kl_estimator`` to the frozen reference, aggregated like the GRPO loss: [B, K] -> scalar."""
    _check_same_shape(logp=logp, ref_logp=ref_logp, mask=mask)
    mask = mask > 0
    ref = jax.lax.stop_gradient(_masked(ref_logp, mask))  # the reference is frozen
    kl = per_token_kl(_masked(logp, mask), ref, config.kl_estimator)
    loss = _aggregate(kl, mask, config.aggregation)
    return loss, {"kl/loss": loss, "kl/n_tokens": mask.sum().astype(jnp.float32)}


class PairLogProbs(NamedTuple):
    """Summed log-probs per pair [P] of its chosen (success) and rejected (failure) segment; ``valid`` [P]
    is True where both segments have at least one token."""

    chosen: jax.Array
    rejected: jax.Array
    valid: jax.Array


def pair_log_probs(
    logp: jax.Array, mask: jax.Array, pair: jax.Array, chosen: jax.Array, n_pairs: int
) -> PairLogProbs:
    """Sum per-token log-probs [B, K] over each pair's segments: the samples b with ``pair[b] == p``
    (-1 = in no pair) on the side ``chosen[b]`` (True = the success's steps). ``n_pairs`` is static."""
    _check_same_shape(logp=logp, mask=mask)
    _check_same_shape(pair=pair, chosen=chosen)
    if pair.shape != logp.shape[:1]:
        raise ValueError(f"pair {pair.shape} must be [B] for logp {logp.shape}")
    mask = mask > 0
    row = _masked(logp, mask).sum(-1)
    has = mask.any(-1)
    onehot = jax.nn.one_hot(pair, n_pairs, dtype=jnp.float32)  # pair -1 -> all zeros
    side = jnp.asarray(chosen, bool)[:, None]
    w, lo = onehot * side, onehot * ~side
    return PairLogProbs(
        chosen=(w * row[:, None]).sum(0),
        rejected=(lo * row[:, None]).sum(0),
        valid=((w * has[:, None]).sum(0) > 0) & ((lo * has[:, None]).sum(0) > 0),
    )


def dpo_loss(
    policy: PairLogProbs, reference: PairLogProbs, config: RLLossConfig = DEFAULT
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Sigmoid DPO: mean over valid pairs of -log sigmoid(beta ((pi_w - ref_w) - (pi_l - ref_l))).

    Pairs are valid where both ``policy.valid`` and ``reference.valid``; metrics follow TRL/Tunix: implicit
    rewards beta * (pi - ref) of each side, their margin, and the accuracy (chosen reward > rejected).
    """
    valid = jnp.asarray(policy.valid, bool) & jnp.asarray(reference.valid, bool)
    ref_w = jax.lax.stop_gradient(_masked(reference.chosen, valid))
    ref_l = jax.lax.stop_gradient(_masked(reference.rejected, valid))
    reward_w = config.dpo_beta * (_masked(policy.chosen, valid) - ref_w)
    reward_l = config.dpo_beta * (_masked(policy.rejected, valid) - ref_l)
    losses = -jax.nn.log_sigmoid(reward_w - reward_l)
    loss = _masked_mean(losses, valid)
    metrics = {
        "dpo/loss": loss,
        "dpo/rewards_chosen": _masked_mean(reward_w, valid),
        "dpo/rewards_rejected": _masked_mean(reward_l, valid),
        "dpo/margin": _masked_mean(reward_w - reward_l, valid),
        "dpo/accuracy": _masked_mean((reward_w > reward_l).astype(jnp.float32), valid),
        "dpo/n_pairs": valid.sum().astype(jnp.float32),
    }
    return loss, metrics


class DivergenceWindow(NamedTuple):
    """The first step whose actions differ, and each side's [start, stop) steps of the window from it.

    A side is empty (start == stop) when that trajectory ended at the divergence (the other one is longer
    and agrees on every step before): such a window makes no DPO pair.
    """

    step: int
    success: tuple[int, int]
    failure: tuple[int, int]


def divergence_window(
    success_actions: Sequence[np.ndarray],
    failure_actions: Sequence[np.ndarray],
    config: RLLossConfig = DEFAULT,
) -> DivergenceWindow | None:
    """First step d where the two trajectories' per-step action tokens differ (a step's tokens may be of any
    length) and the window [d, d + dpo_window) on both sides, clipped to each length; None if identical."""
    n_s, n_f = len(success_actions), len(failure_actions)
    d = next(
        (t for t in range(min(n_s, n_f))
         if not np.array_equal(np.asarray(success_actions[t]), np.asarray(failure_actions[t]))),
        min(n_s, n_f),
    )
    if d == n_s == n_f:
        return None
    w = config.dpo_window
    return DivergenceWindow(step=d, success=(d, min(d + w, n_s)), failure=(d, min(d + w, n_f)))


def world_replay_loss(
    logits: jax.Array, labels: jax.Array, mask: jax.Array, replay: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
    """Cross-entropy on the stage-1 replay samples of a mixed batch: ``masked_cross_entropy`` over ``mask``
    [B, K] restricted to the rows where ``replay`` [B] is True (all rows if None) -> (loss, n_tokens)."""
    if replay is not None:
        mask = (mask > 0) & jnp.asarray(replay, bool)[:, None]
    return masked_cross_entropy(logits, labels, mask)


def post_training_loss(
    grpo: jax.Array,
    dpo: jax.Array,
    world: jax.Array,
    kl: jax.Array,
    config: RLLossConfig = DEFAULT,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """L_post = L_branch + lambda_world L_world + lambda_ref KL, with L_branch = L_GRPO + lambda_dpo L_DPO."""
    branch = grpo + config.lambda_dpo * dpo
    loss = branch + config.lambda_world * world + config.lambda_ref * kl
    metrics = {"post/loss": loss, "post/branch": branch, "post/grpo": grpo, "post/dpo": dpo,
               "post/world": world, "post/kl": kl}
    return loss, metrics
