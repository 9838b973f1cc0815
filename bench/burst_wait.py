"""Requests sent at once through the server: its idle engine stepping at the first or once the burst has come.

One server with ``--burst-wait-ms 0``, one with the default, side by side (a GGUF file's pages are shared),
each idle while the other works. They take turns: each round sends ``--at-once`` of the comparison's W1 chat
prompts (41 tokens, ``conveyor bench compare``'s) to one, then to the other, at once, through the comparison's
client (bench/peers/http_client.py), and times the whole batch: its wall time, output tokens a second, and each
request's time to first token (its latency less the server's own first-to-last-token time). Where the engine
stepped at the first arrival, the first requests' first tokens come much sooner than the rest's, so the mean
time to first token falls below the median. Prints each round and the medians.

    .venv/bin/python bench/burst_wait.py --model out/models/olmoe-1b-7b-Q4_K_M.gguf --rounds 3
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent / "peers"))

import http_client  # bench/peers: the client every served engine is timed through
import run_conveyor

from conveyor.benchmarks.local_server import local_server, save_results
from conveyor.benchmarks.report import format_table
from conveyor.benchmarks.workload import w1_requests
from conveyor.engine.tokenizer import Tokenizer
from conveyor.model.weights.paths import resolve_model

WAITS_MS = (0, None)  # None: the server's default


def batch(endpoint: http_client.Endpoint, requests: list[dict]) -> dict[str, float]:
    """All of ``requests`` at once: wall seconds, output tokens a second, mean and median time to first token."""
    start = time.perf_counter()
    records = http_client.run_together(endpoint)(requests)
    wall = time.perf_counter() - start
    ttfts = [record["ttft_s"] for record in records]
    return {"wall_s": wall, "tok_s": sum(len(r["output_token_ids"]) for r in records) / wall,
            "ttft_mean_s": statistics.mean(ttfts), "ttft_p50_s": statistics.median(ttfts), "ttft_min_s": min(ttfts)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a GGUF file or HF folder (default: the default model)")
    parser.add_argument("--at-once", type=int, default=16, help="requests sent at once (at most 64)")
    parser.add_argument("--tokens", type=int, default=128, help="output tokens of each request")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default=None, help="write the results to this file as JSON")
    parser.add_argument("engine_flags", nargs="*", help="flags for both servers, after --")
    args = parser.parse_args()
    requests = [{"prompt_token_ids": list(r.prompt_token_ids), "output_len": args.tokens}
                for r in w1_requests(Tokenizer(resolve_model(args.model)))][:args.at_once]
    flags = [*(["--model", args.model] if args.model else []), "--no-enable-prefix-caching", *args.engine_flags]
    names = {wait: "default" if wait is None else f"--burst-wait-ms {wait}" for wait in WAITS_MS}
    results: dict[str, list[dict[str, float]]] = {name: [] for name in names.values()}
    with contextlib.ExitStack() as stack:
        bases = {wait: stack.enter_context(local_server(flags + ([] if wait is None else
                                                                 ["--burst-wait-ms", str(wait)])))
                 for wait in WAITS_MS}
        # asked as the comparison asks Conveyor's server (bench/peers/run_conveyor.py), on each one's port
        endpoints = {wait: run_conveyor.endpoint(int(base.rsplit(":", 1)[1])) for wait, base in bases.items()}
        for served in endpoints.values():  # warm each: its first request pays for more than its tokens
            batch(served, [{**requests[0], "output_len": 2}])
        for round_ in range(args.rounds):
            for wait, served in endpoints.items():
                figures = batch(served, requests)
                results[names[wait]].append(figures)
                print(f"round {round_ + 1} {names[wait]}: " + ", ".join(f"{k} {v:.3f}" for k, v in figures.items()),
                      flush=True)
    keys = list(next(iter(results.values()))[0])
    rows = [[name, *(f"{statistics.median(r[k] for r in runs):.3f}" for k in keys)] for name, runs in results.items()]
    print(format_table(["server", *(f"{k}, median" for k in keys)], rows))
    save_results(args.json, results)


if __name__ == "__main__":
    main()
