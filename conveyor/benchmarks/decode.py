"""``conveyor bench decode``: steady-state decode speed per batch size, the seed's roofline effect.

One decode step reads every weight once whatever the batch, so until the
step turns compute-bound, N requests cost little more than one.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator

from conveyor.benchmarks.report import format_table
from conveyor.core.sampling import SamplingParams
from conveyor.engine import Engine


def random_prompt(rng: random.Random, vocab_size: int, length: int) -> list[int]:
    """``length`` token ids from the upper seven eighths of the vocabulary, clear of the special tokens that
    tokenizers put first: a benchmark's prompt, whose content does not change a step's time."""
    return [rng.randrange(vocab_size // 8, vocab_size) for _ in range(length)]


def add_random_requests(engine: Engine, count: int, prompt_len: int, params: SamplingParams,
                        rng: random.Random) -> None:
    """``count`` requests of random prompts (random_prompt) added to ``engine`` at once."""
    for _ in range(count):
        engine.add_request(random_prompt(rng, engine.model_config.vocab_size, prompt_len), params)


def measure_decode(engine: Engine, batch_size: int, prompt_len: int, steps: int, seed: int) -> float:
    """Output tokens/s over ``steps`` steps in which all ``batch_size`` requests decode."""
    runs = decode_slices(engine, batch_size, prompt_len, steps, seed, slices=1)
    tokens, seconds = next(runs)
    runs.close()  # ends the requests
    return tokens / seconds


def decode_slices(
    engine: Engine, batch_size: int, prompt_len: int, steps: int, seed: int, slices: int
) -> Iterator[tuple[int, float]]:
    """Prefills ``batch_size`` requests, then yields (output tokens, seconds) for each of ``slices`` runs of
    ``steps`` decode steps. The engine waits between yields, so the caller can measure the machine between
    runs (the roofline reads its bandwidth there); the requests end when the generator does."""
    rng = random.Random(seed)
    vocab = engine.model_config.vocab_size
    warmup = 2
    # Room to decode until aborted: requests prefilled early keep decoding while later ones prefill,
    # and none may finish inside the timed steps.
    params = SamplingParams(temperature=0.0, max_tokens=engine.max_model_len - prompt_len, ignore_eos=True)
    ids = [f"decode-{i}" for i in range(batch_size)]
    for request_id in ids:
        engine.add_request(random_prompt(rng, vocab, prompt_len), params, request_id)
    try:
        # Prefill (it may take several steps under the token budget), then a couple of warm-up decodes.
        produced = dict.fromkeys(ids, 0)  # output tokens per request, as the step outputs report them
        while engine.stats().num_waiting or min(produced.values()) < warmup:
            _count_tokens(engine, produced)
        for _ in range(slices):
            before = sum(produced.values())
            start = time.perf_counter()
            for _ in range(steps):
                _count_tokens(engine, produced)
            elapsed = time.perf_counter() - start
            yield sum(produced.values()) - before, elapsed  # counted: a preempted request produces nothing
    finally:
        for request_id in ids:
            engine.abort_request(request_id)


def _count_tokens(engine: Engine, produced: dict[str, int]) -> None:
    """One step; record each request's output length."""
    for output in engine.step():
        produced[output.request_id] = len(output.token_ids)


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
