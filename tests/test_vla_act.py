"""``act``: KV-cached constrained decoding gives well-formed actions of the requested regime."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import qwen_images, qwen_vision_block
from flax import nnx

from histeve_jax.actions import ENV_KEYS, Regime
from histeve_jax.actions import grammar as G
from histeve_jax.models.vla import VLAPolicy, act, decode_actions, grammar_of, tiny_config


def make_prompts(config, regimes, seed: int = 0):
    """Left-padded prompts: F frames then an instruction of varying length (as act expects)."""
    base = config.base
    rng = np.random.default_rng(seed)
    n = len(regimes)
    pv, grid = qwen_images([config.image_size] * n * config.num_frames, seed=seed)
    rows = []
    for i in range(n):
        p = [1, 2]
        for f in range(config.num_frames):
            p += qwen_vision_block(base, grid[i * config.num_frames + f], base.image_token_id)
        rows.append(p + rng.integers(10, 290, size=2 + i % 4).tolist())
    T = max(map(len, rows))
    ids = np.zeros((n, T), np.int32)
    am = np.zeros((n, T), np.int32)
    for i, p in enumerate(rows):
        ids[i, T - len(p) :] = p
        am[i, T - len(p) :] = 1
    return ids, am, pv


@pytest.fixture(scope="module")
def policy():
    return VLAPolicy(tiny_config(history_frames=1), rngs=nnx.Rngs(0))


def test_1000_sampled_actions_are_valid_in_the_requested_regime(policy):
    regimes = np.arange(250) % 2
    ids, am, pv = make_prompts(policy.config, regimes)
    # 4 x 250 rows (one compiled shape), 1000 actions in all.
    tokens = np.concatenate(
        [act(policy, ids, am, pv, regimes, jax.random.key(k), temperature=1.0) for k in range(4)]
    )
    regimes = np.tile(regimes, 4)
    decoded = decode_actions(policy.config, tokens)  # raises on any malformed row
    assert [int(r) for _, r in decoded] == regimes.tolist()
    g = grammar_of(policy.config)
    vocab = policy.config.vocab
    end = vocab.id_of(vocab.slots.end)
    for row, r in zip(tokens, regimes, strict=True):
        n = int(np.flatnonzero(row == end)[0]) + 1
        assert G.accepts(g, row[:n], r) and np.all(row[n:] == end)
    # Sampling at temperature 1 explores the grammar: many distinct actions, mouse tokens of both sets.
    assert len({tuple(t) for t in tokens.tolist()}) > 500
    strings = vocab.strings
    used = {strings[vocab.slot_of_id[int(t)]] for t in tokens.reshape(-1)}
    assert any(s.startswith("<|cam_") for s in used) and any(s.startswith("<|cur_") for s in used)
    assert "<|act_inventory|>" in used


def test_greedy_act_equals_uncached_decoding(policy):
    """The KV cache and the decode positions (left padding, M-RoPE) give the full forward's argmax."""
    regimes = np.array([0, 1, 1, 0])
    ids, am, pv = make_prompts(policy.config, regimes, seed=5)
    # Make greedy decoding non-trivial: random action rows in the lm_head.
    model = policy.model
    w = np.asarray(model.lm_head[...]).copy()
    w[:, policy.config.vocab.ids] = np.random.default_rng(0).standard_normal((w.shape[0], 63)) * 0.5
    model.lm_head.set_value(jnp.asarray(w))
    tokens = act(policy, ids, am, pv, regimes, jax.random.key(0), greedy=True)
    g = grammar_of(policy.config)
    grid = policy.config.image_grid(len(regimes) * policy.config.num_frames)
    graphdef, params = nnx.split(model)

    @jax.jit
    def forward(params, seq, mask):  # one fixed shape: the tokens not generated yet are masked out
        m = nnx.merge(graphdef, params)
        return m(seq, attention_mask=mask, pixel_values=jnp.asarray(pv), image_grid_thw=grid,
                 regime=jnp.asarray(regimes))

    B, T = ids.shape
    M = tokens.shape[1]
    seq = np.concatenate([ids, np.zeros((B, M), np.int32)], 1)
    mask = np.concatenate([am, np.zeros((B, M), np.int32)], 1)
    state = G.start_state(jnp.asarray(regimes))
    want = []
    for i in range(M):
        logits = forward(params, jnp.asarray(seq), jnp.asarray(mask))[:, T + i - 1]
        tok = jnp.argmax(G.mask_logits(g, state, logits), -1)
        state = G.advance(g, state, tok)
        want.append(np.asarray(tok))
        seq[:, T + i], mask[:, T + i] = np.asarray(tok), 1
        if bool(jnp.all(G.is_done(state))):
            break
    want = np.stack(want, 1)
    np.testing.assert_array_equal(tokens[:, : want.shape[1]], want)
    assert [int(r) for _, r in decode_actions(policy.config, tokens)] == regimes.tolist()
    assert len({tuple(r) for r in tokens.tolist()}) > 1
    # Right padding is left-aligned by generate: the same actions.
    right_ids, right_am = np.zeros_like(ids), np.zeros_like(am)
    for b in range(B):
        n = int(am[b].sum())
        right_ids[b, :n], right_am[b, :n] = ids[b, T - n :], 1
    right = act(policy, right_ids, right_am, pv, regimes, jax.random.key(0), greedy=True)
    np.testing.assert_array_equal(right, tokens)


def test_observation_prompt_is_the_pipelines_training_prompt_and_acts(policy):
    """act's prompt for (frames, instruction) is the prefix of the training sample the pipeline builds."""
    from histeve_jax.data import records
    from histeve_jax.data.pipeline import CompactVocab, FeatureSpec, Featurize
    from histeve_jax.models.qwen2_5_vl import qwen2_5_vl_7b
    from histeve_jax.models.vla import VLAConfig, act_on_observations, observation_inputs, policy_processor

    config = policy.config
    compact = CompactVocab()
    spec = FeatureSpec(history=config.history_frames, image_size=config.image_size, max_len=256,
                       compact_vocab=compact)
    featurize = Featurize(spec)
    rng = np.random.default_rng(0)
    rows = [("chop the tree", False, {"attack": 1, "camera": [1.0, -4.0]}),
            ("open the crafting table and make planks", True, {"use": 1, "camera": [-2.0, 0.0]})]
    observations, samples = [], []
    for text, gui, action in rows:
        frames = [rng.integers(0, 256, (70, 90, 3), dtype=np.uint8) for _ in range(config.num_frames)]
        rec = {"instruction": text, "subtask": "", "action": action, "is_gui_open": gui}
        samples.append(featurize._features({"record": rec, "frames": [records.encode_frame(f, "png")
                                                                      for f in frames]}))
        observations.append((frames, text))
    tok = featurize._processor.tokenizer
    VLAConfig(base=qwen2_5_vl_7b(), codebook=config.codebook).check_tokenizer(tok)  # ids right after Qwen's
    with pytest.raises(ValueError, match="action_token_base is 320"):
        policy.check_tokenizer(tok)  # the tiny table's ids differ: only the pipeline's remap reaches them
    processor = policy_processor(config, tok)
    table = compact.table(len(config.vocab.ids))
    inputs = observation_inputs(config, processor, observations, id_map=table)
    first_action = config.vocab.ids[config.vocab.slots.type[0]]
    for i, sample in enumerate(samples):
        n_prompt = int(np.flatnonzero(sample["input_ids"] >= first_action)[0])
        prompt = inputs["input_ids"][i][inputs["attention_mask"][i] == 1]
        np.testing.assert_array_equal(prompt, sample["input_ids"][:n_prompt])
    np.testing.assert_array_equal(inputs["pixel_values"],
                                  np.concatenate([s["pixel_values"] for s in samples]))
    out = act_on_observations(policy, processor, observations, [{"is_gui_open": False}, {"isGuiOpen": True}],
                              jax.random.key(1), id_map=table)
    assert [r for _, r in out] == [Regime.NG, Regime.GUI]
    assert all(set(a) == set(ENV_KEYS) and a["camera"].shape == (2,) for a, _ in out)


def test_act_follows_a_weight_sync(policy):
    """act keeps one Actor per policy; nnx.update (an RL weight sync) changes what it samples, exactly."""
    config = policy.config
    regimes = np.array([0, 1])
    ids, am, pv = make_prompts(config, regimes, seed=7)
    mine = VLAPolicy(config, rngs=nnx.Rngs(1))
    other = VLAPolicy(config, rngs=nnx.Rngs(2))
    for p, seed in ((mine, 1), (other, 2)):  # varied greedy actions: random action rows in the lm_head
        w = np.asarray(p.model.lm_head[...]).copy()
        w[:, config.vocab.ids] = np.random.default_rng(seed).standard_normal((w.shape[0], 63))
        p.model.lm_head.set_value(jnp.asarray(w))
    run = lambda p: act(p, ids, am, pv, regimes, jax.random.key(0), greedy=True)
    want_other = run(other)
    before = run(mine)
    nnx.update(mine, nnx.state(other))
    np.testing.assert_array_equal(run(mine), want_other)
    assert not np.array_equal(before, want_other)
    # The per-policy cache does not keep a policy alive.
    import gc
    import weakref

    gone = weakref.ref(other)
    del other, p
    gc.collect()
    assert gone() is None
