"""generate(): greedy decoding equals transformers' greedy generate; sampling and constraints behave."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from conftest import qwen_images, qwen_vision_block
from flax import struct

from histeve_jax.models.qwen2_5_vl import SamplingOptions, generate

N_NEW = 10
GREEDY = SamplingOptions(N_NEW)


def _padded_prompts(cfg):
    pv, grid = qwen_images([(56, 84), (84, 112)], seed=4)
    r0 = [1, 2] + qwen_vision_block(cfg, grid[0], cfg.image_token_id) + [3]
    r1 = [4, 5, 6, 7] + qwen_vision_block(cfg, grid[1], cfg.image_token_id) + [8, 9, 10]
    T = max(len(r0), len(r1))
    ids = np.zeros((2, T), np.int64)
    mask = np.zeros((2, T), np.int64)
    for b, r in enumerate((r0, r1)):
        ids[b, T - len(r) :], mask[b, T - len(r) :] = r, 1
    return ids, mask, pv, grid


def _hf_greedy(cfg, hf, ids, mask, pv, grid, n):
    t = torch.tensor
    with torch.no_grad():
        out = hf.generate(
            input_ids=t(ids),
            attention_mask=t(mask),
            pixel_values=t(pv),
            image_grid_thw=t(grid),
            mm_token_type_ids=t((ids == cfg.image_token_id).astype(np.int64)),
            max_new_tokens=n,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[:, ids.shape[1] :].numpy()


@pytest.fixture(scope="module")
def padded(qwen_tiny_dir):
    return _padded_prompts(qwen_tiny_dir[0])


def test_greedy_generation_with_image_equals_transformers(qwen_tiny_dir, qwen_tiny_flax):
    cfg, hf, _ = qwen_tiny_dir
    pv, grid = qwen_images([(112, 168)], seed=11)
    ids = np.asarray([[11, 12] + qwen_vision_block(cfg, grid[0], cfg.image_token_id) + [13, 14]])
    mask = np.ones_like(ids)
    ref = _hf_greedy(cfg, hf, ids, mask, pv, grid, N_NEW)
    out = generate(qwen_tiny_flax, ids, mask, pixel_values=pv, image_grid_thw=grid, options=GREEDY)
    np.testing.assert_array_equal(np.asarray(out.tokens), ref)
    np.testing.assert_array_equal(np.asarray(out.lengths), [N_NEW])


def test_greedy_padded_batch_equals_transformers_left_or_right_padded(qwen_tiny_dir, qwen_tiny_flax, padded):
    cfg, hf, _ = qwen_tiny_dir
    ids, mask, pv, grid = padded
    ref = _hf_greedy(cfg, hf, ids, mask, pv, grid, N_NEW)
    out = generate(qwen_tiny_flax, ids, mask, pixel_values=pv, image_grid_thw=grid, options=GREEDY)
    np.testing.assert_array_equal(np.asarray(out.tokens), ref)
    # The same prompts right-padded give the same tokens (left-aligned inside the prefill).
    rids, rmask = np.zeros_like(ids), np.zeros_like(mask)
    for b in range(2):
        n = mask[b].sum()
        rids[b, :n], rmask[b, :n] = ids[b, -n:], 1
    out_r = generate(qwen_tiny_flax, rids, rmask, pixel_values=pv, image_grid_thw=grid, options=GREEDY)
    np.testing.assert_array_equal(np.asarray(out_r.tokens), ref)


def test_stop_token_ends_a_row_and_pads_it(qwen_tiny_flax, padded):
    ids, mask, pv, grid = padded
    kw = dict(pixel_values=pv, image_grid_thw=grid)
    greedy = np.asarray(generate(qwen_tiny_flax, ids, mask, options=GREEDY, **kw).tokens)
    stop = int(greedy[0, 2])
    opts = SamplingOptions(N_NEW, stop_token_ids=(stop,), pad_token_id=-1)
    out = generate(qwen_tiny_flax, ids, mask, options=opts, **kw)
    for b in range(2):
        hits = np.flatnonzero(greedy[b] == stop)
        n = hits[0] + 1 if hits.size else N_NEW
        assert int(out.lengths[b]) == n
        np.testing.assert_array_equal(np.asarray(out.tokens)[b, :n], greedy[b, :n])
        assert (np.asarray(out.tokens)[b, n:] == -1).all()


def test_tiny_top_p_sampling_equals_greedy(qwen_tiny_flax, padded):
    ids, mask, pv, grid = padded
    kw = dict(pixel_values=pv, image_grid_thw=grid)
    greedy = np.asarray(generate(qwen_tiny_flax, ids, mask, options=GREEDY, **kw).tokens)
    out = generate(qwen_tiny_flax, ids, mask, options=SamplingOptions(N_NEW, temperature=1.0, top_p=1e-6),
                   rng=jax.random.key(3), **kw)
    np.testing.assert_array_equal(np.asarray(out.tokens), greedy)
    # Full-temperature sampling (top_p = 1) departs from greedy on a random model.
    hot = generate(qwen_tiny_flax, ids, mask, options=SamplingOptions(N_NEW, temperature=5.0),
                   rng=jax.random.key(4), **kw)
    assert (np.asarray(hot.tokens) != greedy).any()


@struct.dataclass
class AlternatingSets:
    """Even steps may emit only `even` tokens, odd steps only `odd` ones (a two-state automaton)."""

    even: jax.Array  # [V] bool
    odd: jax.Array  # [V] bool

    def init(self, batch_size):
        return jnp.zeros((batch_size,), jnp.int32)

    def mask(self, state):
        return jnp.where((state % 2 == 0)[:, None], self.even[None], self.odd[None])

    def update(self, state, token):
        return state + 1


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_constraint_mask_is_respected(qwen_tiny_dir, qwen_tiny_flax, padded, temperature):
    cfg = qwen_tiny_dir[0]
    ids, mask, pv, grid = padded
    V = cfg.text.vocab_size
    v = np.arange(V)
    c = AlternatingSets(even=jnp.asarray(v < 50), odd=jnp.asarray((v >= 200) & (v < 210)))
    out = generate(
        qwen_tiny_flax,
        ids,
        mask,
        pixel_values=pv,
        image_grid_thw=grid,
        options=SamplingOptions(N_NEW, temperature=temperature),
        rng=jax.random.key(5),
        constraint=c,
    )
    toks = np.asarray(out.tokens)
    assert (toks[:, 0::2] < 50).all()
    assert ((toks[:, 1::2] >= 200) & (toks[:, 1::2] < 210)).all()


def test_sampler_reads_current_weights_and_refuses_a_replaced_graph(qwen_tiny_dir, padded):
    """A Sampler walks the graph once: in-place weight updates are seen, a replaced config needs refresh()."""
    from histeve_jax.models.qwen2_5_vl import Sampler, load_hf, resize_token_embeddings

    model = load_hf(qwen_tiny_dir[2])  # our own copy: it is changed below
    ids, mask, pv, grid = padded
    kw = dict(pixel_values=pv, image_grid_thw=grid, options=GREEDY)
    sampler = Sampler(model)
    before = np.asarray(sampler(ids, mask, **kw).tokens)
    np.testing.assert_array_equal(before, np.asarray(generate(model, ids, mask, **kw).tokens))
    # An in-place update (as an optimizer step or a weight sync does): the least likely token comes first.
    model.lm_head.set_value(-model.lm_head[...])
    after = np.asarray(sampler(ids, mask, **kw).tokens)
    np.testing.assert_array_equal(after, np.asarray(generate(model, ids, mask, **kw).tokens))
    assert (after != before).any()
    resize_token_embeddings(model, qwen_tiny_dir[0].text.vocab_size + 8)
    with pytest.raises(RuntimeError, match="refresh"):
        sampler(ids, mask, **kw)
    sampler.refresh()
    np.testing.assert_array_equal(
        np.asarray(sampler(ids, mask, **kw).tokens), np.asarray(generate(model, ids, mask, **kw).tokens)
    )


def test_scanned_and_unrolled_decoders_generate_the_same(qwen_tiny_dir, padded):
    """The scanned decoder (stacked cache in the scan's carry), the unrolled one over stacks split per call,
    and the Sampler's kept per-layer copies give the same tokens and log-probs."""
    from histeve_jax.models.qwen2_5_vl import Sampler, load_hf

    ids, mask, pv, grid = padded
    kw = dict(pixel_values=pv, image_grid_thw=grid, options=GREEDY)
    scan = Sampler(load_hf(qwen_tiny_dir[2], config_overrides={"scan_layers": True, "layer_loop": "scan"}))
    unrolled = load_hf(qwen_tiny_dir[2], config_overrides={"scan_layers": True, "layer_loop": "unroll"})
    outs = [s(ids, mask, **kw) for s in (scan, Sampler(unrolled, unstack_layers=False), Sampler(unrolled))]
    assert scan._unstacked is None and outs[0].tokens.shape == (2, N_NEW)
    for out in outs[1:]:
        np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(outs[0].tokens))
        np.testing.assert_allclose(np.asarray(out.logprobs), np.asarray(outs[0].logprobs), atol=1e-5)
    # A layer weight replaced in place (a weight sync): the kept copies are remade and the tokens follow it.
    sampler = Sampler(unrolled)
    sampler(ids, mask, **kw)
    down = unrolled.language_model.layers.mlp.down
    down.set_value(-down[...])
    fresh = Sampler(unrolled, unstack_layers=False)(ids, mask, **kw)
    np.testing.assert_array_equal(np.asarray(sampler(ids, mask, **kw).tokens), np.asarray(fresh.tokens))
    assert (np.asarray(fresh.tokens) != np.asarray(outs[0].tokens)).any()


def _nucleus(logits: np.ndarray, temperature: float, top_p: float) -> np.ndarray:
    """softmax(logits / T) over the smallest set of most likely tokens whose mass reaches top_p (the most
    likely token always kept), renormalised: float64, per row."""
    z = logits.astype(np.float64) / temperature
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    out = np.zeros_like(p)
    for b, row in enumerate(p):
        order = np.argsort(-row, kind="stable")
        before = np.cumsum(row[order]) - row[order]
        keep = order[(before < top_p) | (np.arange(len(order)) == 0)]
        out[b, keep] = row[keep] / row[keep].sum()
    return out


# Row 0 has a disallowed token (-inf); its nucleus boundary at top_p = 0.8 falls inside a token's mass.
SAMPLE_LOGITS = np.asarray([[2.0, 1.5, -np.inf, 1.0, 0.4, 0.0, -0.5, 1.2, -1.0, 0.3],
                            [0.1, -0.3, 0.5, 0.0, 0.9, -2.0, 0.2, 0.4, -0.1, 0.6]], np.float32)


def test_sampled_frequencies_are_the_renormalised_nucleus_of_the_tempered_softmax():
    """20k draws per row and setting: counts within 5 binomial std of N * q, none outside the nucleus, and
    each token's log-probability is log q (q = softmax(logits / T) renormalised over the top-p nucleus)."""
    from histeve_jax.models.qwen2_5_vl.generate import sample_token

    n = 20_000
    logits = jnp.asarray(SAMPLE_LOGITS)
    # One program for every setting: temperature and top_p are traced.
    draw = jax.jit(jax.vmap(lambda k, t, p: sample_token(logits, k, t, p, False), in_axes=(0, None, None)))
    keys = jax.random.split(jax.random.key(0), n)
    for temperature, top_p in [(0.7, 0.8), (1.6, 1.0), (1.0, 0.45)]:
        want = _nucleus(SAMPLE_LOGITS, temperature, top_p)
        if top_p < 1:  # the nucleus really cuts tokens off
            assert ((want > 0).sum(-1) < np.isfinite(SAMPLE_LOGITS).sum(-1)).all()
        tokens, logp = (np.asarray(x) for x in draw(keys, temperature, top_p))  # [n, 2]
        for b in range(SAMPLE_LOGITS.shape[0]):
            counts = np.bincount(tokens[:, b], minlength=SAMPLE_LOGITS.shape[1])
            q = want[b]
            where = (temperature, top_p, b)
            assert (counts[q == 0] == 0).all(), (where, counts, q)
            std = np.sqrt(n * q * (1 - q))
            assert (np.abs(counts - n * q) <= 5 * std).all(), (where, counts, np.round(n * q))
            np.testing.assert_allclose(logp[:, b], np.log(q[tokens[:, b]]), rtol=1e-5, atol=1e-6,
                                       err_msg=str(where))
