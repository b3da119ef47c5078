"""Pure losses: free functions of arrays that the policy, the detector and the train step all import.

No model or training code lives here, so nothing below ``histeve_jax.train`` needs to import it to get a
loss: ``tokens`` holds the imitation (and world-knowledge) objectives; RL's GRPO, DPO, KL and replay
losses go beside it.
"""

from histeve_jax.losses.rl import (
    DivergenceWindow,
    GroupAdvantages,
    PairLogProbs,
    RLLossConfig,
    divergence_window,
    dpo_loss,
    group_advantages,
    grpo_loss,
    pair_log_probs,
    per_token_kl,
    post_training_loss,
    reference_kl,
    token_log_probs,
    world_replay_loss,
)
from histeve_jax.losses.tokens import grouped_accuracy, masked_cross_entropy, sequence_exact_match

__all__ = [
    "DivergenceWindow",
    "GroupAdvantages",
    "PairLogProbs",
    "RLLossConfig",
    "divergence_window",
    "dpo_loss",
    "group_advantages",
    "grouped_accuracy",
    "grpo_loss",
    "masked_cross_entropy",
    "pair_log_probs",
    "per_token_kl",
    "post_training_loss",
    "reference_kl",
    "sequence_exact_match",
    "token_log_probs",
    "world_replay_loss",
]
