"""Per-tenant metrics follow the fair policy's accounts, including tenants it forgets and that come back."""

from __future__ import annotations

from prometheus_client import generate_latest

from conveyor.core.stats import EngineStats
from conveyor.entrypoints.metrics import EngineMetrics


def stats(tenants: dict[str, dict[str, float]]) -> EngineStats:
    return EngineStats(step=1, num_waiting=0, num_running=0, num_swapped=0, num_kv_blocks=8, num_free_kv_blocks=8,
                       kv_usage=0.0, num_cpu_blocks=0, num_free_cpu_blocks=0, num_preemptions=0, num_swaps_out=0,
                       num_swap_fallbacks=0, tenants=tenants)


def figures(prompt: int, output: int) -> dict[str, float]:
    return {"virtual_tokens": prompt + 2 * output, "weight": 1.0, "num_waiting": 0, "num_swapped": 0,
            "prompt_tokens": prompt, "output_tokens": output}


def sample(metrics: EngineMetrics, name: str) -> float | None:
    for line in generate_latest(metrics.registry).decode().splitlines():
        if line.startswith(name + "{") and 'tenant="bob"' in line:
            return float(line.rsplit(" ", 1)[1])
    return None


def test_a_forgotten_tenant_loses_its_gauges_and_its_counters_go_on_when_it_returns() -> None:
    metrics = EngineMetrics("m")
    metrics.on_stats(stats({"bob": figures(10, 3)}))
    assert sample(metrics, "conveyor:tenant_generation_tokens_total") == 3
    metrics.on_stats(stats({}))  # forgotten
    assert sample(metrics, "conveyor:tenant_virtual_tokens") is None
    metrics.on_stats(stats({"bob": figures(4, 1)}))  # back, its account restarted
    assert sample(metrics, "conveyor:tenant_generation_tokens_total") == 4
    assert sample(metrics, "conveyor:tenant_prompt_tokens_total") == 14
    metrics.on_stats(stats({"bob": figures(5, 2)}))
    assert sample(metrics, "conveyor:tenant_generation_tokens_total") == 5
