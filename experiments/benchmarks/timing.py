"""The benchmarks' one timing loop: wall times of a callable after warm-up calls (compilation for ours)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def wall_times(fn: Callable[[], object], n: int, warmup: int = 1) -> list[float]:
    """Seconds of each of `n` calls of `fn`, after `warmup` untimed calls."""
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return ts


def median_ms(fn: Callable[[], object], n: int, warmup: int = 1) -> float:
    """Median milliseconds of `n` calls of `fn` after `warmup`."""
    return 1e3 * statistics.median(wall_times(fn, n, warmup))
