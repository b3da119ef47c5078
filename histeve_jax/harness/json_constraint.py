"""JSON-schema-constrained decoding for the local planner: a token automaton over a finite JSON language.

Supported JSON Schema subset (anything else is one ``UnsupportedSchema`` naming the JSON path):
``type: object`` with ``properties`` that are all ``required`` (emitted in the order listed;
``additionalProperties`` absent or false), ``anyOf`` / ``oneOf``, ``enum`` and ``const`` (strings, integers,
booleans, null), ``type: integer`` with both ``minimum`` and ``maximum``, ``type: boolean``, ``type: null``.
Free strings, numbers and arrays are not supported: a planner reply is a choice among admissible subtasks
with bounded parameters, so its language is finite.

``enumerate_json`` lists every value of the schema (at most ``MAX_VALUES``); each is serialised one way
(``json.dumps``, its default separators) and tokenised by the model's tokenizer; the token sequences,
each followed by the stop token, form a trie. ``TrieConstraint`` walks the trie inside the sampler's decode
loop (``Sampler``'s ``constraint`` hook: pure-jnp ``init(B)``, ``mask(state)``, ``update(state, tok)``), so
the model can only emit the canonical tokenisation of an admissible reply; after the stop token the state
stays in an accepting sink. A reply cut by the token budget ends inside the trie (finish_reason "length").
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import struct

MAX_VALUES = 8192


class UnsupportedSchema(ValueError):
    """A JSON Schema outside the supported subset; the message names the JSON path."""


def enumerate_json(schema: Any, path: str = "$") -> list[Any]:
    """Every value of ``schema`` (see the module docstring for the subset); UnsupportedSchema otherwise."""
    if not isinstance(schema, dict):
        raise UnsupportedSchema(f"{path}: a schema must be an object, got {schema!r}")
    for key in ("anyOf", "oneOf"):
        if key in schema:
            out = []
            for i, sub in enumerate(schema[key]):
                out += enumerate_json(sub, f"{path}.{key}[{i}]")
            return _bounded(out, path)
    if "const" in schema:
        return [schema["const"]]
    if "enum" in schema:
        vals = list(schema["enum"])
        bad = [v for v in vals if isinstance(v, float | list | dict)]
        if bad or not vals:
            raise UnsupportedSchema(f"{path}.enum: only non-empty enums of strings, integers, booleans, null")
        return vals
    t = schema.get("type")
    if t == "object":
        props = schema.get("properties") or {}
        req = list(schema.get("required") or [])
        if set(req) != set(props):
            raise UnsupportedSchema(f"{path}: every property must be required (got properties "
                                    f"{sorted(props)}, required {sorted(req)})")
        if schema.get("additionalProperties", False) not in (False, None):
            raise UnsupportedSchema(f"{path}.additionalProperties: must be false")
        keys = list(props)
        choices = [enumerate_json(props[k], f"{path}.{k}") for k in keys]
        n = int(np.prod([len(c) for c in choices])) if choices else 1
        if n > MAX_VALUES:
            raise UnsupportedSchema(f"{path}: {n} values, more than {MAX_VALUES}")
        return [dict(zip(keys, combo, strict=True)) for combo in itertools.product(*choices)]
    if t == "integer":
        lo, hi = schema.get("minimum"), schema.get("maximum")
        if not isinstance(lo, int) or not isinstance(hi, int) or hi < lo:
            raise UnsupportedSchema(f"{path}: an integer needs integer minimum <= maximum")
        return _bounded(list(range(lo, hi + 1)), path)
    if t == "boolean":
        return [False, True]
    if t == "null":
        return [None]
    raise UnsupportedSchema(f"{path}: type {t!r} is not supported (free strings, numbers and arrays have "
                            "no finite language); use enum/const, bounded integers, objects, anyOf")


def _bounded(vals: list[Any], path: str) -> list[Any]:
    if len(vals) > MAX_VALUES:
        raise UnsupportedSchema(f"{path}: {len(vals)} values, more than {MAX_VALUES}")
    return vals


def serialize(value: Any) -> str:
    """The one serialisation of a value the automaton admits."""
    return json.dumps(value)


@struct.dataclass
class TrieConstraint:
    """A token trie as a decode-time constraint: node n allows ``allowed[n, :k]`` (-1 = none) and moves to
    ``next[n, k]``. Node 0 is the root; ``sink`` accepts only the stop token, forever."""

    allowed: jnp.ndarray  # [N, K] int32
    next: jnp.ndarray  # [N, K] int32
    vocab_size: int = struct.field(pytree_node=False)
    sink: int = struct.field(pytree_node=False)

    def init(self, batch: int) -> jnp.ndarray:
        return jnp.zeros((batch,), jnp.int32)

    def mask(self, state: jnp.ndarray) -> jnp.ndarray:
        """[B, V] bool: the tokens each row may emit next."""
        toks = self.allowed[state]  # [B, K]
        idx = jnp.where(toks >= 0, toks, self.vocab_size)  # out of range: dropped
        rows = jnp.arange(state.shape[0])[:, None]
        return jnp.zeros((state.shape[0], self.vocab_size), bool).at[rows, idx].set(True, mode="drop")

    def update(self, state: jnp.ndarray, token: jnp.ndarray) -> jnp.ndarray:
        toks = self.allowed[state]
        hit = toks == token[:, None]
        nxt = jnp.take_along_axis(self.next[state], jnp.argmax(hit, axis=1)[:, None], axis=1)[:, 0]
        return jnp.where(hit.any(axis=1), nxt, state)  # a token off the trie (padding after stop) stays put

    @property
    def num_nodes(self) -> int:
        return int(self.allowed.shape[0])


def build_trie(sequences: Sequence[Sequence[int]], stop_id: int, vocab_size: int) -> TrieConstraint:
    """The constraint admitting exactly ``sequences``, each followed by ``stop_id``."""
    if not sequences:
        raise ValueError("build_trie: no sequences")
    children: list[dict[int, int]] = [{}]
    sink = -1
    for seq in sequences:
        node = 0
        for tok in list(seq):
            if not 0 <= int(tok) < vocab_size:
                raise ValueError(f"token id {tok} is outside the model's vocabulary of {vocab_size}")
            nxt = children[node].get(int(tok))
            if nxt is None:
                children.append({})
                nxt = children[node][int(tok)] = len(children) - 1
            node = nxt
        if sink < 0:
            children.append({})
            sink = len(children) - 1
        children[node][int(stop_id)] = sink
    children[sink][int(stop_id)] = sink
    width = max(len(c) for c in children)
    allowed = np.full((len(children), width), -1, np.int32)
    nexts = np.zeros((len(children), width), np.int32)
    for n, c in enumerate(children):
        for k, (tok, nxt) in enumerate(sorted(c.items())):
            allowed[n, k], nexts[n, k] = tok, nxt
    return TrieConstraint(jnp.asarray(allowed), jnp.asarray(nexts), int(vocab_size), int(sink))


def schema_constraint(schema: Any, tokenizer: Any, stop_id: int, vocab_size: int) -> TrieConstraint:
    """The constraint of a JSON Schema (the supported subset) for a model with this tokenizer."""
    texts = sorted({serialize(v) for v in enumerate_json(schema)})
    seqs = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    return build_trie(seqs, stop_id, vocab_size)
