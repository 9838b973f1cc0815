"""The benchmark scripts' A/B timing: variants sampled in turn, each figure a median."""

from __future__ import annotations

import itertools
import time

from conveyor.bench.interleave import interleaved, timed


def test_timed_fills_the_time_asked_and_divides_by_the_calls():
    calls = []
    seconds = timed(lambda: (calls.append(1), time.sleep(0.002)), min_s=0.02)
    assert len(calls) >= 3  # a warm-up call, then at least two timed ones
    assert 0.002 <= seconds < 0.02


def test_interleaved_samples_the_variants_in_turn():
    order = []
    figures = interleaved({"a": lambda: order.append("a"), "b": lambda: (order.append("b"), time.sleep(0.001))},
                          samples=3, min_s=0.005)
    assert set(figures) == {"a", "b"} and figures["b"] > figures["a"]
    switches = sum(1 for first, second in itertools.pairwise(order) if first != second)
    assert switches == 5  # a..a b..b a..a b..b a..a b..b: three samples each, alternating
