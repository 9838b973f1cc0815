"""The figures of a finished run (throughput, time to first token, latency, percentiles), from plain numbers.

The benchmarks and the simulator report the same names computed the same way, so a simulated run and a
measured one can be put side by side.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from conveyor.core.config import EngineConfig


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile, ``q`` in [0, 100]."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def config_figures(config: EngineConfig) -> dict[str, Any]:
    return {
        "scheduler": config.scheduler,
        "scheduling_policy": config.scheduling_policy,
        "preemption_mode": config.preemption_mode,
        "kv_layout": config.kv_layout,
        "max_num_seqs": config.max_num_seqs,
    }


def request_figures(
    prompt_lens: list[int],
    output_lens: list[int],
    ttft: list[float],
    latency: list[float],
    elapsed: float,
    steps: int,
) -> dict[str, Any]:
    """Throughput and latency figures from per-request numbers: what the benchmark and the simulator both print."""
    prompt_tokens, output_tokens = sum(prompt_lens), sum(output_lens)
    # Time per output token after the first, and the vLLM paper's normalized latency (latency per output token).
    tpot = [(lat - first) / (n - 1) for lat, first, n in zip(latency, ttft, output_lens) if n > 1]
    normalized = [lat / n for lat, n in zip(latency, output_lens)]
    return {
        "num_requests": len(latency),
        "elapsed_s": elapsed,
        "steps": steps,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "requests_per_s": len(latency) / elapsed,
        "output_tokens_per_s": output_tokens / elapsed,
        "total_tokens_per_s": (prompt_tokens + output_tokens) / elapsed,
        "ttft_mean_s": mean(ttft),
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p90_s": percentile(ttft, 90),
        "ttft_p99_s": percentile(ttft, 99),
        "tpot_mean_s": mean(tpot),
        "tpot_p50_s": percentile(tpot, 50),
        "latency_mean_s": mean(latency),
        "latency_p50_s": percentile(latency, 50),
        "latency_p90_s": percentile(latency, 90),
        "latency_p99_s": percentile(latency, 99),
        "normalized_latency_mean_s": mean(normalized),
    }


def met_targets(ttft: float, tpot: float | None, ttft_target: float | None, tpot_target: float | None) -> bool:
    """Whether a request met its latency targets (None: no target; ``tpot`` None: one output token, no TPOT):
    what goodput counts, in the benchmark and the simulator alike."""
    return (ttft_target is None or ttft <= ttft_target) and (tpot_target is None or tpot is None or tpot <= tpot_target)
