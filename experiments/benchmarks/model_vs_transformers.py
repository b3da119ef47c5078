"""Flax Qwen2.5-VL vs transformers (PyTorch) on this CPU: forward, forward+backward, greedy generation, each
next to this machine's limit.

Same config (a ~37M-parameter model with an image in the prompt), same weights, same inputs; float32 rows,
then a bfloat16 row. Compilation is excluded (warm-up runs first). Each round runs every contender once, in
turn (ours, torch with one thread, torch with one thread per core), so load on a shared machine falls on all
of them alike; times are medians over the rounds, with the spread (min-max) printed, and torch's figure is its
faster thread setting. Outputs are checked to agree.

Limits (`model_limits`): the train step's analytic matmul FLOPs over the machine's peak matmul throughput (a
large `jnp.dot` / `torch.matmul` of the same dtype, the better), and a decode step's bytes (weights + KV
cache) over the machine's copy bandwidth. A decode step's time is (generate(N) - generate(1)) / (N - 1).

    python -m experiments.benchmarks.model_vs_transformers [--rounds 5] [--no-bf16] [--stacked]

Our model is loaded as a user loads it (`load_hf`): on this CPU, with separate per-layer decoder parameters
(`default_scan_layers`); `--stacked` loads the stacked layout the TPU program scans and the policy's
checkpoints use (on CPU its layers run unrolled over stacks split per call, gradients concatenated back).

Last line: forward=<a> train_step=<b> generate=<c> train_roofline=<d> decode_roofline=<e>, the first three
PyTorch time / Flax time, the rooflines time-the-limit-allows / Flax time (float32).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from experiments.benchmarks import model_limits as limits  # noqa: E402
from histeve_jax.models.qwen2_5_vl import (  # noqa: E402
    Qwen2_5_VLConfig,
    Sampler,
    SamplingOptions,
    TextConfig,
    VisionConfig,
    load_hf,
)
from histeve_jax.models.qwen2_5_vl.rope import as_grid, vision_frame_cu_seqlens, vision_window_index  # noqa: E402

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


@dataclasses.dataclass
class Setup:
    """Both models with the same weights and the benchmark's inputs (one 224x224 image, 64 image tokens,
    inside a 160-token prompt, batch 2), and each side's jitted / eager callables."""

    cfg: Qwen2_5_VLConfig
    hf: Any
    model: Any
    ids: np.ndarray
    pv: np.ndarray
    grid: np.ndarray
    dtype: str

    @classmethod
    def build(cls, dtype: str = "float32", scan_layers: bool | None = None) -> Setup:
        import torch
        from transformers import Qwen2_5_VLConfig as HFConfig
        from transformers import Qwen2_5_VLForConditionalGeneration
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        cfg = bench_config()
        torch.manual_seed(0)
        hf = Qwen2_5_VLForConditionalGeneration(HFConfig(**cfg.to_hf_dict())).eval()
        with tempfile.TemporaryDirectory() as d:
            hf.save_pretrained(d)
            layout = {} if scan_layers is None else {"scan_layers": scan_layers}  # None: load_hf's default
            model = load_hf(d, dtype=jnp.dtype(dtype), config_overrides=layout)
        hf = hf.to(getattr(torch, dtype))
        proc = Qwen2VLImageProcessorPil(min_pixels=28 * 28, max_pixels=28 * 28 * 256)
        rng = np.random.default_rng(0)
        ims = [rng.integers(0, 256, (224, 224, 3), dtype=np.uint8) for _ in range(2)]
        px = proc(images=ims, return_tensors="np")
        pv, grid = px["pixel_values"].astype(np.float32), px["image_grid_thw"]
        n_img = int(grid[0].prod()) // 4
        rows = [
            list(rng.integers(0, 7000, 40)) + [cfg.vision_start_token_id] + [cfg.image_token_id] * n_img
            + [cfg.vision_end_token_id] + list(rng.integers(0, 7000, 54))
            for _ in range(2)
        ]
        return cls(cfg, hf, model, np.asarray(rows, np.int64), pv, grid, dtype)

    # ------------------------------------------------------------------ shapes for the limits

    def train_flops(self) -> float:
        g = as_grid(self.grid)
        v = self.cfg.vision
        _, cu = vision_window_index(g, v.spatial_merge_size, v.window_size, v.patch_size)
        B, T = self.ids.shape
        return limits.train_flops(self.cfg, B, T, self.pv.shape[0], np.diff(cu).tolist(),
                                  np.diff(vision_frame_cu_seqlens(g)).tolist())

    def decode_bytes(self) -> float:
        """Mean bytes per decode step over the N_NEW steps (the cache grows by one position a step)."""
        B, T = self.ids.shape
        return limits.decode_bytes(self.cfg, B, T + N_NEW / 2, jnp.dtype(self.dtype).itemsize)

    # ------------------------------------------------------------------ ours

    def jax_forward(self) -> Callable:
        g, ids, pv = as_grid(self.grid), jnp.asarray(self.ids), jnp.asarray(self.pv, self.dtype)
        fwd = nnx.jit(lambda m, ids, pv: m(ids, pixel_values=pv, image_grid_thw=g))
        return lambda: fwd(self.model, ids, pv).block_until_ready()

    def jax_train_step(self) -> Callable:
        g, ids, pv = as_grid(self.grid), jnp.asarray(self.ids), jnp.asarray(self.pv, self.dtype)

        @nnx.jit
        def step(m, ids, pv):
            def loss_fn(m):
                logits = m(ids, pixel_values=pv, image_grid_thw=g).astype(jnp.float32)
                return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], ids[:, 1:]).mean()

            return nnx.value_and_grad(loss_fn)(m)

        def run():
            loss, grads = step(self.model, ids, pv)
            jax.block_until_ready(grads)
            return loss

        return run

    def jax_generate(self, n: int) -> Callable:
        sampler = Sampler(self.model)
        g, ids, pv = as_grid(self.grid), jnp.asarray(self.ids), jnp.asarray(self.pv, self.dtype)
        opts = SamplingOptions(n)
        return lambda: np.asarray(sampler(ids, None, pixel_values=pv, image_grid_thw=g, options=opts).tokens)

    # ------------------------------------------------------------------ transformers

    def _hf_kw(self) -> dict:
        import torch

        return dict(input_ids=torch.tensor(self.ids), pixel_values=torch.tensor(self.pv).to(self.hf.dtype),
                    image_grid_thw=torch.tensor(self.grid),
                    mm_token_type_ids=torch.tensor((self.ids == self.cfg.image_token_id).astype(np.int64)))

    def torch_forward(self) -> Callable:
        import torch

        kw = self._hf_kw()

        def run():
            with torch.no_grad():
                return self.hf(**kw).logits

        return run

    def torch_train_step(self) -> Callable:
        import torch

        kw = self._hf_kw()
        labels = kw["input_ids"][:, 1:].reshape(-1)

        def run():
            self.hf.zero_grad(set_to_none=True)
            logits = self.hf(**kw).logits.float()
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels)
            loss.backward()
            return loss.detach()

        return run

    def torch_generate(self, n: int) -> Callable:
        import torch

        kw = self._hf_kw()

        def run():
            with torch.no_grad():
                out = self.hf.generate(**kw, max_new_tokens=n, do_sample=False, eos_token_id=None,
                                       pad_token_id=0)
            return out[:, self.ids.shape[1]:].numpy()

        return run


def with_threads(fn: Callable, n: int) -> Callable:
    """`fn` run with torch at `n` threads."""
    import torch

    def run():
        torch.set_num_threads(n)
        return fn()

    return run


def interleaved(fns: dict[str, Callable], rounds: int, warmup: int = 1) -> dict[str, list[float]]:
    """Wall times of each callable over `rounds` rounds, every callable once per round, in turn."""
    for f in fns.values():
        for _ in range(warmup):
            f()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(rounds):
        for k, f in fns.items():
            t = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t)
    return times


def med(ts: list[float]) -> float:
    return statistics.median(ts)


def spread(ts: list[float]) -> str:
    return f"{med(ts) * 1e3:.1f} ms [{min(ts) * 1e3:.0f}-{max(ts) * 1e3:.0f}]"


def load() -> str:
    return "load " + "/".join(f"{x:.1f}" for x in os.getloadavg())


@functools.lru_cache(maxsize=2)
def machine_limits(dtype: str) -> tuple[float, float]:
    """(peak matmul FLOP/s of `dtype`: the better of jnp.dot and torch.matmul, copy bandwidth bytes/s)."""
    # 1024^3 in bf16: on a CPU without AVX-512 BF16 / AMX, torch's bf16 matmul is a slow reference gemm.
    size = 2048 if dtype == "float32" else 1024
    fj, ft = limits.jax_matmul_flops(jnp.dtype(dtype), size), limits.torch_matmul_flops(dtype, size)
    bj, bt = limits.copy_bandwidth()
    print(f"limits ({dtype}, {load()}): matmul {size}^3 jnp.dot {fj / 1e9:.1f} GFLOP/s, torch.matmul "
          f"{ft / 1e9:.1f} GFLOP/s; copy 256 MiB: XLA {bj / 1e9:.1f} GB/s, torch {bt / 1e9:.1f} GB/s")
    return max(fj, ft), max(bj, bt)


def compare(s: Setup, rounds: int) -> dict[str, float]:
    """One dtype's comparison: prints a line per phase, returns the ratios and rooflines."""
    cores = os.cpu_count() or 1
    threads = sorted({1, cores})
    phases = {
        "forward": (s.jax_forward(), s.torch_forward()),
        "train_step": (s.jax_train_step(), s.torch_train_step()),
        "generate": (s.jax_generate(N_NEW), s.torch_generate(N_NEW)),
        "generate1": (s.jax_generate(1), s.torch_generate(1)),
    }
    # Agreement first: logits, loss, greedy tokens.
    lj = np.asarray(phases["forward"][0](), np.float32)
    lt = phases["forward"][1]().float().numpy()
    err = np.abs(lj - lt).max() / np.abs(lt).max()
    same = (phases["generate"][0]() == phases["generate"][1]()).mean()
    l_j, l_t = float(phases["train_step"][0]()), float(phases["train_step"][1]())
    print(f"[{s.dtype}] logits rel err {err:.1e}; loss torch {l_t:.5f} flax {l_j:.5f}; greedy tokens equal "
          f"{same:.0%} ({load()})")
    out: dict[str, dict[str, list[float]]] = {}
    for name, (jf, tf) in phases.items():
        fns = {"flax": jf} | {f"torch{t}": with_threads(tf, t) for t in threads}
        out[name] = interleaved(fns, rounds)
    peak, bw = machine_limits(s.dtype)
    res = {}
    for name in ("forward", "train_step", "generate"):
        t = out[name]
        best = min((k for k in t if k.startswith("torch")), key=lambda k: med(t[k]))
        res[name] = med(t[best]) / med(t["flax"])
        print(f"[{s.dtype}] {name}: torch {spread(t[best])} ({best[5:]} thread), flax {spread(t['flax'])}; "
              f"torch/flax {res[name]:.2f}  ({load()})")
    t_train = {k: med(v) for k, v in out["train_step"].items()}
    t_step = {k: (med(out["generate"][k]) - med(out["generate1"][k])) / (N_NEW - 1) for k in out["generate"]}
    flops, nbytes = s.train_flops(), s.decode_bytes()
    floor_train, floor_step = flops / peak, nbytes / bw
    res["train_roofline"] = floor_train / t_train["flax"]
    res["decode_roofline"] = floor_step / t_step["flax"]
    tt = min(v for k, v in t_train.items() if k != "flax")
    ts = min(v for k, v in t_step.items() if k != "flax")
    print(f"[{s.dtype}] train step: {flops / 1e9:.1f} GFLOP (matmuls) at {peak / 1e9:.1f} GFLOP/s = "
          f"{floor_train * 1e3:.1f} ms; fraction of it: flax {res['train_roofline']:.2f}, torch "
          f"{floor_train / tt:.2f}")
    print(f"[{s.dtype}] decode step: {nbytes / 1e6:.1f} MB (weights + KV cache) at {bw / 1e9:.1f} GB/s = "
          f"{floor_step * 1e3:.2f} ms; measured flax {t_step['flax'] * 1e3:.2f} ms, torch {ts * 1e3:.2f} ms; "
          f"fraction: flax {res['decode_roofline']:.2f}, torch {floor_step / ts:.2f}")
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--no-bf16", action="store_true")
    # The stacked layout (TPU's, the checkpoints') instead of load_hf's CPU default of per-layer parameters.
    ap.add_argument("--stacked", action="store_true")
    a = ap.parse_args()
    layout = True if a.stacked else None
    s = Setup.build("float32", scan_layers=layout)
    n_params = sum(p.numel() for p in s.hf.parameters())
    print(f"model: {n_params / 1e6:.1f}M params, {'stacked' if s.model.config.scan_layers else 'per-layer'} "
          f"decoder layers; batch {s.ids.shape[0]} x {s.ids.shape[1]} tokens; cores {os.cpu_count()}; "
          f"jax {jax.__version__} {jax.devices()}; {load()}")
    res = compare(s, a.rounds)
    if not a.no_bf16:
        rb = compare(Setup.build("bfloat16", scan_layers=layout), a.rounds)
        print("bf16: " + " ".join(f"{k}={v:.2f}" for k, v in rb.items()))
    print(" ".join(f"{k}={v:.2f}" for k, v in res.items()))


if __name__ == "__main__":
    main()
