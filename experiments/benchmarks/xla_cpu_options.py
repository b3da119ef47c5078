"""XLA:CPU options (and the allocator) against our train step: each in a fresh process, since XLA reads its
flags once at start. The model, inputs and step are `model_vs_transformers`' (as `load_hf` gives the model;
`--stacked` for the stacked layout); the time is the median of 7 steps after 2 warm-ups, with the minor page
faults per step (`getrusage`).

    python -m experiments.benchmarks.xla_cpu_options [--stacked]

Last line: the fastest setting and its time over the default's (< 1: faster).
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time

TCMALLOC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"  # Debian's libtcmalloc-minimal4
OPTIONS = {
    "default": {},
    "fast math": {"XLA_FLAGS": "--xla_cpu_enable_fast_math=true"},
    "concurrency-optimized scheduler": {"XLA_FLAGS": "--xla_cpu_enable_concurrency_optimized_scheduler=true"},
    "oneDNN": {"XLA_FLAGS": "--xla_cpu_use_onednn=true"},
    "YNNPACK fusions off": {"XLA_FLAGS": "--xla_cpu_experimental_ynn_fusion_type="},
    "legacy runtime": {"XLA_FLAGS": "--xla_cpu_use_thunk_runtime=false"},
    "tcmalloc": {"LD_PRELOAD": TCMALLOC},
}


def child(stacked: bool) -> None:
    from experiments.benchmarks.model_vs_transformers import Setup

    step = Setup.build(scan_layers=True if stacked else None).jax_train_step()
    step(), step()
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    ts = []
    for _ in range(7):
        t = time.perf_counter()
        step()
        ts.append(time.perf_counter() - t)
    faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults) / 7
    print(f"RESULT {statistics.median(ts) * 1e3:.1f} {faults:.0f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--stacked", action="store_true")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        return child(a.stacked)
    print(f"our train step ({'stacked' if a.stacked else 'load_hf default'} layout), load {os.getloadavg()}")
    times = {}
    for name, env in OPTIONS.items():
        if "LD_PRELOAD" in env and not os.path.exists(env["LD_PRELOAD"]):
            print(f"{name:34s} skipped: {env['LD_PRELOAD']} is missing (libtcmalloc-minimal4)")
            continue
        cmd = [sys.executable, "-m", __spec__.name, "--child", *["--stacked"] * a.stacked]
        r = subprocess.run(cmd, env={**os.environ, "HF_HUB_OFFLINE": "1", **env}, capture_output=True,
                           text=True, timeout=900)
        line = next((x for x in r.stdout.splitlines() if x.startswith("RESULT")), None)
        if line is None:
            print(f"{name:34s} failed: {r.stderr.strip().splitlines()[-1:]}")
            continue
        ms, faults = map(float, line.split()[1:])
        times[name] = ms
        print(f"{name:34s} {ms:7.1f} ms  {faults:8.0f} page faults/step  {' '.join(env.values())}")
    best = min(times, key=times.get)
    print(f"best={best!r} ratio_to_default={times[best] / times['default']:.3f}")


if __name__ == "__main__":
    main()
