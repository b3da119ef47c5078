"""VPT action space, Dual-Mouse action tokens, and the constrained-decoding grammar."""

from histeve_jax.actions.agent_format import (
    DiscreteAction,
    agent_to_discrete,
    agent_to_env,
    discrete_to_agent,
    discrete_to_env,
    env_to_agent,
    env_to_discrete,
    is_null_action,
)
from histeve_jax.actions.codebook import (
    BUTTON_GROUPS,
    BUTTONS,
    CODEBOOKS,
    ENV_KEYS,
    GROUP_NAMES,
    N_JOINT_BUTTONS,
    Codebook,
    Regime,
    get_codebook,
    regime_of,
)
from histeve_jax.actions.grammar import ActionConstraint, ActionGrammar, build_grammar
from histeve_jax.actions.tokens import TOKEN_GROUPS, ActionVocab, add_action_tokens, token_strings

__all__ = [
    "ActionConstraint",
    "TOKEN_GROUPS",
    "ActionGrammar",
    "ActionVocab",
    "BUTTONS",
    "BUTTON_GROUPS",
    "CODEBOOKS",
    "Codebook",
    "DiscreteAction",
    "ENV_KEYS",
    "GROUP_NAMES",
    "N_JOINT_BUTTONS",
    "Regime",
    "add_action_tokens",
    "agent_to_discrete",
    "agent_to_env",
    "discrete_to_agent",
    "discrete_to_env",
    "env_to_agent",
    "env_to_discrete",
    "get_codebook",
    "is_null_action",
    "regime_of",
    "token_strings",
    "build_grammar",
]
