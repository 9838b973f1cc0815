"""Latency against request rate, and the highest rate a configuration sustains.

A swept rate is *sustainable* when the engine keeps up with it and answers
fast enough:

* it keeps up: over the middle half of the arrivals, requests complete at no
  less than ``KEEP_UP`` of the rate at which they arrive
  (:func:`conveyor.sim.simulator.mid_run_rates`). Below capacity the two rates
  are about equal, whatever the latency; above it the queue grows and
  completions fall behind.
* it answers fast enough: the mean normalized latency (end-to-end latency
  divided by output tokens, the vLLM paper's measure) is at most a bound.

The *max sustainable rate* is the highest swept rate that is sustainable
together with every lower swept rate.
"""

from __future__ import annotations

from typing import Any

KEEP_UP = 0.9
DEFAULT_LATENCY_BOUND = 0.2  # seconds per output token


def is_sustainable(result: dict[str, Any], latency_bound: float = DEFAULT_LATENCY_BOUND) -> bool:
    keeps_up = result["completion_rate"] >= KEEP_UP * result["offered_rate"]
    return keeps_up and result["normalized_latency_mean_s"] <= latency_bound


def max_sustainable_rate(
    rates: list[float], results: list[dict[str, Any]], latency_bound: float = DEFAULT_LATENCY_BOUND
) -> float | None:
    """None when even the lowest swept rate is not sustainable."""
    best = None
    for rate, result in sorted(zip(rates, results), key=lambda pair: pair[0]):
        if not is_sustainable(result, latency_bound):
            break
        best = rate
    return best
