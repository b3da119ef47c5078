"""Dual-Mouse tokens: exact round trips, disjoint mouse sets, real Qwen tokenizer ids, malformed sequences."""

from __future__ import annotations

import os

import numpy as np
import pytest
from transformers import AutoTokenizer

from histeve_jax.actions import BUTTONS, CODEBOOKS, DiscreteAction, Regime, env_to_agent, env_to_discrete
from histeve_jax.actions.agent_format import discrete_to_env
from histeve_jax.actions.tokens import ActionVocab, add_action_tokens, token_strings
from histeve_jax.data.tokenizer import NUM_TOKENIZER_IDS, qwen2_5_vl_tokenizer_dir

os.environ.setdefault("HF_HUB_OFFLINE", "1")

BASE = 1000  # a tiny model's vocabulary: action tokens at 1000..


def _random_actions(rng: np.random.Generator, n: int) -> dict:
    """n env actions, batched: sparse and dense presses, camera from still to clipped."""
    p = rng.choice([0.05, 0.3, 0.8], size=(n, 1))
    buttons = (rng.random((n, len(BUTTONS))) < p).astype(np.int64)
    scale = rng.choice([0.0, 0.5, 4.0, 40.0], size=(n, 1))
    acts = {k: buttons[:, i] for i, k in enumerate(BUTTONS)}
    acts["camera"] = rng.standard_normal((n, 2)) * scale * (rng.random((n, 2)) < 0.8)
    return acts


def _row(batch: dict, i: int) -> dict:
    return {k: (v[i] if k == "camera" else int(v[i])) for k, v in batch.items()}


def _assert_env_equal(x: dict, y: dict) -> None:
    assert set(x) == set(y)
    for k in x:
        np.testing.assert_array_equal(x[k], y[k], err_msg=k)


@pytest.mark.parametrize("name", ["vpt", "openha"])
def test_round_trip_is_exact_on_quantised_actions(name):
    vocab = ActionVocab.contiguous(name, BASE)
    n = 3000
    acts = _random_actions(np.random.default_rng(0), n)
    d = env_to_discrete(acts, name)  # batched quantisation, then one action at a time through the tokens
    quantised, agent = discrete_to_env(d, name), env_to_agent(acts, name)
    for i in range(n):
        regime = Regime(i % 2)
        row = DiscreteAction(d.choices[i], d.inventory[i], d.camera[i])
        ids = vocab.encode_discrete(row, regime)
        assert ids[0] == vocab.ids[vocab.slots.type[regime]] and len(ids) <= vocab.max_len
        got, got_regime = vocab.decode_discrete(ids)
        assert got_regime is regime
        for field in ("choices", "inventory", "camera"):
            np.testing.assert_array_equal(getattr(got, field), getattr(row, field))
        if i % 10 == 0:  # the env- and agent-format entry points give the same tokens and actions
            a = _row(acts, i)
            np.testing.assert_array_equal(vocab.encode(a, regime), ids)
            one_agent = {"buttons": int(agent["buttons"][i]), "camera": int(agent["camera"][i])}
            np.testing.assert_array_equal(vocab.encode(one_agent, regime), ids)
            env, _ = vocab.decode(ids)
            _assert_env_equal(env, _row(quantised, i))
            assert env_to_agent(env, name) == env_to_agent(a, name)


@pytest.mark.parametrize("name", ["vpt", "openha"])
def test_camera_and_cursor_tokens_are_disjoint_but_decode_alike(name):
    vocab = ActionVocab.contiguous(name, BASE)
    strings = token_strings(name)
    cam = {s for s in strings if s.startswith("<|cam_")}
    cur = {s for s in strings if s.startswith("<|cur_")}
    n = CODEBOOKS[name].n_bins - 1
    assert len(cam) == len(cur) == 2 * n and not cam & cur
    assert len(set(strings)) == len(strings) == 4 + 19 + 4 * n
    a = {"use": 1, "camera": np.array([3.0, -7.0])}
    ng, gui = vocab.encode(a, Regime.NG), vocab.encode(a, Regime.GUI)
    ng_mouse, gui_mouse = set(ng[-3:-1].tolist()), set(gui[-3:-1].tolist())
    assert not ng_mouse & gui_mouse
    _assert_env_equal(vocab.decode(ng)[0], vocab.decode(gui)[0])


def test_hand_checked_sequences():
    vocab = ActionVocab.contiguous("vpt", 0)
    s = vocab.strings
    as_str = lambda a, r: [s[vocab.slot_of_id[int(t)]] for t in vocab.encode(a, r)]
    assert as_str({"camera": [0.0, 0.0]}, Regime.NG) == ["<|act_ng|>", "<|act_end|>"]
    # pitch -10 is bin 0 (offset -5); mu-law puts yaw 0.1 at 5.2 -> the null bin, so only pitch is emitted.
    assert as_str({"forward": 1, "attack": 1, "camera": [-10.0, 0.1]}, Regime.NG) == [
        "<|act_ng|>", "<|act_forward|>", "<|act_attack|>", "<|cam_pitch_-5|>", "<|act_end|>",
    ]
    # Inventory excludes the rest; hotbar ties go to the later key; forward+back cancel.
    assert as_str({"inventory": 1, "jump": 1, "camera": [5.0, 5.0]}, Regime.GUI) == [
        "<|act_gui|>", "<|act_inventory|>", "<|act_end|>",
    ]
    assert as_str({"hotbar.2": 1, "hotbar.7": 1, "forward": 1, "back": 1, "camera": [0.0, 10.0]}, 1) == [
        "<|act_gui|>", "<|act_hotbar.7|>", "<|cur_dx_+5|>", "<|act_end|>",
    ]


@pytest.mark.parametrize("name", ["vpt", "openha"])
def test_real_qwen_tokenizer_ids_fit_both_tables(name):
    # A fresh instance: load_qwen_tokenizer's is shared by the process (and may already have the tokens).
    tok = AutoTokenizer.from_pretrained(str(qwen2_5_vl_tokenizer_dir()), local_files_only=True)
    n_before = len(tok)
    assert n_before == NUM_TOKENIZER_IDS
    vocab = add_action_tokens(tok, name)
    n = len(token_strings(name))
    np.testing.assert_array_equal(vocab.ids, np.arange(n_before, n_before + n))
    # Spare rows: the 3B table has 151936, the 7B 152064; no resize is needed for either.
    assert vocab.ids.max() < 151936
    # The tokenizer reads the action strings back as single special tokens, and text decoding skips them.
    ids = vocab.encode({"forward": 1, "camera": [2.0, -2.0]}, Regime.NG)
    text = "".join(vocab.strings[vocab.slot_of_id[int(t)]] for t in ids)
    assert tok(text, add_special_tokens=False)["input_ids"] == ids.tolist()
    assert tok.decode(ids.tolist(), skip_special_tokens=True) == ""
    # Adding again is idempotent: the same ids.
    np.testing.assert_array_equal(add_action_tokens(tok, name).ids, vocab.ids)
    assert len(tok) == n_before + n


@pytest.mark.parametrize(
    "seq, match",
    [
        (["<|act_end|>"], "at least TYPE and END"),
        (["<|act_forward|>", "<|act_end|>"], "token 0 must be"),
        (["<|act_ng|>", "<|cur_dx_+1|>", "<|act_end|>"], "not allowed here in a NG action"),
        (["<|act_gui|>", "<|cam_yaw_+1|>", "<|act_end|>"], "not allowed here in a GUI action"),
        (["<|act_ng|>", "<|act_attack|>", "<|act_forward|>", "<|act_end|>"], "not allowed here"),
        (["<|act_ng|>", "<|act_forward|>", "<|act_back|>", "<|act_end|>"], "not allowed here"),
        (["<|act_ng|>", "<|cam_yaw_+1|>", "<|cam_pitch_+1|>", "<|act_end|>"], "not allowed here"),
        (["<|act_ng|>", "<|act_jump|>", "<|act_inventory|>", "<|act_end|>"], "not allowed here"),
        (["<|act_ng|>", "<|act_inventory|>", "<|act_jump|>", "<|act_end|>"], "follows <|act_inventory|>"),
        (["<|act_ng|>", "<|act_jump|>"], "does not end with"),
        (["<|act_ng|>", "<|act_end|>", "<|act_end|>"], "follows <|act_end|>"),
        (["<|act_ng|>", 7, "<|act_end|>"], r"id 7 \(not an action token\)"),
    ],
)
def test_malformed_sequences_raise_naming_the_token(seq, match):
    vocab = ActionVocab.contiguous("vpt", BASE)
    ids = [t if isinstance(t, int) else BASE + vocab.strings.index(t) for t in seq]
    with pytest.raises(ValueError, match=match):
        vocab.decode(ids)
