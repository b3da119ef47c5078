"""Dual-Mouse action tokens: the vocabulary, and ``encode``/``decode`` between actions and token ids.

One action is the token sequence (null groups omitted)::

    TYPE  ( INVENTORY | [hotbar] [fore_back] [left_right] [sprint_sneak] [use] [drop] [attack] [jump]
                        [mouse_pitch] [mouse_yaw] )  END

* ``TYPE`` is ``<|act_ng|>`` or ``<|act_gui|>``: the interaction type begins every action.
* Each button group contributes one token for its chosen non-``none`` option, in VPT's group order; a group
  whose choice is ``none`` is omitted. At 20 Hz most actions press one or two keys, so omission keeps a
  typical action at 3-6 tokens (a no-op is ``TYPE END``) where explicit nulls would cost 13 every step.
* The mouse is one token per moving axis, from one of two *disjoint* sets: camera rotation
  ``<|cam_pitch_k|>``/``<|cam_yaw_k|>`` in NG, cursor motion ``<|cur_dy_k|>``/``<|cur_dx_k|>`` in GUI, with
  ``k`` the signed bin offset from the null bin. Both sets decode to the same codebook bins, so the branch
  is in representation only. Per-axis tokens (not VPT's joint n_bins**2 index) keep the whole vocabulary
  at 63 (VPT) / 103 (OpenHA) tokens: it fits in the spare rows of both Qwen2.5-VL tables.
* ``INVENTORY`` excludes everything else, as in VPT's hierarchical mapping.
* ``END`` closes the action, so decoding knows when to stop.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from histeve_jax.actions.agent_format import (
    DiscreteAction,
    agent_to_discrete,
    discrete_to_env,
    env_to_discrete,
)
from histeve_jax.actions.codebook import BUTTON_GROUPS, GROUP_NAMES, Codebook, Regime, get_codebook, regime_of

TYPE_TOKENS: tuple[str, str] = ("<|act_ng|>", "<|act_gui|>")  # indexed by Regime
END_TOKEN = "<|act_end|>"
INVENTORY_TOKEN = "<|act_inventory|>"
# Mouse token sets per regime: (pitch/dy name, yaw/dx name). Env camera is [dpitch, dyaw].
MOUSE_AXES: tuple[tuple[str, str], tuple[str, str]] = (("cam_pitch", "cam_yaw"), ("cur_dy", "cur_dx"))


# Kinds of action token, for per-group metrics: the index of each token's kind (see ``ActionVocab.groups``).
TOKEN_GROUPS: tuple[str, ...] = (
    "type", "inventory", *GROUP_NAMES, "cam_pitch", "cam_yaw", "cur_dy", "cur_dx", "end",
)


def _button_token(choice: str) -> str:
    return f"<|act_{choice}|>"


@dataclasses.dataclass(frozen=True)
class Slots:
    """Positions of each token kind in the vocabulary's slot order (the order of ``token_strings``)."""

    type: tuple[int, int]
    end: int
    inventory: int
    groups: tuple[tuple[int, ...], ...]  # per group, the slot of choices 1..n-1
    mouse: tuple[tuple[np.ndarray, np.ndarray], ...]  # [regime][axis] -> [n_bins] slot per bin, -1 at null


def token_strings(codebook: str | Codebook) -> tuple[str, ...]:
    """All action token strings for a codebook, in slot order."""
    cb = get_codebook(codebook)
    out = list(TYPE_TOKENS) + [END_TOKEN, INVENTORY_TOKEN]
    out += [_button_token(c) for _, choices in BUTTON_GROUPS for c in choices[1:]]
    for axes in MOUSE_AXES:
        for axis in axes:
            out += [f"<|{axis}_{b - cb.null_bin:+d}|>" for b in range(cb.n_bins) if b != cb.null_bin]
    return tuple(out)


def _slots(cb: Codebook) -> Slots:
    s = 4
    groups = []
    for _, choices in BUTTON_GROUPS:
        groups.append(tuple(range(s, s + len(choices) - 1)))
        s += len(choices) - 1
    mouse = []
    for _ in MOUSE_AXES:
        per_axis = []
        for _ in range(2):
            m = np.full(cb.n_bins, -1, np.int64)
            m[np.arange(cb.n_bins) != cb.null_bin] = np.arange(s, s + cb.n_bins - 1)
            s += cb.n_bins - 1
            per_axis.append(m)
        mouse.append(tuple(per_axis))
    return Slots(type=(0, 1), end=2, inventory=3, groups=tuple(groups), mouse=tuple(mouse))


@dataclasses.dataclass(frozen=True, eq=False)
class ActionVocab:
    """The Dual-Mouse vocabulary of one codebook: slot -> model token id, and encode/decode."""

    codebook: Codebook
    ids: np.ndarray  # [n_tokens] int64: the vocabulary id of each slot
    # False: the ablation without Dual-Mouse: every action is written as an NG action (its type token and
    # the camera tokens), so GUI cursor motion shares the camera's tokens and no token says the regime.
    dual_mouse: bool = True

    def __post_init__(self):
        n = len(token_strings(self.codebook))
        if self.ids.shape != (n,) or len(set(self.ids.tolist())) != n or self.ids.min() < 0:
            raise ValueError(f"ActionVocab: ids must be {n} distinct ints >= 0, got shape {self.ids.shape}")

    @classmethod
    def contiguous(cls, codebook: str | Codebook, first_id: int, *, dual_mouse: bool = True) -> ActionVocab:
        """Action tokens at ids first_id, first_id + 1, ... (a tiny test model, or a fresh tokenizer)."""
        cb = get_codebook(codebook)
        return cls(cb, np.arange(first_id, first_id + len(token_strings(cb)), dtype=np.int64), dual_mouse)

    @classmethod
    def from_tokenizer(cls, tokenizer: Any, codebook: str | Codebook) -> ActionVocab:
        """Ids of the action tokens in a tokenizer that already has them (see :func:`add_action_tokens`)."""
        cb = get_codebook(codebook)
        strings = token_strings(cb)
        ids = tokenizer.convert_tokens_to_ids(list(strings))
        unk = getattr(tokenizer, "unk_token_id", None)
        missing = [s for s, i in zip(strings, ids, strict=True) if i is None or i == unk]
        if missing:
            raise ValueError(f"tokenizer lacks action token {missing[0]!r}; call add_action_tokens first")
        return cls(cb, np.asarray(ids, dtype=np.int64))

    @functools.cached_property
    def slots(self) -> Slots:
        return _slots(self.codebook)

    @functools.cached_property
    def strings(self) -> tuple[str, ...]:
        return token_strings(self.codebook)

    @functools.cached_property
    def slot_of_id(self) -> dict[int, int]:
        return {int(t): s for s, t in enumerate(self.ids.tolist())}

    @property
    def max_len(self) -> int:
        """The longest action: type, every group, both mouse axes, end."""
        return 1 + len(GROUP_NAMES) + 2 + 1

    @functools.cached_property
    def groups(self) -> np.ndarray:
        """[n_tokens] int32: each slot's index into ``TOKEN_GROUPS``."""
        sl = self.slots
        out = np.zeros(len(self.ids), np.int32)
        out[list(sl.type)] = TOKEN_GROUPS.index("type")
        out[sl.inventory] = TOKEN_GROUPS.index("inventory")
        out[sl.end] = TOKEN_GROUPS.index("end")
        for g, slots in enumerate(sl.groups):
            out[list(slots)] = TOKEN_GROUPS.index(GROUP_NAMES[g])
        for r, names in enumerate(MOUSE_AXES):
            for axis, name in enumerate(names):
                m = sl.mouse[r][axis]
                out[m[m >= 0]] = TOKEN_GROUPS.index(name)
        return out

    def group_table(self, vocab_size: int) -> np.ndarray:
        """[vocab_size] int32: a token id's index into ``TOKEN_GROUPS``; ``len(TOKEN_GROUPS)`` for others."""
        table = np.full(vocab_size, len(TOKEN_GROUPS), np.int32)
        table[self.ids] = self.groups
        return table

    def id_of(self, slot: int) -> int:
        return int(self.ids[slot])

    def encode_discrete(self, action: DiscreteAction, regime: Regime | int) -> np.ndarray:
        """One unbatched discrete action -> [n] int32 token ids."""
        if action.batch_shape != ():
            raise ValueError(f"encode: one action at a time, got batch shape {action.batch_shape}")
        r = regime_of(int(regime)) if self.dual_mouse else Regime.NG
        a = action.canonical(self.codebook)
        sl = self.slots
        out = [sl.type[r]]
        if bool(a.inventory):
            out.append(sl.inventory)
        else:
            for g, choice in enumerate(a.choices.tolist()):
                if choice:
                    out.append(sl.groups[g][choice - 1])
            for axis in range(2):
                b = int(a.camera[axis])
                if b != self.codebook.null_bin:
                    out.append(int(sl.mouse[r][axis][b]))
        out.append(sl.end)
        return self.ids[np.asarray(out)].astype(np.int32)

    def encode(self, action: Mapping[str, Any], regime: Regime | int | bool) -> np.ndarray:
        """An env-format action (or MineStudio agent format, if it has ``buttons``) -> [n] int32 token ids."""
        if "buttons" in action:
            d = agent_to_discrete(action, self.codebook)
        else:
            d = env_to_discrete(action, self.codebook)
        return self.encode_discrete(d, regime_of(regime))

    def decode_discrete(self, ids: Sequence[int] | np.ndarray) -> tuple[DiscreteAction, Regime]:
        """Ids of exactly one action (``TYPE ... END``) -> (discrete action, regime), else ValueError."""
        ids = np.asarray(ids).reshape(-1)
        lookup = self.slot_of_id
        strings = self.strings
        sl = self.slots
        cb = self.codebook

        def name(i: int) -> str:
            t = int(ids[i])
            return strings[lookup[t]] if t in lookup else f"id {t} (not an action token)"

        if len(ids) < 2:
            raise ValueError(f"decode: an action needs at least TYPE and END, got {ids.tolist()}")
        first = lookup.get(int(ids[0]))
        if first not in sl.type:
            raise ValueError(f"decode: token 0 must be {TYPE_TOKENS[0]} or {TYPE_TOKENS[1]}, got {name(0)}")
        regime = Regime(sl.type.index(first))
        choices = np.zeros(len(GROUP_NAMES), np.int64)
        camera = np.full(2, cb.null_bin, np.int64)
        inventory = False
        # Position in the fixed order: 0..n_groups-1 groups, n_groups / n_groups+1 mouse axes.
        pos = 0
        for i in range(1, len(ids)):
            slot = lookup.get(int(ids[i]))
            if slot is None:
                raise ValueError(f"decode: token {i} {name(i)}")
            if slot == sl.end:
                if i != len(ids) - 1:
                    raise ValueError(f"decode: token {i + 1} {name(i + 1)} follows {END_TOKEN}")
                action = DiscreteAction(choices=choices, inventory=np.asarray(inventory), camera=camera)
                return action, regime
            if inventory:
                raise ValueError(f"decode: token {i} {name(i)} follows {INVENTORY_TOKEN}, not {END_TOKEN}")
            if slot == sl.inventory and i == 1:
                inventory = True
                continue
            hit = None
            for g in range(pos, len(GROUP_NAMES)):
                if slot in sl.groups[g]:
                    hit = g
                    choices[g] = sl.groups[g].index(slot) + 1
            for axis in range(2):
                if hit is None and pos <= len(GROUP_NAMES) + axis and slot in sl.mouse[regime][axis]:
                    hit = len(GROUP_NAMES) + axis
                    camera[axis] = int(np.flatnonzero(sl.mouse[regime][axis] == slot)[0])
            if hit is None:
                raise ValueError(
                    f"decode: token {i} {name(i)} is not allowed here in a {regime.name} action "
                    "(wrong regime's mouse token, repeated or out-of-order group, or not an action token)"
                )
            pos = hit + 1
        seq = [name(i) for i in range(len(ids))]
        raise ValueError(f"decode: action does not end with {END_TOKEN}: {seq}")

    def decode(self, ids: Sequence[int] | np.ndarray) -> tuple[dict[str, Any], Regime]:
        """Token ids of one action -> (quantised env-format action, regime)."""
        action, regime = self.decode_discrete(ids)
        return discrete_to_env(action, self.codebook), regime


def add_action_tokens(tokenizer: Any, codebook: str | Codebook = "vpt") -> ActionVocab:
    """Add the Dual-Mouse tokens to a Hugging Face tokenizer as special tokens; returns their ids."""
    from transformers import AddedToken

    strings = token_strings(codebook)
    # special=True: never split, and skipped when detokenising text; normalized=False: matched verbatim.
    new = [AddedToken(s, special=True, normalized=False) for s in strings]
    tokenizer.add_tokens(new, special_tokens=True)
    return ActionVocab.from_tokenizer(tokenizer, codebook)
