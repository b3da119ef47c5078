"""Op-by-op profiles of one jitted JAX function (XLA:CPU thunks, from the JAX profiler's trace joined with the
compiled HLO) and of one PyTorch callable (torch.profiler), as tables of where the time goes.

    python -m experiments.benchmarks.op_profile [--stacked]   # the benchmark model's train and decode step

A JAX row is one HLO instruction the executable runs (a fusion, a library dot, a copy): its total time over
the profiled calls, its kind and what it computes (the fusion's root ops and shapes), so layout transposes,
dynamic-slice copies and upcasts show by name.
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import re
import tempfile
from collections.abc import Callable
from typing import Any

import jax

_INSTR = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (\S+) (\w[\w\-]*)\((.*)$")


def _hlo_rows(hlo: str) -> dict[str, str]:
    """Each instruction name in the compiled HLO -> a short description (its shape, opcode and, for a fusion,
    the opcodes inside it)."""
    comps: dict[str, list[str]] = {}
    cur = None
    for line in hlo.splitlines():
        if line and not line.startswith(" ") and "{" in line:
            cur = line.split(" ")[0].lstrip("%")
            comps[cur] = []
        elif cur is not None and (m := _INSTR.match(line)):
            comps[cur].append(m.group(3))
    out = {}
    for line in hlo.splitlines():
        m = _INSTR.match(line)
        if not m:
            continue
        name, shape, op, rest = m.groups()
        desc = f"{op} {shape}"
        if call := re.search(r"calls=%?([\w.\-]+)", rest):
            inner = [o for o in comps.get(call.group(1), []) if o not in ("parameter", "constant", "bitcast")]
            desc += " [" + ",".join(dict.fromkeys(inner)) + "]"
        if kind := re.search(r'"kind":"(\w+)"', rest):
            desc += f" {kind.group(1)}"
        if src := re.search(r'op_name="([^"]+)"', rest):
            desc += "  <- " + src.group(1)[-60:]
        out[name] = desc
    return out


def jax_op_profile(fn: Any, *args: Any, n: int = 3) -> list[tuple[float, int, str, str]]:
    """(total ms per call, count per call, instruction, description) of the jitted `fn(*args)`'s thunks,
    slowest first. `fn` must be a `jax.jit`-wrapped function; it runs once before the trace."""
    hlo = fn.lower(*args).compile().as_text()
    desc = _hlo_rows(hlo)
    jax.block_until_ready(fn(*args))
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d, create_perfetto_trace=True):
            for _ in range(n):
                jax.block_until_ready(fn(*args))
        (path,) = glob.glob(f"{d}/**/*.trace.json.gz", recursive=True)
        events = json.load(gzip.open(path))["traceEvents"]
    tot: dict[str, float] = collections.defaultdict(float)
    cnt: dict[str, int] = collections.defaultdict(int)
    for e in events:
        if e.get("ph") == "X" and e["name"] in desc:
            tot[e["name"]] += e["dur"] / 1e3
            cnt[e["name"]] += 1
    rows = [(tot[k] / n, cnt[k] // n, k, desc[k]) for k in tot]
    return sorted(rows, reverse=True)


def torch_op_profile(fn: Callable, n: int = 3, row_limit: int = 25) -> str:
    """torch.profiler's table of `fn`'s ops (self CPU time, `n` calls after one warm-up)."""
    import torch

    fn()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(n):
            fn()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=row_limit)


def by_kind(rows: list[tuple[float, int, str, str]]) -> list[tuple[float, str]]:
    """Total ms per call by the instruction's opcode and fused ops (copies, dots, transposes, ...)."""
    agg: dict[str, float] = collections.defaultdict(float)
    for ms, _, _, d in rows:
        agg[re.sub(r"\s*<-.*$", "", re.sub(r"\S+\[[\d,]*\]\{[\d,]*\}|\S+\[[\d,]*\]", "", d)).strip()] += ms
    return sorted(((v, k) for k, v in agg.items()), reverse=True)


def print_jax(title: str, rows: list[tuple[float, int, str, str]], top: int = 25) -> None:
    total = sum(r[0] for r in rows)
    print(f"\n== {title}: {total:.1f} ms per call in {len(rows)} instructions")
    for ms, c, name, d in rows[:top]:
        print(f"{ms:8.2f} ms {100 * ms / total:5.1f}% x{c:<3d} {name:32s} {d[:150]}")
    print("-- by kind")
    for ms, k in by_kind(rows)[:12]:
        print(f"{ms:8.2f} ms {100 * ms / total:5.1f}% {k[:120]}")


def _train_program(s) -> tuple[Callable, tuple]:
    """The benchmark's train step as a plain jitted function of the model state, and its arguments."""
    import optax
    from flax import nnx

    from histeve_jax.models.qwen2_5_vl.rope import as_grid

    graphdef, state = nnx.split(s.model)
    g = as_grid(s.grid)

    def step(state, ids, pv):
        def loss_fn(m):
            logits = m(ids, pixel_values=pv, image_grid_thw=g).astype("float32")
            return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], ids[:, 1:]).mean()

        return nnx.value_and_grad(loss_fn)(nnx.merge(graphdef, state))

    return jax.jit(step), (state, jax.numpy.asarray(s.ids), jax.numpy.asarray(s.pv, s.dtype))


def _generate_program(s, n: int) -> tuple[Callable, tuple]:
    """The Sampler's program for the benchmark's greedy generation of `n` tokens, and its arguments."""
    import functools
    import importlib

    import numpy as np

    from histeve_jax.models.qwen2_5_vl import Sampler

    # the module (the package's `generate` attribute is the function of that name)
    gen = importlib.import_module("histeve_jax.models.qwen2_5_vl.generate")
    from histeve_jax.models.qwen2_5_vl.rope import as_grid

    sampler = Sampler(s.model)
    # as Sampler.__call__ decides it, from the loaded model's layout (s.cfg, the benchmark's, says stacked)
    unstack = sampler.model.language_model.unrolled() and sampler.model.config.scan_layers
    static = gen._Static(image_grid=as_grid(s.grid), video_grid=None, max_new=n, greedy=True, stop_ids=(),
                         pad_id=0, constraint=None, unstack=unstack)
    prompt = gen._Prompt(np.asarray(s.ids, np.int32), np.ones(s.ids.shape, np.int32),
                         np.asarray(s.pv, s.dtype), None, None, None)
    weights = sampler.weights()
    layer_weights = sampler._layer_weights(weights) if unstack else ()
    args = (weights, layer_weights, prompt, jax.random.key(0), np.float32(0), np.float32(1), [])
    return jax.jit(functools.partial(sampler._run, static=static)), args


def main() -> None:
    import argparse

    from experiments.benchmarks.model_vs_transformers import N_NEW, Setup

    ap = argparse.ArgumentParser()
    ap.add_argument("--stacked", action="store_true", help="the stacked layout, not load_hf's CPU default")
    s = Setup.build(scan_layers=True if ap.parse_args().stacked else None)
    layout = "stacked" if s.model.config.scan_layers else "per-layer"
    print(f"load {os.getloadavg()}; {layout} decoder layers")
    fn, args = _train_program(s)
    print_jax("flax train step", jax_op_profile(fn, *args))
    fn, args = _generate_program(s, N_NEW)
    rows = jax_op_profile(fn, *args, n=2)
    loop = [r for r in rows if r[1] >= N_NEW]
    print_jax(f"flax decode loop ({N_NEW} steps; ms per call / {N_NEW} = per step)", loop)
    print_jax("flax prefill", [r for r in rows if r[1] < N_NEW], top=10)
    print("\n== torch train step\n" + torch_op_profile(s.torch_train_step()))
    print(f"\n== torch generate({N_NEW})\n" + torch_op_profile(s.torch_generate(N_NEW), n=1))


if __name__ == "__main__":
    main()
