"""The action side of an export as plain data: the codebook and its tokens (JSON), the grammar and the id
remap (numpy arrays), everything the exported ``histeve_action.py`` needs to act without JAX.

``histeve_actions.json`` holds, per action token (slot order of ``actions.tokens.token_strings``): its
string, tokenizer id, model id (they differ only for tiny models, whose table is compact), and what it
decodes to (``kind`` type/end/inventory/button/camera with the env key, or the camera axis and the bin's
degrees from ``Codebook.undiscretize``; ``order``: its place in the fixed token order), so the env-format
decode is a table lookup. It also names the
grammar file (``action_grammar.npz``: ``allowed`` [S, V] bool and ``next_state`` [S, V] int32 from
``actions.grammar.build_grammar``, start state = regime, ``done`` absorbing), the id map file
(``id_map.npy``, tokenizer id -> model id) or null, and the observation layout (frames, size, stride, whether
history stays within a GUI-open or closed run, and the codec of the frames the policy was trained on: a
JPEG-trained policy acts on each frame's JPEG round trip).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from histeve_jax.actions import grammar as grammar_lib
from histeve_jax.actions.codebook import BUTTON_GROUPS, BUTTONS, CAMERA, INVENTORY, Regime
from histeve_jax.actions.tokens import MOUSE_AXES, ActionVocab
from histeve_jax.policy import PolicyConfig, grammar_of

ACTIONS_FILE = "histeve_actions.json"
GRAMMAR_FILE = "action_grammar.npz"
ID_MAP_FILE = "id_map.npy"
FORMAT_VERSION = 1


def _decode_entries(vocab: ActionVocab) -> list[dict[str, Any]]:
    """What each slot decodes to, in slot order."""
    sl, cb = vocab.slots, vocab.codebook
    out: list[dict[str, Any]] = [{} for _ in vocab.strings]
    for r in Regime:
        out[sl.type[r]] = {"kind": "type", "regime": int(r)}
    out[sl.end] = {"kind": "end"}
    out[sl.inventory] = {"kind": INVENTORY}
    for g, (_, choices) in enumerate(BUTTON_GROUPS):
        for c, slot in enumerate(sl.groups[g], start=1):
            out[slot] = {"kind": "button", "key": choices[c], "order": g}
    degrees = cb.undiscretize(np.arange(cb.n_bins))
    for r in Regime:
        for axis in range(2):
            for b, slot in enumerate(sl.mouse[r][axis].tolist()):
                if slot >= 0:
                    out[slot] = {"kind": "camera", "regime": int(r), "axis": axis, "bin": b,
                                 "order": len(BUTTON_GROUPS) + axis,
                                 "degrees": float(degrees[b]), "name": MOUSE_AXES[r][axis]}
    return out


def action_tables(config: PolicyConfig, tokenizer_vocab: ActionVocab, *, id_map: np.ndarray | None,
                  stride: int, frame_format: str, jpeg_quality: int = 95,
                  history_in_regime: bool = False) -> dict[str, Any]:
    """The ``histeve_actions.json`` dict of a policy (module docstring); ``frame_format``/``jpeg_quality``:
    the run's ``data.frame_format``/``data.jpeg_quality`` (png: lossless, frames are used as they come;
    ``export_policy`` checks the format)."""
    vocab = config.vocab
    cb = vocab.codebook
    tokens = []
    for slot, (s, entry) in enumerate(zip(vocab.strings, _decode_entries(vocab), strict=True)):
        tokens.append({"string": s, "tokenizer_id": int(tokenizer_vocab.ids[slot]),
                       "model_id": int(vocab.ids[slot]), **entry})
    return {
        "format": FORMAT_VERSION,
        "codebook": {"name": cb.name, "mu": cb.mu, "maxval": cb.maxval, "binsize": cb.binsize,
                     "scheme": cb.scheme, "n_bins": cb.n_bins, "null_bin": cb.null_bin},
        "env_keys": list(BUTTONS) + [CAMERA],
        "regimes": [r.name for r in Regime],
        "tokens": tokens,
        "end_model_id": vocab.id_of(vocab.slots.end),
        "max_action_tokens": vocab.max_len,
        "grammar": {"file": GRAMMAR_FILE, "n_states": grammar_lib.N_STATES, "done": grammar_lib.DONE,
                    "start_state": {r.name: int(r) for r in Regime}},
        "id_map": None if id_map is None else ID_MAP_FILE,
        "model_vocab_size": config.vocab_size,
        "observation": {"history_frames": config.history_frames, "stride": int(stride),
                        "history_in_regime": bool(history_in_regime),
                        "image_size": list(config.image_size),
                        "frame_codec": {"format": frame_format, "quality": int(jpeg_quality)}},
        "detector": None,  # the completion detector's sub-directory, once runs have one
    }


def grammar_arrays(config: PolicyConfig) -> dict[str, np.ndarray]:
    """``allowed`` [S, V] bool and ``next_state`` [S, V] int32 of the policy's action automaton."""
    g = grammar_of(config)
    return {"allowed": np.asarray(g.allowed, bool), "next_state": np.asarray(g.next_state, np.int32)}
