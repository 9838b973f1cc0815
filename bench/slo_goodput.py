"""Goodput at 1.5x capacity on the real engine: first come, first served against slo with admission control,
same sitting (the aim: the second at least twice the first, every 429 within 50 ms).

For each configuration, a fresh `conveyor serve` (its engine flags, then the configuration's): a burst of
`--num-prompts` requests all at once that warms it (its measured step times, its KV pool's first pages; a fresh
server's first burst runs about a sixth slower than its later ones), on the first server a second burst that
measures capacity (the completion rate, used for both), then the measured run: as many requests as Poisson
arrivals at `--load` times that rate, each with the TTFT and TPOT targets (sent as its own targets with
`--send-slo`, so only the slo server acts on them). The bursts' prompts are drawn with other seeds than the
measured run's, on both servers alike: a burst of the same prompts would leave them in one server's prefix
cache and not the other's.

    .venv/bin/python bench/slo_goodput.py --num-prompts 200 --slo-ttft 2 --slo-tpot 0.2 -- --max-num-seqs 16

Prints goodput, completions, refusals and the slowest 429 of each, and the ratio of the goodputs.
"""

from __future__ import annotations

import sys

from conveyor.benchmarks.local_server import local_server, save_results, server_script_parser
from conveyor.benchmarks.report import format_table
from conveyor.benchmarks.serve import bench_serve

CONFIGURATIONS = {"fcfs": ["--scheduling-policy", "fcfs"],
                  "slo+admission": ["--scheduling-policy", "slo", "--admission-control"]}


def main() -> int:
    parser = server_script_parser(__doc__, "flags for both servers, after --")
    parser.add_argument("--num-prompts", type=int, default=200)
    parser.add_argument("--load", type=float, default=1.5, help="offered rate as a multiple of the capacity")
    parser.add_argument("--slo-ttft", type=float, default=2.0, help="seconds")
    parser.add_argument("--slo-tpot", type=float, default=0.2, help="seconds per output token")
    parser.add_argument("--output-len", default="8,256")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    low, high = (int(x) for x in args.output_len.split(","))
    capacity, results = None, {}
    for name, flags in CONFIGURATIONS.items():
        with local_server([*args.engine_flags, *flags]) as base:
            def run(rate: float, seed: int, base: str = base) -> dict:
                return bench_serve(base, None, args.num_prompts, rate, seed, (low, high), 49152, args.slo_ttft,
                                   args.slo_tpot, None, send_slo=True)

            run(float("inf"), args.seed + 1)  # the warm-up
            if capacity is None:
                capacity = run(float("inf"), args.seed + 2)["requests_per_s"]
                print(f"capacity: {capacity:.2f} req/s; offering {args.load * capacity:.2f} req/s", flush=True)
            results[name] = run(args.load * capacity, args.seed)
    rows = [[name, r["goodput_requests_per_s"], r["completed"], r["refused"], r["refused_latency_max_s"],
             r["ttft_p99_s"], r["tpot_p99_s"]] for name, r in results.items()]
    print(format_table(["configuration", "goodput req/s", "completed", "refused (429)", "slowest 429 s",
                        "TTFT p99 s", "TPOT p99 s"], rows))
    base_goodput = results["fcfs"]["goodput_requests_per_s"]
    ratio = results["slo+admission"]["goodput_requests_per_s"] / base_goodput if base_goodput else float("inf")
    print(f"goodput, slo + admission control / fcfs: {ratio:.2f}x")
    save_results(args.json, {"capacity_requests_per_s": capacity, "load": args.load, "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
