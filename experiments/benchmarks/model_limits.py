"""This machine's limits and the model's analytic costs, for the rooflines of `model_vs_transformers`.

- Peak matmul throughput: the best of a few large square `jnp.dot` / `torch.matmul` of one dtype.
- Memory bandwidth: a large array copy (bytes read + written per second), the best of XLA and torch.
- `train_flops`: the matmul FLOPs of one forward + backward of Qwen2.5-VL (vision tower, merger, decoder,
  lm_head, attention scores), counted from the config and the input shapes; elementwise work is left out.
- `decode_bytes`: what one decode step must read: every decoder and lm_head weight once, and the KV cache
  of the positions written so far.

    python -m experiments.benchmarks.model_limits     # prints the limits of this machine
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np

from experiments.benchmarks.timing import wall_times
from histeve_jax.models.qwen2_5_vl.config import Qwen2_5_VLConfig


def _best(fn, n: int) -> float:
    return min(wall_times(fn, n))


def jax_matmul_flops(dtype, size: int = 2048, n: int = 5) -> float:
    """FLOP/s of a jitted [size, size] @ [size, size] in `dtype` (best of `n`)."""
    a = jnp.asarray(np.random.default_rng(0).standard_normal((size, size)), dtype)
    f = jax.jit(lambda x, y: x @ y)
    return 2 * size**3 / _best(lambda: f(a, a).block_until_ready(), n)


def torch_matmul_flops(dtype: str, size: int = 2048, n: int = 5) -> float:
    """FLOP/s of torch.matmul of two [size, size] `dtype` matrices (best of `n`, all cores)."""
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    a = torch.randn(size, size).to(getattr(torch, dtype))
    return 2 * size**3 / _best(lambda: torch.matmul(a, a), n)


def copy_bandwidth(mbytes: int = 256, n: int = 5) -> tuple[float, float]:
    """(XLA, torch) bytes/s of copying an `mbytes` MiB float32 array (read + write counted)."""
    import torch

    # In place (donated), as torch's copy_ into a buffer it keeps: a fresh output would time page faults.
    f = jax.jit(lambda v: v + 1.0, donate_argnums=0)  # one read and one write per element
    box = [jnp.ones((mbytes * 2**18,), jnp.float32)]

    def step():
        box[0] = f(box[0])
        box[0].block_until_ready()

    bj = 2 * box[0].nbytes / _best(step, n)
    s, d = torch.ones(mbytes * 2**18), torch.empty(mbytes * 2**18)
    bt = 2 * s.numel() * 4 / _best(lambda: d.copy_(s), n)
    return bj, bt


def matvec_times(m: int, k: int, n: int, reps: int = 200) -> tuple[float, float]:
    """(jnp.dot, torch.mm) seconds of one [m, k] @ [k, n] float32 product with small m, a decode step's
    shape (the weight, k x n, read once per call: a bandwidth-bound op). Best of 5 runs of `reps` calls,
    looped inside one program on the JAX side so dispatch is not timed."""
    import torch

    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((m, k), np.float32), rng.standard_normal((k, n), np.float32)
    xj, wj = jnp.asarray(x), jnp.asarray(w)
    w_ = wj
    # each product feeds the next (a loop-invariant one would be hoisted out of the loop)
    body = lambda i, a: a + 1e-30 * (a @ w_).sum(axis=1, keepdims=True)  # noqa: E731
    loop = jax.jit(lambda x, w: jax.lax.fori_loop(0, reps, body, x))
    tj = _best(lambda: loop(xj, wj).block_until_ready(), 5) / reps
    torch.set_num_threads(os.cpu_count() or 1)
    xt, wt = torch.from_numpy(x), torch.from_numpy(w)

    def tloop():
        for _ in range(reps):
            torch.mm(xt, wt)

    return tj, _best(tloop, 5) / reps


def _attn_flops(n_tokens_sq: float, heads: int, head_dim: int) -> float:
    """Scores and weighted values: 2 matmuls of 2 * T * S * D per head."""
    return 4 * n_tokens_sq * heads * head_dim


def forward_flops(cfg: Qwen2_5_VLConfig, batch: int, seq: int, patches: int, windows: list[int],
                  full_segments: list[int]) -> tuple[float, float]:
    """(forward matmul FLOPs, of which the patch embedding: its input needs no gradient). `patches` is the
    number of vision patches, `windows` / `full_segments` the lengths of the window / full attention segments
    of all images."""
    t, v = cfg.text, cfg.vision
    E, F, D = t.hidden_size, t.intermediate_size, t.head_dim
    H, K = t.num_attention_heads, t.num_key_value_heads
    per_tok = E * H * D * 2 + E * K * D * 2 + 3 * E * F  # q, o, k, v, gate/up/down
    text = 2 * batch * seq * (t.num_hidden_layers * per_tok + E * t.vocab_size)
    text += t.num_hidden_layers * _attn_flops(batch * seq * seq, H, D)
    ve, vf = v.hidden_size, v.intermediate_size
    per_patch = ve * 3 * ve + ve * ve + 3 * ve * vf
    vision = 2 * patches * v.depth * per_patch
    n_full = len(v.fullatt_block_indexes)
    vision += n_full * _attn_flops(sum(s * s for s in full_segments), v.num_heads, v.head_dim)
    vision += (v.depth - n_full) * _attn_flops(sum(s * s for s in windows), v.num_heads, v.head_dim)
    hid = ve * v.spatial_merge_size**2
    merged = patches // v.spatial_merge_size**2
    vision += 2 * merged * (hid * hid + hid * v.out_hidden_size)
    embed = 2 * patches * v.patch_dim * ve
    return text + vision + embed, embed


def train_flops(cfg: Qwen2_5_VLConfig, batch: int, seq: int, patches: int, windows: list[int],
                full_segments: list[int]) -> float:
    """Forward + backward matmul FLOPs: the backward is twice the forward (grads of inputs and weights), less
    the patch embedding's input gradient."""
    fwd, embed = forward_flops(cfg, batch, seq, patches, windows, full_segments)
    return 3 * fwd - embed


def decode_bytes(cfg: Qwen2_5_VLConfig, batch: int, cache_len: float, itemsize: int) -> float:
    """Bytes one decode step must read: decoder weights, final norm, lm_head (once each), the `batch` rows of
    the embedding, and the K and V cache of `cache_len` positions."""
    t = cfg.text
    E, F, D = t.hidden_size, t.intermediate_size, t.head_dim
    H, K = t.num_attention_heads, t.num_key_value_heads
    layer = E * H * D * 2 + H * D + E * K * D * 2 + 2 * K * D + 3 * E * F + 2 * E
    weights = t.num_hidden_layers * layer + E + E * t.vocab_size + batch * E
    cache = 2 * t.num_hidden_layers * batch * cache_len * K * D
    return (weights + cache) * itemsize


def main() -> None:
    print(f"cores {os.cpu_count()}; load {os.getloadavg()}")
    for dt in ("float32", "bfloat16"):
        fj, ft = jax_matmul_flops(jnp.dtype(dt)), torch_matmul_flops(dt)
        print(f"matmul 2048^3 {dt}: jnp.dot {fj / 1e9:.1f} GFLOP/s, torch.matmul {ft / 1e9:.1f} GFLOP/s")
    bj, bt = copy_bandwidth()
    print(f"copy 256 MiB: XLA {bj / 1e9:.1f} GB/s, torch {bt / 1e9:.1f} GB/s")
    for m, k, n in ((2, 512, 1536), (2, 1536, 512), (2, 512, 8192)):
        tj, tt = matvec_times(m, k, n)
        gb = k * n * 4 / 1e9
        print(f"decode matmul [{m},{k}]x[{k},{n}] f32: jnp.dot {tj * 1e6:.0f} us ({gb / tj:.1f} GB/s of "
              f"weight), torch.mm {tt * 1e6:.0f} us ({gb / tt:.1f} GB/s)")


if __name__ == "__main__":
    main()
