"""Simulated traffic: length distributions, arrival processes, trace files, seeds."""

from __future__ import annotations

import itertools
import math
import random
import statistics

import pytest

from conveyor.benchmarks.workload import multi_turn_workload
from conveyor.sim.workload import (
    LENGTH_PRESETS,
    WorkloadRequest,
    arrival_times,
    parse_lengths,
    read_trace_file,
    synthetic_workload,
    write_trace_file,
)


def test_length_specs_parse_and_bad_ones_are_refused():
    assert parse_lengths("128").sample(random.Random(0)) == 128
    assert parse_lengths("fixed:7").sample(random.Random(0)) == 7
    rng = random.Random(0)
    assert {parse_lengths("uniform:3,5").sample(rng) for _ in range(200)} == {3, 4, 5}
    for bad in ("0", "uniform:5,3", "longtail:", "gauss:3", "fixed:x"):
        with pytest.raises(ValueError, match="lengths"):
            parse_lengths(bad)


@pytest.mark.parametrize("preset", list(LENGTH_PRESETS))
def test_presets_have_the_vllm_papers_means_and_a_long_tail(preset):
    prompt_spec, output_spec = LENGTH_PRESETS[preset]
    rng = random.Random(1)
    for spec in (prompt_spec, output_spec):
        target = float(spec.split(":")[1])
        draws = [parse_lengths(spec).sample(rng) for _ in range(40_000)]
        assert statistics.fmean(draws) == pytest.approx(target, rel=0.05)
        assert statistics.median(draws) < 0.75 * target  # most are short ...
        assert max(draws) > 5 * target  # ... a few are very long


def test_poisson_arrivals_have_the_asked_rate_and_burstiness_widens_the_gaps():
    def gaps(burstiness):
        times = arrival_times(20_000, 4.0, random.Random(2), burstiness)
        return [b - a for a, b in itertools.pairwise(times)]

    poisson = gaps(1.0)
    assert statistics.fmean(poisson) == pytest.approx(0.25, rel=0.03)
    assert statistics.stdev(poisson) == pytest.approx(0.25, rel=0.05)  # exponential: sd == mean
    bursty, even = gaps(0.25), gaps(4.0)
    assert statistics.fmean(bursty) == pytest.approx(0.25, rel=0.05)
    assert statistics.stdev(bursty) > 1.5 * statistics.stdev(poisson) > 2 * statistics.stdev(even)
    assert arrival_times(3, math.inf, random.Random(0)) == [0.0, 0.0, 0.0]


def test_the_same_requests_arrive_at_every_rate_and_a_seed_fixes_them():
    lengths = parse_lengths("longtail:100")
    slow = synthetic_workload(50, 1.0, lengths, lengths, seed=3)
    fast = synthetic_workload(50, 8.0, lengths, lengths, seed=3)
    assert [(r.prompt_len, r.output_len) for r in slow] == [(r.prompt_len, r.output_len) for r in fast]
    assert slow[-1].arrival_time > fast[-1].arrival_time
    assert synthetic_workload(50, 1.0, lengths, lengths, seed=3) == slow
    assert synthetic_workload(50, 1.0, lengths, lengths, seed=4) != slow


def test_trace_files_round_trip_as_jsonl_and_read_as_csv(tmp_path):
    requests = [WorkloadRequest(0.5, 10, 20), WorkloadRequest(0.0, 3, 4, priority=2)]
    write_trace_file(requests, tmp_path / "w.jsonl")
    assert read_trace_file(tmp_path / "w.jsonl") == sorted(requests, key=lambda r: r.arrival_time)
    (tmp_path / "w.csv").write_text("arrival_time,prompt_tokens,output_tokens\n1.5,7,9\n0.25,2,3\n")
    assert read_trace_file(tmp_path / "w.csv") == [WorkloadRequest(0.25, 2, 3), WorkloadRequest(1.5, 7, 9)]
    (tmp_path / "bad.csv").write_text("arrival_time,prompt_tokens\n1,2\n")
    with pytest.raises(ValueError, match="request 1 lacks"):
        read_trace_file(tmp_path / "bad.csv")


def test_multi_turn_workload_shares_system_prompts_token_for_token():
    conversations = multi_turn_workload(6, seed=3, vocab_size=1000, num_turns=2, num_system_prompts=2)
    assert conversations[0].system_prompt == conversations[2].system_prompt == conversations[4].system_prompt
    assert conversations[1].system_prompt == conversations[3].system_prompt != conversations[0].system_prompt
    own = multi_turn_workload(6, seed=3, vocab_size=1000, num_turns=2)
    assert len({tuple(c.system_prompt) for c in own}) == 6
    with pytest.raises(ValueError, match="num_system_prompts"):
        multi_turn_workload(2, seed=0, vocab_size=1000, num_system_prompts=-1)
