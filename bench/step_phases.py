"""A model's prompt step and decode steps in process, for A/B runs of two builds: N prompts computed in one
step, then the median decode step of one request and of N at once.

    .venv/bin/python bench/step_phases.py --model out/models/llama3.2-1b-Q4_K_M.gguf --requests 16

Run two checkouts in turn (``PYTHONPATH=<checkout>``) on the same machine; each run prints one line a repeat.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from conveyor.benchmarks.decode import add_random_requests
from conveyor.core.config import EngineConfig
from conveyor.core.sampling import SamplingParams
from conveyor.engine import Engine

PROMPT_TOKENS = 41  # the comparison's W1 prompts


def phases(engine: Engine, batch: int, steps: int, rng: random.Random) -> tuple[float, float]:
    """``batch`` random prompts added at once and run to ``steps`` new tokens each: the first step's seconds (all
    the prompts) and the median of the decode steps'."""
    params = SamplingParams(temperature=0.0, max_tokens=steps + 1, ignore_eos=True)
    add_random_requests(engine, batch, PROMPT_TOKENS, params, rng)
    times = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return times[0], statistics.median(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--steps", type=int, default=32, help="decode steps a run")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    engine = Engine(EngineConfig(model=args.model, max_model_len=1024, max_num_seqs=max(64, args.requests),
                                 max_num_batched_tokens=max(4096, PROMPT_TOKENS * args.requests)))
    rng = random.Random(0)
    phases(engine, 2, 2, rng)  # warm-up
    for _ in range(args.repeats):
        _, one = phases(engine, 1, args.steps, rng)
        prompts, many = phases(engine, args.requests, args.steps, rng)
        print(f"{args.requests} prompts of {PROMPT_TOKENS}: {prompts * 1000:.0f} ms   decode, 1 request: "
              f"{one * 1000:.1f} ms ({1 / one:.1f} tok/s)   {args.requests} at once: {many * 1000:.1f} ms",
              flush=True)


if __name__ == "__main__":
    main()
