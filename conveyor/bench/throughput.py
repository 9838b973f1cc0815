"""``conveyor bench throughput``: many requests at once, long-tailed lengths, exact (ignore_eos)."""

from __future__ import annotations

import json
import time
from typing import Any

from conveyor.bench.report import format_table
from conveyor.bench.workload import SyntheticRequest, long_tail_workload
from conveyor.core.figures import config_figures, request_figures
from conveyor.core.sampling import SamplingParams
from conveyor.engine import Engine, RequestOutput


def run_all_at_once(engine: Engine, requests: list[SyntheticRequest]) -> tuple[list[RequestOutput], int]:
    """Submit every request at once (greedy, ignore_eos: exactly ``output_len`` tokens each) and step until all
    have finished. Returns their outputs in submit order and the number of steps."""
    start = engine.clock()
    params = [SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True) for r in requests]
    ids = [engine.add_request(r.prompt_token_ids, p, arrival_time=start) for r, p in zip(requests, params)]
    done: dict[str, RequestOutput] = {}
    steps = 0
    while engine.has_unfinished_requests():
        done.update((o.request_id, o) for o in engine.step() if o.finished)
        steps += 1
    return [done[i] for i in ids], steps


def run_throughput(
    engine: Engine,
    num_prompts: int,
    seed: int,
    output_range: tuple[int, int] = (8, 512),
    prompt_range: tuple[int, int] = (16, 512),
) -> dict[str, Any]:
    """Run the workload to the end; the engine's trace is recorded too (``engine.trace``)."""
    workload = long_tail_workload(
        num_prompts, seed, engine.model_config.vocab_size, prompt_range=prompt_range, output_range=output_range
    )
    trace = engine.start_trace()
    start = time.monotonic()
    finished, steps = run_all_at_once(engine, workload)
    elapsed = time.monotonic() - start
    _, idle_fraction = trace.slot_fill()
    stats = engine.stats()
    return {
        **config_figures(engine.config),
        "seed": seed,
        **request_figures(
            [len(o.prompt_token_ids) for o in finished],
            [len(o.token_ids) for o in finished],
            [o.metrics.time_to_first_token for o in finished],
            [o.metrics.latency for o in finished],
            elapsed,
            steps,
        ),
        "preemptions": sum(o.metrics.num_preemptions for o in finished),
        "swaps_out": stats.num_swaps_out,
        "swap_fallbacks_to_recompute": stats.num_swap_fallbacks,
        "peak_running": trace.peak_running(),
        "kv_waste_fraction": trace.mean_kv_waste(),
        "idle_slot_fraction": idle_fraction,
    }




def print_throughput(result: dict[str, Any]) -> None:
    print(format_table(["figure", "value"], [[name, value] for name, value in result.items()]))


COMPARE_COLUMNS = {
    "output tok/s": "output_tokens_per_s",
    "req/s": "requests_per_s",
    "mean latency s": "latency_mean_s",
    "p99 latency s": "latency_p99_s",
    "p50 TTFT s": "ttft_p50_s",
    "p99 TTFT s": "ttft_p99_s",
    "idle slots": "idle_slot_fraction",
    "preemptions": "preemptions",
    "swaps": "swaps_out",
    "peak running": "peak_running",
    "KV waste": "kv_waste_fraction",
}


def print_comparison(labels: list[str], results: list[dict[str, Any]]) -> None:
    """One row per configuration, and each one's output tokens/s relative to the first."""
    base = results[0]["output_tokens_per_s"]
    rows = [
        [label, *(result[key] for key in COMPARE_COLUMNS.values()), f"{result['output_tokens_per_s'] / base:.2f}x"]
        for label, result in zip(labels, results)
    ]
    print(format_table(["configuration", *COMPARE_COLUMNS, "vs first"], rows))


def write_json(results: Any, path: str | None) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(results, f, indent=2)
