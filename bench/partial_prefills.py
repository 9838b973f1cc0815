"""Long prompts among short ones on the real engine: one prompt computed at a time (the default) against
partial prefills (several prompts in chunks side by side), same sitting.

The workload: ``--short`` prompts of about ``--short-prompt`` random tokens and ``--long`` of ``--long-prompt``,
in a random order, as Poisson arrivals at ``--rate`` requests a second, each decoding ``--output`` tokens. For
each configuration a fresh `conveyor serve` (the engine flags after ``--``, then the configuration's), warmed
by a few requests of other prompts, then the workload. Printed: the short prompts' TTFT p50 / p99, the long
ones' mean TTFT, and output tokens a second over the run, with the ratios (the aim: the short ones' p99 at
least 3x lower with partial prefills, output tokens a second within 5%).

    .venv/bin/python bench/partial_prefills.py [--rate 4] -- --max-num-seqs 16
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time

import httpx

from conveyor.benchmarks.local_server import local_server, save_results, server_script_parser
from conveyor.benchmarks.serve import RequestTiming, stream_request
from conveyor.benchmarks.workload import SyntheticRequest
from conveyor.observe.figures import percentile

CONFIGURATIONS = {
    "one prompt at a time": ["--max-num-partial-prefills", "1"],
    "partial prefills (4, 1 long)": ["--max-num-partial-prefills", "4", "--max-long-partial-prefills", "1"],
}


def workload(args: argparse.Namespace, seed: int) -> list[SyntheticRequest]:
    rng = random.Random(seed)
    short = [max(8, int(rng.gauss(args.short_prompt, 20))) for _ in range(args.short)]
    lengths = [args.long_prompt] * args.long + short
    rng.shuffle(lengths)
    return [SyntheticRequest([rng.randrange(1000, 40000) for _ in range(n)], args.output) for n in lengths]


async def run(base: str, args: argparse.Namespace) -> tuple[list[RequestTiming], float]:
    """Warm the server, then send the workload; each request's timing and the run's length (seconds)."""
    url = f"{base}/v1/completions"
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None), limits=limits) as client:
        await asyncio.gather(*(stream_request(client, url, None, item, {}) for item in workload(args, 99)[:8]))
        rng, tasks = random.Random(args.seed), []
        start = time.perf_counter()
        for item in workload(args, args.seed):
            tasks.append(asyncio.create_task(stream_request(client, url, None, item, {})))
            await asyncio.sleep(rng.expovariate(args.rate))
        timings = list(await asyncio.gather(*tasks))
        return timings, time.perf_counter() - start


def summary(timings: list[RequestTiming], elapsed: float, long_prompt: int) -> dict[str, float]:
    failed = [t.error for t in timings if t.error is not None]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed: {failed[0]}")
    short = [t.ttft for t in timings if t.prompt_tokens < long_prompt]
    long = [t.ttft for t in timings if t.prompt_tokens >= long_prompt]
    return {"short_ttft_p50_s": statistics.median(short), "short_ttft_p99_s": percentile(short, 99),
            "long_ttft_mean_s": statistics.fmean(long), "output_tokens_per_s": sum(t.output_tokens for t in timings)
            / elapsed, "elapsed_s": elapsed}


def main() -> int:
    parser = server_script_parser(__doc__)
    parser.add_argument("--short", type=int, default=200)
    parser.add_argument("--short-prompt", type=int, default=100)
    parser.add_argument("--long", type=int, default=8)
    parser.add_argument("--long-prompt", type=int, default=4000)
    parser.add_argument("--output", type=int, default=32)
    parser.add_argument("--rate", type=float, default=4.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    results = {}
    for name, flags in CONFIGURATIONS.items():
        with local_server([*args.engine_flags, *flags]) as base:
            results[name] = summary(*asyncio.run(run(base, args)), args.long_prompt)
        r = results[name]
        print(f"{name}: short TTFT p50 {r['short_ttft_p50_s']:.3f} s, p99 {r['short_ttft_p99_s']:.3f} s; long TTFT "
              f"mean {r['long_ttft_mean_s']:.2f} s; {r['output_tokens_per_s']:.1f} output tok/s", flush=True)
    one, partial = (results[name] for name in CONFIGURATIONS)
    print(f"short prompts' TTFT p99, one at a time / partial prefills: "
          f"{one['short_ttft_p99_s'] / partial['short_ttft_p99_s']:.2f}x (the aim: >= 3); output tok/s, partial / "
          f"one at a time: {partial['output_tokens_per_s'] / one['output_tokens_per_s']:.3f} (the aim: within 5%)")
    save_results(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
