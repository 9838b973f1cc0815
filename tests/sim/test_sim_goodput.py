"""Deadlines in the simulator: the slo policy and admission control run there unchanged, and at 1.5x the
engine's capacity they keep goodput (requests that met their TTFT and TPOT targets, per second) at least twice
first come, first served's, which queues without bound and makes nearly every request late.

Deterministic: a seeded workload on the roofline's A100 and Llama-2-7B, the virtual clock the step times are
measured on."""

from __future__ import annotations

import dataclasses

import pytest

from conveyor.core.config import EngineConfig
from conveyor.sim.cost import CostModel
from conveyor.sim.hardware import load_hardware, load_model_config
from conveyor.sim.simulator import simulate
from conveyor.sim.workload import parse_lengths, synthetic_workload

COST = CostModel(load_model_config("Llama-2-7B"), load_hardware("A100-80GB"), "float16")
SHAREGPT = (parse_lengths("longtail:161"), parse_lengths("longtail:338"))
BASE = EngineConfig(max_num_seqs=64, max_num_batched_tokens=2048, kv_cache_memory="8GiB", ttft_slo_ms=2000,
                    tpot_slo_ms=60)
NUM_REQUESTS = 1200


@pytest.fixture(scope="module")
def capacity() -> float:
    """Requests per second the engine completes when every request is there at once."""
    figures, _ = simulate(BASE, COST, synthetic_workload(NUM_REQUESTS, float("inf"), *SHAREGPT, seed=1))
    return figures["requests_per_s"]


def run(capacity: float, **options) -> dict:
    workload = synthetic_workload(NUM_REQUESTS, 1.5 * capacity, *SHAREGPT, seed=2)
    figures, _ = simulate(dataclasses.replace(BASE, **options), COST, workload)
    return figures


def test_slo_with_admission_control_doubles_goodput_at_one_and_a_half_times_capacity(capacity: float) -> None:
    fcfs = run(capacity)
    slo = run(capacity, scheduling_policy="slo", admission_control=True)
    assert fcfs["refused"] == 0 and slo["refused"] > 0
    assert slo["goodput_requests_per_s"] >= 2 * fcfs["goodput_requests_per_s"], (fcfs, slo)
    # Those it admitted mostly made their targets: what it sheds, it sheds early rather than late.
    assert slo["met_targets_fraction"] * (slo["num_requests"] + slo["refused"]) / slo["num_requests"] > 0.8


def test_the_simulation_is_deterministic_with_the_slo_policy(capacity: float) -> None:
    first, second = (run(capacity, scheduling_policy="slo", admission_control=True) for _ in range(2))
    first.pop("simulation_wall_s"), second.pop("simulation_wall_s")
    assert first == second
