"""Seeded synthetic workloads whose lengths have a long tail, as real chat traffic does."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SyntheticRequest:
    prompt_token_ids: list[int]
    output_len: int


def long_tail_length(rng: random.Random, low: int, high: int, median: int) -> int:
    """A log-normal length clipped to [low, high]: most short, a few near ``high``."""
    value = rng.lognormvariate(math.log(median), 0.9)
    return int(min(max(value, low), high))


def long_tail_workload(
    num_requests: int,
    seed: int,
    vocab_size: int,
    prompt_range: tuple[int, int] = (16, 512),
    output_range: tuple[int, int] = (8, 512),
    prompt_median: int = 128,
    output_median: int = 64,
) -> list[SyntheticRequest]:
    """Random-token prompts (ids from the upper part of the vocabulary, away from special tokens)."""
    rng = random.Random(seed)
    requests = []
    for _ in range(num_requests):
        prompt_len = long_tail_length(rng, *prompt_range, prompt_median)
        output_len = long_tail_length(rng, *output_range, output_median)
        prompt = [rng.randrange(vocab_size // 8, vocab_size) for _ in range(prompt_len)]
        requests.append(SyntheticRequest(prompt, output_len))
    return requests
