"""Simulated replicas behind the real router: one replica is the single-engine simulator, and the policies
order as their design says on traffic with shared contexts."""

from __future__ import annotations

import pytest

from conveyor.core.config import EngineConfig
from conveyor.entrypoints.cli import main
from conveyor.sim.cluster import simulate_cluster
from conveyor.sim.cost import CostModel
from conveyor.sim.hardware import load_hardware, load_model_config
from conveyor.sim.simulator import simulate
from conveyor.sim.workload import multi_tenant_requests, multi_turn_shapes, parse_lengths, synthetic_workload

H100 = load_hardware("H100-SXM")
LLAMA_8B = CostModel(load_model_config("Llama-3-8B"), H100, "bfloat16")
CONFIG = EngineConfig(max_num_seqs=64, max_num_batched_tokens=2048, num_kv_blocks=4000, max_model_len=8192)


def test_one_replica_is_the_single_engine_simulation():
    workload = synthetic_workload(60, 4.0, parse_lengths("uniform:50,900"), parse_lengths("uniform:1,200"), seed=3)
    alone, _ = simulate(CONFIG, LLAMA_8B, workload)
    cluster = simulate_cluster(CONFIG, LLAMA_8B, workload, 1, "round-robin")
    for key in ("num_requests", "output_tokens", "ttft_p50_s", "ttft_p90_s", "latency_p99_s", "steps"):
        assert cluster[key] == pytest.approx(alone[key]), key


@pytest.mark.parametrize("policy", ["random", "round-robin", "least-loaded", "cache-aware"])
def test_every_turn_of_every_conversation_finishes_once(policy):
    shapes = multi_turn_shapes(12, seed=1, num_turns=4)
    result = simulate_cluster(CONFIG, LLAMA_8B, [], 3, policy, shapes)
    assert result["num_requests"] == 12 * 4
    assert sum(result["requests_per_replica"]) == 12 * 4
    assert result["router_policy"] == policy


def test_cache_aware_beats_the_cache_blind_policies_on_tenants_with_long_contexts():
    workload = multi_tenant_requests(400, 20.0, seed=0, num_tenants=48, context_len=3000, output_len=64)
    results = {policy: simulate_cluster(CONFIG, LLAMA_8B, workload, 4, policy)
               for policy in ("random", "round-robin", "least-loaded", "cache-aware")}
    aware = results.pop("cache-aware")
    for policy, blind in results.items():
        assert aware["prefix_cache_hit_rate"] >= 2 * blind["prefix_cache_hit_rate"], policy
        assert aware["ttft_p90_s"] < blind["ttft_p90_s"], policy
    assert min(aware["requests_per_replica"]) > 0.5 * max(aware["requests_per_replica"])  # still spread


def test_the_simulate_command_compares_router_policies(capsys):
    code = main(["simulate", "--hardware", "H100-SXM", "--model-config", "Llama-3-8B", "--workload", "multi-tenant",
                 "--num-tenants", "8", "--num-requests", "40", "--request-rates", "10", "--num-replicas", "2",
                 "--router-policy", "round-robin,cache-aware"])
    assert code == 0
    out = capsys.readouterr().out
    assert "router=round-robin" in out and "router=cache-aware" in out and "prefix hit rate" in out


def test_bad_router_flags_are_refused(capsys):
    base = ["simulate", "--workload", "multi-tenant", "--num-requests", "10", "--request-rates", "1"]
    assert main([*base, "--num-replicas", "2", "--router-policy", "fastest"]) == 2
    assert "fastest" in capsys.readouterr().err
    assert main([*base, "--num-replicas", "0"]) == 2
    assert "--num-replicas" in capsys.readouterr().err
