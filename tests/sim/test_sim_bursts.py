"""Bursts in the simulator: an idle engine's first step waits for the rest of the requests sent with the first
(``--burst-wait-ms``, conveyor.core.burst), as the server's loop does, in the single engine and the cluster alike."""

from __future__ import annotations

import dataclasses

import pytest

from conveyor.core.config import EngineConfig
from conveyor.sim.cluster import simulate_cluster
from conveyor.sim.cost import CostModel
from conveyor.sim.hardware import load_hardware, load_model_config
from conveyor.sim.simulator import simulate
from conveyor.sim.workload import SenderShape, WorkloadRequest, parse_lengths, synthetic_workload

COST = CostModel(load_model_config("Llama-3-8B"), load_hardware("H100-SXM"), "bfloat16")
CONFIG = EngineConfig(max_num_seqs=64, max_num_batched_tokens=2048, num_kv_blocks=4000, max_model_len=8192)
# Three requests sent at once that reach the engine over 1.5 ms, and one a second later.
BURST = [WorkloadRequest(t, 100, 8) for t in (0.0, 0.001, 0.0015, 1.0)]


def first_step(wait_ms: int):
    _, trace = simulate(dataclasses.replace(CONFIG, burst_wait_ms=wait_ms), COST, BURST, record_trace=True)
    return trace.steps[0]


def test_requests_sent_at_once_share_the_first_step() -> None:
    step = first_step(2)
    assert len(step.scheduled) == 3 and step.start == pytest.approx(0.0035)


def test_without_a_wait_the_first_request_steps_alone() -> None:
    step = first_step(0)
    assert len(step.scheduled) == 1 and step.start == 0.0


def test_a_lone_request_waits_once_for_company() -> None:
    _, trace = simulate(CONFIG, COST, BURST, record_trace=True)
    late = next(step for step in trace.steps if step.start > 0.5)
    assert late.start == pytest.approx(1.0 + CONFIG.burst_wait_ms / 1000) and len(late.scheduled) == 1


@pytest.mark.parametrize("wait_ms", [0, 2, 50])
def test_one_replica_is_the_single_engine_with_its_waits_and_closed_loops(wait_ms: int) -> None:
    """The single engine's loop and the cluster's replica wait by the same rule: after open arrivals, and when a
    closed loop's next request reaches an engine its last step left idle."""
    config = dataclasses.replace(CONFIG, burst_wait_ms=wait_ms)
    workload = synthetic_workload(40, 2.0, parse_lengths("uniform:50,400"), parse_lengths("uniform:1,60"), seed=5)
    senders = [SenderShape("loop", senders=2, prompt_len=64, output_len=4, until=3.0)]
    alone, _ = simulate(config, COST, workload, senders=senders)
    cluster = simulate_cluster(config, COST, workload, 1, "round-robin", senders=senders)
    for key in ("num_requests", "output_tokens", "ttft_p50_s", "ttft_p90_s", "latency_p99_s", "steps"):
        assert cluster[key] == pytest.approx(alone[key]), key
