"""Luanti env throughput: steps per second for one instance and for two in parallel, CPU per instance.

    python -m experiments.benchmarks.env_steps

Each instance renders 640x360 and is paced to 20 steps/s (real time), so 20 is the ceiling; CPU is the
game + Xvfb processes' CPU time (psutil) over wall time, in cores. The last line is
``steps_per_s_1=<x> steps_per_s_2_each=<y> cpu_per_instance=<cores>``.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import time

import numpy as np
import psutil

N_STEPS = 300
WORKER_TIMEOUT_S = 600  # one instance's start + warm-up + N_STEPS, with a wide margin


def _action(t: int) -> dict:
    # walk and look around: the view changes every step, as in play
    a = {"forward": int((t // 40) % 2 == 0), "jump": int(t % 25 == 0)}
    a["camera"] = np.array([0.0, 4.0 if (t // 60) % 2 == 0 else -4.0], np.float32)
    return a


def measure(n_steps: int = N_STEPS, fps_max: int = 30, viewing_range: int = 40) -> dict:
    """Run one env for n_steps; returns steps/s and the game+Xvfb CPU cores used while stepping."""
    from histeve_jax.envs import make

    env = make("luanti", obs_size=(360, 640), fps_max=fps_max, viewing_range=viewing_range)
    try:
        env.reset(options={"task": "mine_log"})
        procs = [psutil.Process(p) for p in env.pids()]
        for _ in range(20):  # warm up
            env.step(_action(0))
        cpu0 = sum(p.cpu_times().user + p.cpu_times().system for p in procs)
        self0 = psutil.Process().cpu_times()
        t0 = time.perf_counter()
        for t in range(n_steps):
            env.step(_action(t))
        wall = time.perf_counter() - t0
        cpu1 = sum(p.cpu_times().user + p.cpu_times().system for p in procs)
        self1 = psutil.Process().cpu_times()
    finally:
        env.close()
    return {"steps_per_s": n_steps / wall, "cpu": (cpu1 - cpu0) / wall,
            "python_cpu": (self1.user + self1.system - self0.user - self0.system) / wall}


def _worker(q) -> None:
    q.put(measure())


def main() -> None:
    one = measure()
    print(f"1 instance: {one['steps_per_s']:.1f} steps/s, game+Xvfb {one['cpu']:.2f} cores, "
          f"env python {one['python_cpu']:.2f} cores")
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(q,)) for _ in range(2)]
    for p in procs:
        p.start()
    two: list[dict] = []
    deadline = time.monotonic() + WORKER_TIMEOUT_S
    while len(two) < len(procs):
        try:
            two.append(q.get(timeout=5.0))
        except queue.Empty:  # a worker that died (e.g. its game did not start) never reports
            failed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if failed or time.monotonic() > deadline:
                for p in procs:
                    p.terminate()
                raise SystemExit(f"an instance did not report (worker exit codes "
                                 f"{[p.exitcode for p in procs]})") from None
    for p in procs:
        p.join()
    each = min(r["steps_per_s"] for r in two)
    cpu2 = float(np.mean([r["cpu"] for r in two]))
    print(f"2 instances: {', '.join(format(r['steps_per_s'], '.1f') for r in two)} steps/s each, "
          f"game+Xvfb {cpu2:.2f} cores each")
    print(f"load average {psutil.getloadavg()[0]:.1f} on {psutil.cpu_count()} cores (other jobs share them)")
    print(f"steps_per_s_1={one['steps_per_s']:.1f} steps_per_s_2_each={each:.1f} "
          f"cpu_per_instance={max(one['cpu'], cpu2):.2f}")


if __name__ == "__main__":
    main()
