"""A/B timing on a noisy machine: variants sampled in turn, so that drift in the machine's load hits every
one of them alike (the benchmark scripts' kernel comparisons)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def timed(call: Callable[[], object], min_s: float) -> float:
    """Seconds per call, over as many calls as fill min_s (after one warm-up call)."""
    call()
    calls, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < min_s or calls < 2:
        call()
        calls += 1
    return elapsed / calls


def interleaved(variants: dict[str, Callable[[], object]], samples: int, min_s: float) -> dict[str, float]:
    """Median seconds per call of each variant, sampled in turn."""
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(samples):
        for name, call in variants.items():
            times[name].append(timed(call, min_s))
    return {name: statistics.median(values) for name, values in times.items()}
