"""``conveyor bench throughput``: many requests at once, long-tailed lengths, exact (ignore_eos)."""

from __future__ import annotations

import json
import time
from typing import Any

from conveyor.bench.report import format_table, mean, percentile
from conveyor.bench.workload import long_tail_workload
from conveyor.engine import Engine, RequestOutput
from conveyor.sampling import SamplingParams


def run_throughput(engine: Engine, num_prompts: int, seed: int) -> dict[str, Any]:
    workload = long_tail_workload(num_prompts, seed, engine.model_config.vocab_size)
    start = time.monotonic()
    for i, item in enumerate(workload):
        params = SamplingParams(temperature=0.0, max_tokens=item.output_len, ignore_eos=True)
        engine.add_request(item.prompt_token_ids, params, request_id=f"bench-{i}", arrival_time=start)
    finished: list[RequestOutput] = []
    steps = 0
    while engine.has_unfinished_requests():
        finished.extend(o for o in engine.step() if o.finished)
        steps += 1
    elapsed = time.monotonic() - start
    prompt_tokens = sum(len(o.prompt_token_ids) for o in finished)
    output_tokens = sum(len(o.token_ids) for o in finished)
    ttft = [o.metrics.time_to_first_token for o in finished]
    latency = [o.metrics.latency for o in finished]
    return {
        "num_requests": len(finished),
        "seed": seed,
        "elapsed_s": elapsed,
        "steps": steps,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "requests_per_s": len(finished) / elapsed,
        "output_tokens_per_s": output_tokens / elapsed,
        "total_tokens_per_s": (prompt_tokens + output_tokens) / elapsed,
        "ttft_mean_s": mean(ttft),
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p99_s": percentile(ttft, 99),
        "latency_mean_s": mean(latency),
        "latency_p50_s": percentile(latency, 50),
        "latency_p99_s": percentile(latency, 99),
        "preemptions": sum(o.metrics.num_preemptions for o in finished),
    }


def print_throughput(result: dict[str, Any], json_path: str | None) -> None:
    rows = [[name, value] for name, value in result.items()]
    print(format_table(["figure", "value"], rows))
    if json_path:
        with open(json_path, "w") as f:
            json.dump(result, f, indent=2)
