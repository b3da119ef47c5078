"""The constrained-decoding automaton: its language is exactly the decodable actions of the regime."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from histeve_jax.actions import BUTTONS, Regime
from histeve_jax.actions.grammar import DONE, accepts, advance, build_grammar, mask_logits, start_state
from histeve_jax.actions.tokens import ActionVocab

V = 1200
BASE = 1000


def _decodes_as(vocab: ActionVocab, ids, regime) -> bool:
    try:
        return vocab.decode(ids)[1] == regime
    except ValueError:
        return False


@pytest.mark.parametrize("name", ["vpt", "openha"])
def test_every_encoded_action_is_accepted_in_its_regime_only(name):
    vocab = ActionVocab.contiguous(name, BASE)
    g = build_grammar(vocab, V)
    rng = np.random.default_rng(0)
    for i in range(500):
        a = {k: int(rng.random() < 0.2) for k in BUTTONS}
        a["camera"] = rng.standard_normal(2) * 5 * (rng.random(2) < 0.7)
        r = i % 2
        ids = vocab.encode(a, r)
        assert accepts(g, ids, r) and not accepts(g, ids, 1 - r)


@pytest.mark.parametrize("name", ["vpt", "openha"])
def test_random_walks_and_mutations_agree_with_decode(name):
    """Sequences the automaton can produce decode; mutated ones are accepted iff they decode."""
    vocab = ActionVocab.contiguous(name, BASE)
    g = build_grammar(vocab, V)
    allowed, nxt = np.asarray(g.allowed), np.asarray(g.next_state)
    rng = np.random.default_rng(1)
    action_ids = vocab.ids
    for i in range(600):
        r = i % 2
        s, ids = r, []
        while s != DONE:
            choices = np.flatnonzero(allowed[s])
            assert choices.size and np.all(choices >= BASE)  # never a text token
            t = int(rng.choice(choices))
            ids.append(t)
            s = int(nxt[s, t])
        assert _decodes_as(vocab, ids, r), ids
        # Mutate: replace, insert or delete one token (action tokens mostly, sometimes text).
        m = list(ids)
        k = int(rng.integers(len(m)))
        new = int(rng.choice(action_ids)) if rng.random() < 0.9 else int(rng.integers(BASE))
        op = rng.integers(3)
        if op == 0:
            m[k] = new
        elif op == 1:
            m.insert(k, new)
        elif len(m) > 1:
            del m[k]
        assert accepts(g, m, r) == _decodes_as(vocab, m, r), m


def test_mask_and_advance_in_jnp():
    vocab = ActionVocab.contiguous("vpt", BASE)
    g = build_grammar(vocab, V)
    s = start_state(jnp.array([0, 1]))
    logits = jnp.zeros((2, V))
    masked = mask_logits(g, s, logits)
    # Only the regime's type token survives at the start.
    assert [int(jnp.argmax(row)) for row in masked] == [BASE + 0, BASE + 1]
    assert int(jnp.sum(masked > jnp.finfo(jnp.float32).min)) == 2
    s = advance(g, s, jnp.argmax(masked, -1))
    # After the type token: every button, the inventory, END, and that regime's mouse tokens (20 of 40).
    n_ok = jnp.sum(g.allowed[s], axis=-1)
    assert n_ok.tolist() == [1 + 1 + 19 + 20] * 2
    end = jnp.full((2,), vocab.ids[vocab.slots.end])
    s = advance(g, s, end)
    assert s.tolist() == [DONE, DONE]
    assert mask_logits(g, s, logits).argmax(-1).tolist() == end.tolist()


def test_grammar_rejects_ids_beyond_vocab():
    with pytest.raises(ValueError, match="vocab_size"):
        build_grammar(ActionVocab.contiguous("openha", BASE), BASE + 50)


def test_no_regime_mixing():
    vocab = ActionVocab.contiguous("vpt", BASE)
    g = build_grammar(vocab, V)
    allowed = np.asarray(g.allowed)
    cam = [BASE + i for i, s in enumerate(vocab.strings) if s.startswith("<|cam_")]
    cur = [BASE + i for i, s in enumerate(vocab.strings) if s.startswith("<|cur_")]
    ng_states = [0] + list(range(2, 13))
    gui_states = [1] + list(range(13, 24))
    assert not allowed[np.ix_(ng_states, cur)].any() and allowed[np.ix_(ng_states, cam)].any()
    assert not allowed[np.ix_(gui_states, cam)].any() and allowed[np.ix_(gui_states, cur)].any()
    assert Regime.NG == 0


def test_without_dual_mouse_one_mouse_token_set_serves_both_regimes():
    """The ablation's vocabulary (``dual_mouse=False``): a GUI action is written exactly as the same action in
    NG (the NG type token and the camera tokens), decodes to the same physical action, and the grammar
    starts a GUI row as an NG one, so the cursor tokens are never produced."""
    dual = ActionVocab.contiguous("vpt", BASE)
    shared = ActionVocab.contiguous("vpt", BASE, dual_mouse=False)
    g = build_grammar(shared, V)
    cursor_ids = {int(dual.ids[s]) for m in dual.slots.mouse[Regime.GUI] for s in m if s >= 0}
    rng = np.random.default_rng(1)
    for _ in range(200):
        a = {k: int(rng.random() < 0.2) for k in BUTTONS}
        a["camera"] = rng.standard_normal(2) * 5 * (rng.random(2) < 0.7)
        ids = shared.encode(a, Regime.GUI)
        np.testing.assert_array_equal(ids, dual.encode(a, Regime.NG))
        assert not cursor_ids & set(ids.tolist())
        assert accepts(g, ids, Regime.GUI) and accepts(g, ids, Regime.NG)
        gui = dual.decode(dual.encode(a, Regime.GUI))[0]
        np.testing.assert_allclose(shared.decode(ids)[0]["camera"], gui["camera"])
    allowed = np.asarray(g.allowed)
    assert (allowed[int(start_state(jnp.asarray(Regime.GUI)))] == allowed[int(Regime.NG)]).all()
    assert not allowed[:, sorted(cursor_ids)].any()
