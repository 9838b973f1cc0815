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
    # Room to decode until aborted: requests prefilled early keep decoding while later ones prefill,
    # and none may finish inside the timed steps.
    params = SamplingParams(temperature=0.0, max_tokens=engine.max_model_len - prompt_len, ignore_eos=True)
    ids = [f"decode-{i}" for i in range(batch_size)]
    for request_id in ids:
        engine.add_request([rng.randrange(vocab // 8, vocab) for _ in range(prompt_len)], params, request_id)
    # Prefill (it may take several steps under the token budget), then a couple of warm-up decodes.
    while engine.scheduler.num_waiting or any(r.num_output_tokens < warmup for r in engine.scheduler.running):
        engine.step()
    before = _output_tokens(engine)
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    elapsed = time.perf_counter() - start
    produced = _output_tokens(engine) - before  # counted, not assumed: a preempted request produces nothing
    for request_id in ids:
        engine.abort_request(request_id)
    return produced / elapsed


def _output_tokens(engine: Engine) -> int:
    return sum(request.num_output_tokens for request in engine.scheduler.requests.values())


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
