"""What every peer runner shares: its command line, the workload files it reads, the result file it writes.

Standard library only: each runner runs in its peer's own virtual environment,
where Conveyor is not installed. A workload file is what
``conveyor.benchmarks.workload.Workload.to_json`` writes: ``{"name", "mode",
"requests": [{"prompt_token_ids", "output_len"}]}`` with mode ``at-once`` or
``one-at-a-time``. The result file holds, per workload, each request's output
token ids, time to first token (None where the engine does not report it) and
latency, and the wall time from the first submit to the last finish.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
PEERS = ROOT / ".peers"
WARMUP_TOKENS = 4

Request = dict[str, Any]  # {"prompt_token_ids": [...], "output_len": n}
Record = dict[str, Any]  # {"output_token_ids": [...], "ttft_s": float | None, "latency_s": float}
# Runs the requests all at once and returns one record per request, in order, times counted from the call.
RunTogether = Callable[[list[Request]], list[Record]]


def argument_parser(description: str, default_model: Path) -> argparse.ArgumentParser:
    """The arguments every runner takes; a runner may add its own before parsing."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("workloads", nargs="+", help="workload JSON files, run in this order")
    parser.add_argument("--result", required=True, help="the result JSON to write")
    parser.add_argument("--model", default=str(default_model), help=f"(default: {default_model})")
    parser.add_argument("--threads", type=int, default=usable_cores(),
                        help="CPU threads the engine computes on: Conveyor's own count, so that both use the same")
    return parser


def usable_cores() -> int:
    """How many cores this process may run on (its affinity), as Conveyor counts them by default."""
    return len(os.sched_getaffinity(0))


def first_cores(threads: int) -> str:
    """The first ``threads`` of the cores this process may use, as a CPU list (``0-3`` or ``0,2,4``)."""
    cores = sorted(os.sched_getaffinity(0))[:threads]
    if len(cores) == 1:
        return str(cores[0])
    if cores == list(range(cores[0], cores[0] + len(cores))):
        return f"{cores[0]}-{cores[-1]}"
    return ",".join(map(str, cores))



def record(output_token_ids: list[int], ttft_s: float | None, latency_s: float) -> Record:
    return {"output_token_ids": list(output_token_ids), "ttft_s": ttft_s, "latency_s": latency_s}


def run_workload(workload: dict[str, Any], run_together: RunTogether) -> dict[str, Any]:
    """One workload in its mode; wall time from the first submit to the last finish."""
    requests = workload["requests"]
    start = time.perf_counter()
    if workload["mode"] == "at-once":
        records = run_together(requests)
    elif workload["mode"] == "one-at-a-time":
        records = [run_together([request])[0] for request in requests]
    else:
        raise ValueError(f"workload {workload['name']}: unknown mode {workload['mode']!r}")
    wall_s = time.perf_counter() - start
    return {"workload": workload["name"], "mode": workload["mode"], "wall_s": wall_s, "requests": records}


def main(engine: str, version: str, args: argparse.Namespace, run_together: RunTogether,
         run_cached: RunTogether | None = None) -> None:
    """Warm up once (first-call costs are not what is compared), run each workload, write the results.

    A workload marked ``prefix_caching`` runs through ``run_cached`` (the engine with its prefix caching on);
    a runner without one skips it, saying so."""
    workloads = [json.loads(Path(path).read_text()) for path in args.workloads]
    first = workloads[0]["requests"][0]
    warmup = [{"prompt_token_ids": first["prompt_token_ids"], "output_len": WARMUP_TOKENS}]
    runners = {False: run_together, True: run_cached}
    for caching in {bool(w.get("prefix_caching")) for w in workloads}:
        if runners[caching] is not None:
            runners[caching](warmup)
    results = []
    for workload in workloads:
        runner = runners[bool(workload.get("prefix_caching"))]
        if runner is None:
            print(f"{engine}: {workload['name']} skipped: this runner has no prefix-caching mode", flush=True)
            continue
        results.append(run_workload(workload, runner))
        print(f"{engine}: {workload['name']} done in {results[-1]['wall_s']:.1f} s", flush=True)
    Path(args.result).write_text(json.dumps({"engine": engine, "version": version, "results": results}))
