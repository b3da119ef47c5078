"""Per-step latency of the policy's action sampling vs transformers' ``generate`` producing the same tokens.

The tiny random Qwen2.5-VL (the tests' shape) as a HiSTEVE policy: one observation of 1 history frame + the
current frame (112x112 each) and a short instruction, one action per step. Ours: ``policy.ActionSampler``
(jitted prefill + KV-cached ``while_loop`` decoding under the action grammar). Theirs: the same weights in
``Qwen2_5_VLForConditionalGeneration.generate`` with the same grammar as a ``LogitsProcessor``, greedy,
stopping at the action's END token. Both get the same preprocessed pixels; the script checks the tokens
are equal.

    python -m experiments.benchmarks.act_latency
"""

from __future__ import annotations

import os
import tempfile

import numpy as np

from experiments.benchmarks.timing import median_ms

os.environ.setdefault("HF_HUB_OFFLINE", "1")

STEPS = 20
FRAMES = 2
SIZE = (112, 112)


def main() -> None:
    import jax
    import jax.numpy as jnp
    import torch
    from transformers import LogitsProcessorList, Qwen2_5_VLForConditionalGeneration
    from transformers import Qwen2_5_VLConfig as HFConfig

    from histeve_jax.actions import grammar as G
    from histeve_jax.data.image_processing import VisionPreprocessConfig, process_images
    from histeve_jax.export.histeve_action import ActionGrammarProcessor
    from histeve_jax.policy import ActionSampler, Policy, decode_actions, grammar_of, tiny_config

    torch.set_num_threads(os.cpu_count() or 1)
    config = tiny_config(history_frames=FRAMES - 1, image_size=SIZE)
    base = config.base
    torch.manual_seed(0)
    hf = Qwen2_5_VLForConditionalGeneration(HFConfig(**base.to_hf_dict())).eval()
    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(d)
        policy = Policy.from_pretrained(d, config)
    # Random action rows in the output layer, so greedy decoding produces varied, non-trivial actions.
    w = np.asarray(policy.model.lm_head[...]).copy()
    w[:, config.vocab.ids] = np.random.default_rng(0).standard_normal((w.shape[0], len(config.vocab.ids)))
    policy.model.lm_head.set_value(jnp.asarray(w))
    hf.resize_token_embeddings(config.vocab_size, mean_resizing=False)
    with torch.no_grad():
        hf.get_input_embeddings().weight.copy_(torch.tensor(np.asarray(policy.model.language_model.embed[...])))
        hf.get_output_embeddings().weight.copy_(torch.tensor(w.T))

    rng = np.random.default_rng(0)
    frames = [rng.integers(0, 256, (*SIZE, 3), dtype=np.uint8) for _ in range(FRAMES)]
    h, w_ = SIZE
    vis = process_images(frames, VisionPreprocessConfig(min_pixels=h * w_, max_pixels=h * w_))
    pv, grid = vis["pixel_values"].astype(np.float32), np.asarray(vis["image_grid_thw"])
    n_tok = int(grid[0].prod()) // 4
    ids = [1, 2]
    for _ in range(FRAMES):
        ids += [base.vision_start_token_id] + [base.image_token_id] * n_tok + [base.vision_end_token_id]
    ids = np.asarray([ids + rng.integers(10, 290, 12).tolist()], np.int32)
    am = np.ones_like(ids)
    regime = np.asarray([0], np.int32)

    vocab = config.vocab
    end = vocab.id_of(vocab.slots.end)
    g = grammar_of(config)
    # the exported torch act's grammar processor, over our grammar's tables (start state = the regime)
    grammar = ActionGrammarProcessor(torch.tensor(np.asarray(g.allowed)),
                                     torch.tensor(np.asarray(g.next_state)).long(),
                                     torch.tensor(np.asarray(G.start_state(jnp.asarray(regime)))).long(),
                                     ids.shape[1])

    key = jax.random.key(0)
    sampler = ActionSampler(policy)
    ours = lambda: sampler(ids, am, pv, regime, key, greedy=True).tokens
    t_ids, t_am, t_pv = torch.tensor(ids).long(), torch.tensor(am).long(), torch.tensor(pv)
    t_grid = torch.tensor(grid).long()

    def theirs():
        with torch.no_grad():
            return hf.generate(
                input_ids=t_ids, attention_mask=t_am, pixel_values=t_pv, image_grid_thw=t_grid,
                max_new_tokens=vocab.max_len, do_sample=False, eos_token_id=end, pad_token_id=end,
                logits_processor=LogitsProcessorList([grammar]),
            )[:, ids.shape[1] :].numpy()

    a, b = ours()[0], theirs()[0]
    n = int(np.flatnonzero(a == end)[0]) + 1
    if not np.array_equal(a[:n], b[:n]) or not G.accepts(g, a[:n], int(regime[0])):
        raise SystemExit(f"tokens differ: ours {a[:n].tolist()} transformers {b.tolist()}")
    action, r = decode_actions(config, a[None])[0]
    act_ms = median_ms(lambda: jax.block_until_ready(ours()), STEPS)
    hf_ms = median_ms(theirs, STEPS)
    print(f"prompt_tokens={ids.shape[1]} frames={FRAMES}x{SIZE[0]}x{SIZE[1]} regime={r.name} steps={STEPS}")
    print(f"action={ {k: v for k, v in action.items() if k == 'camera' or v} }")
    print(f"act_ms={act_ms:.2f} hf_ms={hf_ms:.2f} ratio={hf_ms / act_ms:.2f} tokens_per_action={n}")


if __name__ == "__main__":
    main()
