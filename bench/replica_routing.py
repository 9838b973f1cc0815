"""Router policies on real replicas, same sitting: for each policy, a fresh `conveyor serve --data-parallel-size 2`
(cold caches; a few tiny warm-up requests first), the multi-turn chat workload of `conveyor bench serve`,
then the server is stopped.

    .venv/bin/python bench/replica_routing.py --policies round-robin,least-loaded,cache-aware --rounds 1

Prints each run's prefix-cache hit rate and time to first token, and each policy's ratios to round-robin's.
"""

from __future__ import annotations

import argparse
import json
import sys
from concurrent.futures import ThreadPoolExecutor

import httpx

from conveyor.benchmarks.local_server import local_server
from conveyor.benchmarks.report import format_table
from conveyor.benchmarks.serve import bench_serve


def warm_up(base: str, num_requests: int) -> None:
    """A few tiny requests at once, so that every replica has run its first steps (one-time set-up that no
    router changes) before the timed workload. Prompts under one KV block and one-token answers leave
    nothing in the prefix caches, and nothing in the router's index."""
    def one(index: int) -> None:
        body = {"prompt": [index + 1] * 8, "max_tokens": 1, "temperature": 0, "ignore_eos": True}
        httpx.post(f"{base}/v1/completions", json=body, timeout=300).raise_for_status()

    with ThreadPoolExecutor(num_requests) as pool:
        list(pool.map(one, range(num_requests)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--policies", default="round-robin,least-loaded,cache-aware")
    parser.add_argument("--rounds", type=int, default=1, help="each round runs every policy once, in turn")
    parser.add_argument("--data-parallel-size", type=int, default=2)
    parser.add_argument("--num-threads", type=int, default=1, help="torch threads per replica")
    parser.add_argument("--num-kv-blocks", type=int, default=400, help="KV pool per replica, in 16-token blocks")
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--output-len", type=int, default=32, help="tokens per answer")
    parser.add_argument("--rate", type=float, default=float("inf"), help="conversations started per second")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    flags = ["--data-parallel-size", str(args.data_parallel_size), "--num-threads", str(args.num_threads),
             "--num-kv-blocks", str(args.num_kv_blocks)]
    policies = args.policies.split(",")
    runs = []
    for round_index in range(args.rounds):
        for policy in policies:
            print(f"round {round_index + 1}: {policy} ...", file=sys.stderr, flush=True)
            with local_server(["--router-policy", policy, *flags]) as base:
                warm_up(base, 2 * args.data_parallel_size)
                result = bench_serve(base, None, args.conversations, args.rate, 0, (1, args.output_len), 49152,
                                     None, None, None, workload_kind="multi-turn", num_turns=args.turns)
            runs.append({"round": round_index + 1, "policy": policy} | result)
    columns = ["prefix_cache_hit_rate", "ttft_p50_s", "ttft_p90_s", "e2e_p90_s", "output_tokens_per_s",
               "completed", "failed"]
    print(format_table(["round", "policy", *columns], [[r["round"], r["policy"], *(r[c] for c in columns)]
                                                      for r in runs]))
    base_runs = {r["round"]: r for r in runs if r["policy"] == "round-robin"}
    if base_runs:
        rows = [[r["round"], r["policy"], r["prefix_cache_hit_rate"] / max(base_runs[r["round"]]
                 ["prefix_cache_hit_rate"], 1e-9), r["ttft_p50_s"] / base_runs[r["round"]]["ttft_p50_s"],
                 r["ttft_p90_s"] / base_runs[r["round"]]["ttft_p90_s"]] for r in runs]
        print(format_table(["round", "policy", "hit rate / RR", "TTFT p50 / RR", "TTFT p90 / RR"], rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(runs, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
