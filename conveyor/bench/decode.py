"""``conveyor bench decode``: steady-state decode speed per batch size, the seed's roofline effect.

One decode step reads every weight once whatever the batch, so until the
step turns compute-bound, N requests cost little more than one.
"""

from __future__ import annotations

import random
import time

from conveyor.bench.report import format_table
from conveyor.engine import Engine
from conveyor.sampling import SamplingParams


def measure_decode(engine: Engine, batch_size: int, prompt_len: int, steps: int, seed: int) -> float:
    """Output tokens/s over ``steps`` steps in which all ``batch_size`` requests decode."""
    rng = random.Random(seed)
    vocab = engine.model_config.vocab_size
    warmup = 2
    params = SamplingParams(temperature=0.0, max_tokens=warmup + steps + 1, ignore_eos=True)
    for i in range(batch_size):
        engine.add_request([rng.randrange(vocab // 8, vocab) for _ in range(prompt_len)], params, f"decode-{i}")
    # Prefill (it may take several steps under the token budget), then a couple of warm-up decodes.
    while engine.scheduler.num_waiting or any(r.num_output_tokens < warmup for r in engine.scheduler.running):
        engine.step()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    elapsed = time.perf_counter() - start
    while engine.has_unfinished_requests():
        engine.step()
    return batch_size * steps / elapsed


def run_decode(engine: Engine, batch_sizes: list[int], prompt_len: int, steps: int, seed: int) -> list[list]:
    rows = []
    base = None
    for batch_size in batch_sizes:
        tokens_per_s = measure_decode(engine, batch_size, prompt_len, steps, seed)
        base = base or tokens_per_s
        step_ms = 1000 * batch_size / tokens_per_s
        rows.append([batch_size, round(step_ms, 1), round(tokens_per_s, 1), f"{tokens_per_s / base:.2f}x"])
        print(f"batch {batch_size}: {tokens_per_s:.1f} output tok/s", flush=True)
    return rows


def print_decode(rows: list[list]) -> None:
    print()
    print(format_table(["batch", "step ms", "output tok/s", "vs smallest batch"], rows))
