"""Constrained decoding of one Dual-Mouse action: a small automaton over the action grammar, in jnp.

States: ``START_NG``/``START_GUI`` (only that regime's type token), then per regime a position ``p`` in the
fixed order (groups 0..7, mouse pitch 8, mouse yaw 9, 10 = only END), then ``DONE`` (absorbing; only END is
allowed, so a batch can keep stepping after some rows finish). From position ``p`` a token of order
``q >= p`` moves to ``q + 1``; the inventory token is allowed only right after the type token and moves to
10; END moves to DONE. Text tokens, the other regime's mouse tokens, and repeats are never allowed.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from histeve_jax.actions.codebook import GROUP_NAMES, Regime
from histeve_jax.actions.tokens import ActionVocab

_N_ORDER = len(GROUP_NAMES) + 2  # groups, then the two mouse axes
_N_POS = _N_ORDER + 1  # position _N_ORDER: only END


def _pos_state(regime: int, pos: int) -> int:
    return 2 + regime * _N_POS + pos


N_STATES = 2 + 2 * _N_POS + 1
DONE = N_STATES - 1


@struct.dataclass
class ActionGrammar:
    """Transition table of the action automaton over the model's whole vocabulary."""

    allowed: jax.Array  # [N_STATES, V] bool: which tokens may come next
    next_state: jax.Array  # [N_STATES, V] int32: the state after each token (unchanged where disallowed)

    @property
    def done(self) -> int:
        return DONE


@struct.dataclass
class ActionConstraint:
    """The grammar for a batch of rows and their regimes, as ``qwen2_5_vl.generate``'s ``constraint``."""

    grammar: ActionGrammar
    regime: jax.Array  # [B] int32, 0 = NG, 1 = GUI

    def init(self, batch_size: int) -> jax.Array:
        del batch_size  # the regimes fix it
        return start_state(self.regime)

    def mask(self, state: jax.Array) -> jax.Array:
        return self.grammar.allowed[state]

    def update(self, state: jax.Array, token: jax.Array) -> jax.Array:
        return advance(self.grammar, state, token)


def build_grammar(vocab: ActionVocab, vocab_size: int) -> ActionGrammar:
    """The automaton of ``vocab``'s actions for a model with ``vocab_size`` logits (without Dual-Mouse,
    ``vocab.dual_mouse=False``, the GUI start state allows what the NG one does)."""
    if int(vocab.ids.max()) >= vocab_size:
        raise ValueError(f"build_grammar: action token id {int(vocab.ids.max())} >= vocab_size {vocab_size}")
    allowed = np.zeros((N_STATES, vocab_size), bool)
    nxt = np.tile(np.arange(N_STATES, dtype=np.int32)[:, None], (1, vocab_size))
    sl = vocab.slots
    tok = vocab.ids

    def allow(state: int, slot: int, to: int) -> None:
        allowed[state, tok[slot]] = True
        nxt[state, tok[slot]] = to

    for r in (Regime.NG, Regime.GUI) if vocab.dual_mouse else (Regime.NG,):
        allow(int(r), sl.type[r], _pos_state(r, 0))
        order_slots = [list(g) for g in sl.groups] + [[int(s) for s in m if s >= 0] for m in sl.mouse[r]]
        for p in range(_N_POS):
            state = _pos_state(r, p)
            for q in range(p, _N_ORDER):
                for slot in order_slots[q]:
                    allow(state, slot, _pos_state(r, q + 1))
            allow(state, sl.end, DONE)
        allow(_pos_state(r, 0), sl.inventory, _pos_state(r, _N_ORDER))
    allow(DONE, sl.end, DONE)
    if not vocab.dual_mouse:  # one token set: a GUI row starts as an NG action (ActionVocab.dual_mouse)
        allowed[Regime.GUI], nxt[Regime.GUI] = allowed[Regime.NG], nxt[Regime.NG]
    return ActionGrammar(allowed=jnp.asarray(allowed), next_state=jnp.asarray(nxt))


def start_state(regime: jax.Array) -> jax.Array:
    """[B] regime (0 = NG, 1 = GUI) -> [B] int32 start state."""
    return jnp.asarray(regime, jnp.int32)


def mask_logits(grammar: ActionGrammar, state: jax.Array, logits: jax.Array) -> jax.Array:
    """[B] states, [B, V] logits -> logits with every disallowed token at the dtype's minimum."""
    ok = grammar.allowed[state]
    return jnp.where(ok, logits, jnp.finfo(logits.dtype).min)


def advance(grammar: ActionGrammar, state: jax.Array, token: jax.Array) -> jax.Array:
    """[B] states, [B] tokens -> [B] next states."""
    return grammar.next_state[state, token]


def is_done(state: jax.Array) -> jax.Array:
    return state == DONE


def accepts(grammar: ActionGrammar, ids: np.ndarray, regime: int) -> bool:
    """Whether ``ids`` is exactly one well-formed action of ``regime`` (numpy; for tests and checks)."""
    allowed, nxt = np.asarray(grammar.allowed), np.asarray(grammar.next_state)
    s = int(regime)
    for t in np.asarray(ids).reshape(-1).tolist():
        if s == DONE or not allowed[s, t]:
            return False
        s = int(nxt[s, t])
    return s == DONE
