"""The benchmark scripts' A/B timing: variants sampled in turn, each figure a median."""

from __future__ import annotations

import itertools
import time
from functools import partial

from conveyor.benchmarks.interleave import gemm_ab, interleaved, timed


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


def test_gemm_ab_prints_both_packings_and_their_ratio(kernels, capsys):
    pack = {label: partial(kernels.pack_linear_weight, width=256) for label in ("A", "B")}
    # The figures print to three significant digits, so even a call slowed down by a busy machine shows above 0.
    gemm_ab(kernels, [("small", 512, 200)], [1, 3], pack, samples=1, min_s=0.001)
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[:2] for line in lines] == [["small", "M=1"], ["small", "M=3"]]
    assert all(float(line.split()[2]) > 0 and line.endswith("x") for line in lines)
