"""A/B timing on a noisy machine: variants sampled in turn, so that drift in the machine's load hits every
one of them alike (the benchmark scripts' kernel comparisons)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from functools import partial
from typing import Any


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


def gemm_ab(kernels: Any, shapes: list[tuple[str, int, int]], rows: list[int],
            packings: dict[Any, Callable[[Any], Any]], samples: int, min_s: float) -> None:
    """Print GFLOP/s of the native ``packed_linear`` on each (name, K, N) shape at each row count under two
    packings of the same weight (A | B | A's time over B's), the two timed in turn."""
    import torch

    (a, pack_a), (b, pack_b) = packings.items()
    for name, k, n in shapes:
        weight = torch.randn(n, k)
        packed = {a: pack_a(weight), b: pack_b(weight)}
        for m in rows:
            x = torch.randn(m, k)
            secs = interleaved({label: partial(kernels.packed_linear, x, p, n) for label, p in packed.items()},
                               samples, min_s)
            flops = 2 * m * k * n / 1e9
            # Three significant figures: a small shape slowed down by a busy machine printed 0.0 with one decimal.
            print(f"  {name:8} M={m:<4} {flops / secs[a]:7.3g} | {flops / secs[b]:7.3g} | {secs[a] / secs[b]:.3f}x",
                  flush=True)
