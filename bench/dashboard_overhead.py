"""The engine thread's share of time spent feeding a dashboard: recording each step and building deltas.

    .venv/bin/python bench/dashboard_overhead.py --num-prompts 128 --max-num-seqs 128

Runs the real engine (default model) over `bench throughput`'s long-tailed workload with a live recorder
attached and flushed at most ten times a second, as the server does while a page watches, and times the
recorder's calls against the steps. A ratio of two times in one process, so a busy machine moves it little.
"""

from __future__ import annotations

import argparse
import random
import time

from conveyor.core.config import EngineConfig
from conveyor.core.sampling import SamplingParams
from conveyor.engine import Engine


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=128)
    parser.add_argument("--max-num-seqs", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args()
    engine = Engine(EngineConfig(max_num_seqs=args.max_num_seqs))
    rng = random.Random(0)
    for i in range(args.num_prompts):
        prompt = [rng.randrange(1000, 40000) for _ in range(rng.randrange(16, 256))]
        engine.add_request(prompt, SamplingParams(max_tokens=rng.randrange(8, args.max_tokens), ignore_eos=True),
                           request_id=f"r{i}")
    recorder = engine.start_live()
    spent = {"after_step": 0.0, "flush": 0.0}
    after_step = recorder.after_step

    def timed_after_step(*a, **kw):
        began = time.perf_counter()
        after_step(*a, **kw)
        spent["after_step"] += time.perf_counter() - began

    recorder.after_step = timed_after_step
    keyframe = recorder.keyframe()
    began, steps, deltas, rows = time.perf_counter(), 0, 0, 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        if recorder.due():
            t = time.perf_counter()
            delta = recorder.flush()
            spent["flush"] += time.perf_counter() - t
            deltas += 1
            rows += len(delta["requests"])
    total = time.perf_counter() - began
    share = (spent["after_step"] + spent["flush"]) / total
    print(f"{steps} steps, {deltas} deltas ({rows / max(deltas, 1):.0f} rows each), "
          f"keyframe of {len(keyframe['requests'])} requests, in {total:.1f} s")
    print(f"recording: {spent['after_step'] * 1e3 / steps:.3f} ms/step; building a delta: "
          f"{spent['flush'] * 1e3 / max(deltas, 1):.3f} ms; together {share:.3%} of the engine thread's time")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
