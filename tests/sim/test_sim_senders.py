"""Closed-loop senders in the simulator (a tenant that keeps N requests in flight) and per-tenant waits: the
workload of ``bench/tenant_fairness.py``, which the simulator predicts for each policy."""

from __future__ import annotations

import dataclasses

import pytest

from conveyor.core.config import EngineConfig
from conveyor.sim.cost import CostModel
from conveyor.sim.hardware import load_hardware, load_model_config
from conveyor.sim.simulator import Simulation, simulate
from conveyor.sim.workload import SenderShape, WorkloadRequest

SMALL = CostModel(load_model_config("SmolLM2-135M"), load_hardware("A100-80GB"), "float16")
CONFIG = EngineConfig(max_num_seqs=4, max_num_batched_tokens=256, block_size=8, num_kv_blocks=512, max_model_len=512)


def light_requests(every: float, until: float) -> list[WorkloadRequest]:
    count = int(until / every)
    return [WorkloadRequest(every * (i + 1), 16, 4, tenant="light") for i in range(count - 1)]


def test_each_sender_sends_its_next_request_as_the_last_one_finishes_until_its_end():
    until = 0.5
    simulation = Simulation(CONFIG, SMALL, [], senders=[SenderShape("heavy", 3, 40, 12, until=until)])
    figures = simulation.run()
    finished = simulation.finished
    arrivals, finishes = list(finished.arrivals), list(finished.finishes)
    assert arrivals.count(0.0) == 3, "every sender's first request at time 0"
    later = [at for at in arrivals if at > 0]
    assert later and all(at < until for at in later), "none sent past the end"
    assert set(later) <= set(finishes), "each later request arrives as one finishes"
    # Every request but the last of each sender had a successor: three chains, each ending past ``until``.
    assert len(arrivals) - len(later) == 3 and sum(finish >= until for finish in finishes) == 3
    assert figures["tenants"]["heavy"]["requests"] == figures["num_requests"] == len(arrivals)
    assert figures["num_requests"] > 3 * 4, "many rounds in the run"


def test_at_most_the_senders_requests_are_in_flight_at_once():
    simulation = Simulation(CONFIG, SMALL, [], senders=[SenderShape("heavy", 5, 24, 6, until=0.3)])
    simulation.run()
    finished = simulation.finished
    events = sorted([(at, 1) for at in finished.arrivals] + [(at, -1) for at in finished.finishes],
                    key=lambda event: (event[0], event[1]))  # a finish before the arrival it lets in
    in_flight = peak = 0
    for _, change in events:
        in_flight += change
        peak = max(peak, in_flight)
    assert peak == 5


def test_fair_seats_the_light_tenant_at_once_beside_a_heavy_backlog_and_fcfs_does_not():
    """The simulated form of the benchmark's first part: the heavy tenant keeps four times the batch cap in
    flight; under fcfs each light request waits behind its backlog, under fair it is seated in the next step,
    the heavy tenant's latest request making way when every place is taken (without that, it would wait for the
    next heavy request to finish: 10x longer here)."""
    waits = {}
    for policy in ("fcfs", "fair"):
        config = dataclasses.replace(CONFIG, scheduling_policy=policy)
        figures, _ = simulate(config, SMALL, light_requests(0.05, 1.0),
                              senders=[SenderShape("heavy", 16, 64, 32, until=1.0)])
        waits[policy] = figures["tenants"]["light"]
        assert figures["tenants"]["light"]["requests"] == 19
    assert waits["fair"]["ttft_p99_s"] * 10 < waits["fcfs"]["ttft_p99_s"]


def test_fair_preempts_nobody_when_every_tenant_has_a_request_running():
    """Two tenants both backlogged past the batch cap: each always has requests running, so admission's order
    alone keeps them level, and nobody is preempted for a place."""
    config = dataclasses.replace(CONFIG, scheduling_policy="fair")
    figures, _ = simulate(config, SMALL, [], senders=[SenderShape(name, 16, 64, 32, until=1.0) for name in "ab"])
    assert figures["preemptions"] == 0
    assert figures["tenants"]["a"]["requests"] == figures["tenants"]["b"]["requests"] > 16


def test_a_sender_shape_with_nothing_to_send_is_refused():
    with pytest.raises(ValueError, match="senders of 'heavy'"):
        Simulation(CONFIG, SMALL, [], senders=[SenderShape("heavy", 0, 10, 10)])


def test_requests_without_a_tenant_give_no_tenant_figures():
    figures, _ = simulate(CONFIG, SMALL, [WorkloadRequest(0.0, 10, 4)])
    assert "tenants" not in figures


def test_a_serving_overhead_lengthens_each_step_by_its_sampled_tokens_and_leaves_the_model_alone():
    from conveyor.sim.cost import with_serving_overhead

    served = with_serving_overhead(SMALL, 0.01)
    alone = [WorkloadRequest(0.0, 10, 20)]
    plain, _ = simulate(CONFIG, SMALL, alone)
    slower, _ = simulate(CONFIG, served, alone)
    assert slower["latency_mean_s"] - plain["latency_mean_s"] == pytest.approx(20 * 0.01)  # 20 tokens sampled
    assert SMALL.serving_s_per_token == 0.0 and served.kv_bytes_per_token == SMALL.kv_bytes_per_token
    with pytest.raises(ValueError, match=">= 0"):
        with_serving_overhead(SMALL, -1e-3)


def test_a_serving_latency_per_request_adds_to_each_ttft_and_latency_but_not_to_the_steps():
    from conveyor.sim.cost import with_serving_overhead

    served = with_serving_overhead(SMALL, 0.0, 0.05)
    workload = [WorkloadRequest(0.1 * i, 10, 20, tenant="light") for i in range(5)]
    plain, _ = simulate(CONFIG, SMALL, workload)
    later, _ = simulate(CONFIG, served, workload)
    assert later["ttft_mean_s"] - plain["ttft_mean_s"] == pytest.approx(0.05)
    assert later["latency_mean_s"] - plain["latency_mean_s"] == pytest.approx(0.05)
    assert later["tenants"]["light"]["ttft_p99_s"] - plain["tenants"]["light"]["ttft_p99_s"] == pytest.approx(0.05)
    assert later["elapsed_s"] == plain["elapsed_s"] and SMALL.serving_s_per_request == 0.0
    with pytest.raises(ValueError, match="a request"):
        with_serving_overhead(SMALL, 0.0, -0.01)


def test_a_cluster_runs_senders_too_and_one_replica_is_the_engine_alone():
    from conveyor.sim.cluster import simulate_cluster

    senders = [SenderShape("heavy", 6, 40, 12, until=0.3)]
    light = light_requests(0.05, 0.3)
    alone, _ = simulate(CONFIG, SMALL, light, senders=senders)
    one = simulate_cluster(CONFIG, SMALL, light, 1, "round-robin", senders=senders)
    assert one["tenants"] == alone["tenants"] and one["num_requests"] == alone["num_requests"]
    two = simulate_cluster(CONFIG, SMALL, light, 2, "round-robin", senders=senders)
    assert two["tenants"]["light"]["requests"] == len(light)
    assert two["tenants"]["heavy"]["requests"] > 6, "the senders' follow-ups reach the router"
    assert sum(two["requests_per_replica"]) == two["num_requests"] and min(two["requests_per_replica"]) > 0
