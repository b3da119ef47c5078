"""Flax Qwen2.5-VL vs transformers (PyTorch) on this CPU: forward, forward+backward, greedy generation.

Same config (a ~40M-parameter model with an image in the prompt), same weights, same inputs, fp32.
Compilation is excluded (warm-up runs first); times are medians; outputs are checked to agree.
torch runs with as many threads as XLA's CPU client (one per core) and, since on a shared machine
OpenMP threads can collapse under contention, also with one thread: each ratio uses torch's faster setting.

    python -m experiments.benchmarks.model_vs_transformers

Last line: forward=<ratio> train_step=<ratio> generate=<ratio>  (PyTorch time / Flax time)
"""

from __future__ import annotations

import functools
import os
import statistics
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from histeve_jax.models.qwen2_5_vl import (  # noqa: E402
    Qwen2_5_VLConfig,
    SamplingOptions,
    TextConfig,
    VisionConfig,
    generate,
    load_hf,
)
from histeve_jax.models.qwen2_5_vl.rope import as_grid  # noqa: E402

N_NEW = 32


def bench_config() -> Qwen2_5_VLConfig:
    return Qwen2_5_VLConfig(
        text=TextConfig(
            vocab_size=8192,
            hidden_size=512,
            intermediate_size=1536,
            num_hidden_layers=8,
            num_attention_heads=8,
            num_key_value_heads=2,
            mrope_section=(8, 12, 12),
            max_position_embeddings=4096,
            bos_token_id=None,
            eos_token_id=None,
        ),
        vision=VisionConfig(
            depth=4,
            hidden_size=256,
            intermediate_size=640,
            num_heads=4,
            out_hidden_size=512,
            window_size=56,
            fullatt_block_indexes=(3,),
        ),
        image_token_id=8000,
        video_token_id=8001,
        vision_start_token_id=8002,
        vision_end_token_id=8003,
    )


def median_time(fn, n: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


MATCHED: dict[str, float] = {}  # one timed torch run per phase with threads == cores


def torch_time(torch, fn, n: int, warmup: int = 2, name: str = "") -> tuple[float, int]:
    """Median time of `fn` with torch's faster thread setting (all cores, or one) and that setting."""
    probe = {}
    for th in sorted({os.cpu_count() or 1, 1}, reverse=True):
        torch.set_num_threads(th)
        fn()
        t = time.perf_counter()
        fn()
        probe[th] = time.perf_counter() - t
    MATCHED[name] = probe[max(probe)]
    best = min(probe, key=probe.get)
    torch.set_num_threads(best)
    return median_time(fn, n, warmup=max(warmup - 1, 0)), best


def main() -> None:
    import torch
    from transformers import Qwen2_5_VLConfig as HFConfig
    from transformers import Qwen2_5_VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    torch.set_num_threads(os.cpu_count() or 1)
    cfg = bench_config()
    torch.manual_seed(0)
    hf = Qwen2_5_VLForConditionalGeneration(HFConfig(**cfg.to_hf_dict())).eval()
    n_params = sum(p.numel() for p in hf.parameters())
    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(d)
        model = load_hf(d)

    # One 224x224 image (16x16 patches -> 64 image tokens) inside a 160-token prompt, batch 2.
    proc = Qwen2VLImageProcessorPil(min_pixels=28 * 28, max_pixels=28 * 28 * 256)
    rng = np.random.default_rng(0)
    ims = [rng.integers(0, 256, (224, 224, 3), dtype=np.uint8) for _ in range(2)]
    px = proc(images=ims, return_tensors="np")
    pv, grid = px["pixel_values"].astype(np.float32), px["image_grid_thw"]
    n_img = int(grid[0].prod()) // 4
    rows = [
        list(rng.integers(0, 7000, 40))
        + [cfg.vision_start_token_id]
        + [cfg.image_token_id] * n_img
        + [cfg.vision_end_token_id]
        + list(rng.integers(0, 7000, 54))
        for _ in range(2)
    ]
    ids = np.asarray(rows, np.int64)
    mm = (ids == cfg.image_token_id).astype(np.int64)
    B, T = ids.shape
    print(
        f"model: {n_params / 1e6:.1f}M params; batch {B} x {T} tokens ({n_img} image tokens per row); "
        f"threads: torch {torch.get_num_threads()}, jax devices {jax.devices()}"
    )

    t_ids, t_pv, t_grid, t_mm = map(torch.tensor, (ids, pv, grid, mm))
    j_ids, j_pv, g = jnp.asarray(ids), jnp.asarray(pv), as_grid(grid)
    hf_kw = dict(input_ids=t_ids, pixel_values=t_pv, image_grid_thw=t_grid, mm_token_type_ids=t_mm)

    # (a) forward
    @functools.partial(nnx.jit, static_argnames=("grid",))
    def fwd(m, ids, pv, grid):
        return m(ids, pixel_values=pv, image_grid_thw=grid)

    def torch_fwd():
        with torch.no_grad():
            return hf(**hf_kw).logits

    ours = np.asarray(fwd(model, j_ids, j_pv, g))
    ref = torch_fwd().numpy()
    err = np.abs(ours - ref).max() / np.abs(ref).max()
    t_fwd_j = median_time(lambda: fwd(model, j_ids, j_pv, g).block_until_ready(), 10)
    t_fwd_t, th = torch_time(torch, torch_fwd, 10, name="forward")
    print(
        f"forward: torch {t_fwd_t * 1e3:.1f} ms ({th} threads), flax {t_fwd_j * 1e3:.1f} ms "
        f"(logits rel err {err:.1e})"
    )

    # (b) loss + grads
    @functools.partial(nnx.jit, static_argnames=("grid",))
    def train_step(m, ids, pv, grid):
        def loss_fn(m):
            logits = m(ids, pixel_values=pv, image_grid_thw=grid)
            return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], ids[:, 1:]).mean()

        return nnx.value_and_grad(loss_fn)(m)

    def torch_step():
        hf.zero_grad(set_to_none=True)
        logits = hf(**hf_kw).logits
        loss = torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]), t_ids[:, 1:].reshape(-1)
        )
        loss.backward()
        return loss.detach()

    def flax_step():
        loss, grads = train_step(model, j_ids, j_pv, g)
        jax.block_until_ready(grads)
        return loss

    l_j, l_t = float(flax_step()), float(torch_step())
    t_tr_j = median_time(flax_step, 5)
    t_tr_t, th = torch_time(torch, torch_step, 5, name="train_step")
    print(
        f"train_step: torch {t_tr_t * 1e3:.1f} ms ({th} threads), flax {t_tr_j * 1e3:.1f} ms "
        f"(loss {l_t:.5f} vs {l_j:.5f})"
    )

    # (c) greedy generation of 32 tokens
    def torch_gen():
        with torch.no_grad():
            return hf.generate(
                **hf_kw, max_new_tokens=N_NEW, do_sample=False, eos_token_id=None, pad_token_id=0
            )

    def flax_gen():
        out = generate(model, j_ids, None, pixel_values=j_pv, image_grid_thw=g,
                       options=SamplingOptions(N_NEW))
        return np.asarray(out.tokens)

    same = (flax_gen() == torch_gen()[:, T:].numpy()).mean()
    t_gen_j = median_time(flax_gen, 5)
    t_gen_t, th = torch_time(torch, torch_gen, 3, warmup=1, name="generate")
    print(
        f"generate({N_NEW}): torch {t_gen_t * 1e3:.1f} ms ({th} threads), flax {t_gen_j * 1e3:.1f} ms "
        f"(tokens equal: {same:.0%})"
    )
    flax_t = {"forward": t_fwd_j, "train_step": t_tr_j, "generate": t_gen_j}
    ratios = " ".join(f"{k}={MATCHED[k] / flax_t[k]:.2f}" for k in flax_t)
    print(f"with torch at {os.cpu_count()} threads (one run each): {ratios}")
    print(
        f"forward={t_fwd_t / t_fwd_j:.2f} train_step={t_tr_t / t_tr_j:.2f} generate={t_gen_t / t_gen_j:.2f}"
    )


if __name__ == "__main__":
    main()
