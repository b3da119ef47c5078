"""Pure losses: free functions of arrays that the policy, the detector and the train step all import.

No model or training code lives here, so nothing below ``histeve_jax.train`` needs to import it to get a
loss: ``tokens`` holds the imitation (and world-knowledge) objectives; RL's GRPO, DPO, KL and replay
losses go beside it.
"""

from histeve_jax.losses.tokens import grouped_accuracy, masked_cross_entropy, sequence_exact_match

__all__ = ["grouped_accuracy", "masked_cross_entropy", "sequence_exact_match"]
