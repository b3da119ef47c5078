"""The HiSTEVE policy: config, module (RS-Norm rows, Dual-Mouse rows), imitation loss, action sampler and
observation inputs, one concern per module:

- ``config``: ``PolicyConfig`` (base shape, codebook, action ids, frames per observation), ``tiny_config``;
- ``model``: ``Policy`` (the nnx module, ``from_pretrained``), ``init_action_rows``;
- ``loss``: ``action_loss`` (pure) and its metric groups;
- ``sampling``: ``ActionSampler`` (the caller keeps one per policy), ``decode_actions``, ``grammar_of``;
- ``observations``: (frames, instruction) -> prompt inputs, exactly the training prompt.
"""

from histeve_jax.policy.config import PolicyConfig, tiny_config
from histeve_jax.policy.loss import METRIC_GROUPS, action_loss
from histeve_jax.policy.model import Policy, init_action_rows
from histeve_jax.policy.observations import observation_inputs, policy_processor, regime_array
from histeve_jax.policy.sampling import ActionSampler, ActionTokens, SampledAction, decode_actions, grammar_of

__all__ = [
    "METRIC_GROUPS",
    "ActionSampler",
    "ActionTokens",
    "Policy",
    "PolicyConfig",
    "SampledAction",
    "action_loss",
    "decode_actions",
    "grammar_of",
    "init_action_rows",
    "observation_inputs",
    "policy_processor",
    "regime_array",
    "tiny_config",
]
