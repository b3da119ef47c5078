"""``ActionSampler``: KV-cached constrained decoding gives well-formed actions of the requested regime."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import qwen_images, qwen_vision_block
from flax import nnx

from histeve_jax.actions import ENV_KEYS, Regime
from histeve_jax.actions import grammar as G
from histeve_jax.policy import ActionSampler, Policy, decode_actions, grammar_of, tiny_config


def make_prompts(config, regimes, seed: int = 0):
    """Left-padded prompts: F frames then an instruction of varying length (as the sampler expects)."""
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
    """Shared by the tests of this module, so none of them changes its weights."""
    return Policy(tiny_config(history_frames=1), rngs=nnx.Rngs(0))


def with_random_action_rows(policy, seed: int):
    """Varied greedy actions: random action rows in the lm_head (in place)."""
    w = np.asarray(policy.model.lm_head[...]).copy()
    ids = policy.config.vocab.ids
    w[:, ids] = np.random.default_rng(seed).standard_normal((w.shape[0], len(ids))) * 0.5
    policy.model.lm_head.set_value(jnp.asarray(w))
    return policy


def test_1000_sampled_actions_are_valid_in_the_requested_regime(policy):
    regimes = np.arange(250) % 2
    ids, am, pv = make_prompts(policy.config, regimes)
    # 4 x 250 rows (one compiled shape), 1000 actions in all.
    sampler = ActionSampler(policy)
    samples = [sampler(ids, am, pv, regimes, jax.random.key(k), temperature=1.0) for k in range(4)]
    tokens = np.concatenate([s.tokens for s in samples])
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


def test_greedy_act_equals_uncached_decoding():
    """The KV cache and the decode positions (left padding, M-RoPE) give the full forward's argmax."""
    policy = with_random_action_rows(Policy(tiny_config(history_frames=1), rngs=nnx.Rngs(0)), seed=0)
    regimes = np.array([0, 1, 1, 0])
    ids, am, pv = make_prompts(policy.config, regimes, seed=5)
    model = policy.model
    sampler = ActionSampler(policy)
    tokens = sampler(ids, am, pv, regimes, jax.random.key(0), greedy=True).tokens
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
    right = sampler(right_ids, right_am, pv, regimes, jax.random.key(0), greedy=True).tokens
    np.testing.assert_array_equal(right, tokens)


def test_observation_prompt_is_the_pipelines_training_prompt_and_acts(policy):
    """act's prompt for (frames, instruction) is the prefix of the training sample the pipeline builds."""
    from histeve_jax.data import records
    from histeve_jax.data.pipeline import CompactVocab, FeatureSpec, Featurize
    from histeve_jax.models.qwen2_5_vl import qwen2_5_vl_7b
    from histeve_jax.policy import PolicyConfig, observation_inputs, policy_processor

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
    # Qwen's own table: the action ids come right after the tokenizer's.
    PolicyConfig(base=qwen2_5_vl_7b(), codebook=config.codebook).check_tokenizer(tok)
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
    out = ActionSampler(policy).sample(processor, observations, [{"is_gui_open": False}, {"isGuiOpen": True}],
                                       jax.random.key(1), id_map=table)
    assert [o.regime for o in out] == [Regime.NG, Regime.GUI]
    assert all(set(o.action) == set(ENV_KEYS) and o.action["camera"].shape == (2,) for o in out)
    # Each row's tokens end with END and decode to its action; log-probs are of the sampled tokens.
    end = config.vocab.id_of(config.vocab.slots.end)
    for o in out:
        assert o.tokens[-1] == end and len(o.logprobs) == len(o.tokens)
        assert all(lp <= 0.0 for lp in o.logprobs)
        assert decode_actions(config, np.asarray([o.tokens]))[0][1] == o.regime


def test_sampler_follows_a_weight_sync():
    """A kept ActionSampler reads current weights: nnx.update (an RL weight sync) changes what it samples,
    exactly to the other policy's actions."""
    config = tiny_config(history_frames=1)
    regimes = np.array([0, 1])
    ids, am, pv = make_prompts(config, regimes, seed=7)
    mine = with_random_action_rows(Policy(config, rngs=nnx.Rngs(1)), seed=1)
    other = with_random_action_rows(Policy(config, rngs=nnx.Rngs(2)), seed=2)
    sampler = ActionSampler(mine)
    run = lambda s: s(ids, am, pv, regimes, jax.random.key(0), greedy=True).tokens
    want_other = run(ActionSampler(other))
    before = run(sampler)
    nnx.update(mine, nnx.state(other))
    np.testing.assert_array_equal(run(sampler), want_other)
    assert not np.array_equal(before, want_other)


def test_sampled_logprobs_are_the_masked_softmax_of_the_full_forward():
    """Greedy log-probs equal log_softmax of the grammar-masked logits of an uncached forward at each step."""
    policy = with_random_action_rows(Policy(tiny_config(), rngs=nnx.Rngs(4)), seed=4)
    regimes = np.array([1, 0])
    ids, am, pv = make_prompts(policy.config, regimes, seed=9)
    out = ActionSampler(policy)(ids, am, pv, regimes, jax.random.key(0), greedy=True)
    g = grammar_of(policy.config)
    grid = policy.config.image_grid(len(regimes) * policy.config.num_frames)
    B, T = ids.shape
    M = out.tokens.shape[1]
    seq = np.concatenate([ids, out.tokens], 1)
    mask = np.concatenate([am, np.ones((B, M), np.int32)], 1)
    logits = policy.model(jnp.asarray(seq), attention_mask=jnp.asarray(mask), pixel_values=jnp.asarray(pv),
                          image_grid_thw=grid, regime=jnp.asarray(regimes))
    state = G.start_state(jnp.asarray(regimes))
    end = policy.config.vocab.id_of(policy.config.vocab.slots.end)
    for i in range(M):
        done = np.asarray(G.is_done(state))
        lp = jax.nn.log_softmax(G.mask_logits(g, state, logits[:, T + i - 1].astype(jnp.float32)), -1)
        want = np.take_along_axis(np.asarray(lp), out.tokens[:, i : i + 1], 1)[:, 0]
        np.testing.assert_allclose(out.logprobs[~done, i], want[~done], rtol=1e-4, atol=1e-5)
        assert (out.logprobs[done, i] == 0).all() and (out.tokens[done, i] == end).all()
        state = G.advance(g, state, jnp.asarray(out.tokens[:, i]))


def test_nucleus_sampling_draws_only_from_the_nucleus_with_its_renormalised_logprobs():
    """top_p: every sampled token lies in the nucleus of the grammar-masked distribution of an uncached
    forward (the most likely tokens whose mass reaches top_p), its log-prob is under the renormalised nucleus,
    and a vanishing top_p is greedy."""
    policy = with_random_action_rows(Policy(tiny_config(), rngs=nnx.Rngs(6)), seed=6)
    regimes = np.array([0, 1, 0, 1, 0, 0])
    ids, am, pv = make_prompts(policy.config, regimes, seed=3)
    sampler = ActionSampler(policy)
    greedy = sampler(ids, am, pv, regimes, jax.random.key(0), greedy=True).tokens
    for k in range(3):
        tiny = sampler(ids, am, pv, regimes, jax.random.key(k), temperature=1.0, top_p=1e-6).tokens
        np.testing.assert_array_equal(tiny, greedy)
    g = grammar_of(policy.config)
    grid = policy.config.image_grid(len(regimes) * policy.config.num_frames)
    end = policy.config.vocab.id_of(policy.config.vocab.slots.end)
    B, T = ids.shape
    top_p, outside_full = 0.6, 0
    for k in range(4):
        out = sampler(ids, am, pv, regimes, jax.random.key(10 + k), temperature=1.0, top_p=top_p)
        M = out.tokens.shape[1]
        seq = np.concatenate([ids, out.tokens], 1)
        mask = np.concatenate([am, np.ones((B, M), np.int32)], 1)
        logits = policy.model(jnp.asarray(seq), attention_mask=jnp.asarray(mask),
                              pixel_values=jnp.asarray(pv), image_grid_thw=grid, regime=jnp.asarray(regimes))
        state = G.start_state(jnp.asarray(regimes))
        for i in range(M):
            done = np.asarray(G.is_done(state))
            step_logits = logits[:, T + i - 1].astype(jnp.float32)
            probs = np.asarray(jax.nn.softmax(G.mask_logits(g, state, step_logits)))
            for b in np.flatnonzero(~done):
                order = np.argsort(-probs[b])
                before = np.cumsum(probs[b][order]) - probs[b][order]
                nucleus = order[(before < top_p) | (np.arange(len(order)) == 0)]
                tok = int(out.tokens[b, i])
                assert tok in nucleus, (k, i, b)
                want = np.log(probs[b, tok] / probs[b, nucleus].sum())
                np.testing.assert_allclose(out.logprobs[b, i], want, rtol=1e-4, atol=1e-5)
                outside_full += int(len(nucleus) < int((probs[b] > 0).sum()))
            assert (out.tokens[done, i] == end).all()
            state = G.advance(g, state, jnp.asarray(out.tokens[:, i]))
    assert outside_full > 0  # the nucleus did cut allowed tokens somewhere: the check above had teeth


def test_greedy_act_equals_transformers_generate_under_the_grammar(qwen_tiny_dir):
    """ActionSampler (KV cache, M-RoPE decode positions, left padding, RS-Norm rows, grammar mask) against
    transformers' own generate with the same automaton as a LogitsProcessor, on a batch of left-padded
    prompts of 2 frames each in both regimes; each regime's rows go to an HF model whose norms are that
    RS-Norm row (the GUI row is perturbed, so a row read for the wrong regime shows). Tokens are equal and
    so are their log-probs."""
    import copy

    import torch
    from transformers import LogitsProcessorList

    from histeve_jax.export.histeve_action import ActionGrammarProcessor

    _, hf, d = qwen_tiny_dir
    config = tiny_config(history_frames=1)
    policy = with_random_action_rows(Policy.from_pretrained(d, config), seed=3)
    layers = policy.model.language_model.layers
    for norm in (layers.input_norm, layers.post_attn_norm):  # [L, 2, d]: a GUI row of its own
        s = np.asarray(norm.scale[...]).copy()
        s[:, 1] *= 1 + 0.3 * np.random.default_rng(1).standard_normal(s[:, 1].shape)
        norm.scale.set_value(jnp.asarray(s))
    regimes = np.array([0, 1, 1, 0, 1])
    ids, am, pv = make_prompts(config, regimes, seed=11)
    ours = ActionSampler(policy)(ids, am, pv, regimes, jax.random.key(0), greedy=True)
    tokens = ours.tokens

    # The exported torch act's processor (histeve_action.py), over our grammar's tables: it replays each
    # row's automaton from its regime's start state over the tokens generated so far.
    g = grammar_of(config)
    allowed, nxt = torch.tensor(np.asarray(g.allowed)), torch.tensor(np.asarray(g.next_state)).long()
    start = np.asarray(G.start_state(jnp.asarray([0, 1])))
    end = config.vocab.id_of(config.vocab.slots.end)

    def grammar(prompt_len: int, regime: int, rows: int) -> ActionGrammarProcessor:
        return ActionGrammarProcessor(allowed, nxt, torch.full((rows,), int(start[regime])), prompt_len)

    P, F = config.patches_per_image, config.num_frames
    grid = np.asarray(config.image_grid(len(regimes) * F))
    base = config.base
    embed, head = np.asarray(policy.model.language_model.embed[...]), np.asarray(policy.model.lm_head[...])
    in_s, post_s = np.asarray(layers.input_norm.scale[...]), np.asarray(layers.post_attn_norm.scale[...])
    for r in (0, 1):
        ref = copy.deepcopy(hf)
        ref.resize_token_embeddings(config.vocab_size, mean_resizing=False)
        with torch.no_grad():
            ref.get_input_embeddings().weight.copy_(torch.tensor(embed))
            ref.get_output_embeddings().weight.copy_(torch.tensor(head.T))
            for i, layer in enumerate(ref.model.language_model.layers):
                layer.input_layernorm.weight.copy_(torch.tensor(in_s[i, r]))
                layer.post_attention_layernorm.weight.copy_(torch.tensor(post_s[i, r]))
        rows = np.flatnonzero(regimes == r)
        images = np.concatenate([np.arange(b * F, (b + 1) * F) for b in rows])
        pix = pv.reshape(-1, P, pv.shape[-1])[images].reshape(-1, pv.shape[-1])
        t = torch.tensor
        with torch.no_grad():
            out = ref.generate(
                input_ids=t(ids[rows]).long(), attention_mask=t(am[rows]).long(), pixel_values=t(pix),
                image_grid_thw=t(grid[images]).long(),
                mm_token_type_ids=t((ids[rows] == base.image_token_id).astype(np.int64)),
                max_new_tokens=config.vocab.max_len, do_sample=False, eos_token_id=end, pad_token_id=end,
                logits_processor=LogitsProcessorList([grammar(ids.shape[1], r, len(rows))]),
                output_scores=True, return_dict_in_generate=True,
            )
        got = out.sequences[:, ids.shape[1] :].numpy()
        want = np.full((len(rows), tokens.shape[1]), end)
        want[:, : got.shape[1]] = got  # transformers stops when every row has ended
        np.testing.assert_array_equal(tokens[rows], want, err_msg=f"regime {r}")
        # Log-probs: log_softmax of transformers' grammar-masked scores at each row's tokens up to its END
        # (the argmax alone would not show a small error in the decode positions or the cache).
        logp = torch.log_softmax(torch.stack(out.scores, 1).float(), -1).numpy()
        hf_lp = np.take_along_axis(logp, got[..., None], -1)[..., 0]
        for i, b in enumerate(rows):
            n = int(np.flatnonzero(tokens[b] == end)[0]) + 1
            np.testing.assert_allclose(ours.logprobs[b, :n], hf_lp[i, :n], rtol=1e-4, atol=1e-5,
                                       err_msg=f"row {b}")
    assert [int(r) for _, r in decode_actions(config, tokens)] == regimes.tolist()
    assert len({tuple(row) for row in tokens.tolist()}) >= 3  # varied actions, not one repeated
