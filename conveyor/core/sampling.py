"""Sampling parameters of one request, validated when they are made.

Validation lives here, not in the executor, so that a bad request is refused
before it touches the engine and the other requests never see it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# Below this temperature, sampling is greedy: dividing logits by it would overflow float32.
GREEDY_TEMPERATURE = 1e-5
MAX_N = 64  # sequences one request may ask for: each takes a batch slot, so a bound protects the others
# Every stop string is looked for after every token, on the engine's thread: bounded, so one request cannot
# slow the step of all the others.
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 64


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick each next token and when to stop.

    ``temperature == 0`` (or below 1e-5) means greedy. ``top_k == 0`` (or -1) disables top-k,
    ``top_p == 1`` disables nucleus sampling. A ``seed`` makes the request's
    random draws its own: the same seed gives the same tokens whatever else
    is in the batch.
    """

    max_tokens: int = 16
    n: int = 1  # sequences to draw for the prompt (parallel sampling); they share the prompt's KV blocks
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        # Accept a single string or any iterable for the tuple fields.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        self._validate()

    def _validate(self) -> None:
        if not isinstance(self.n, int) or isinstance(self.n, bool) or not 1 <= self.n <= MAX_N:
            raise ValueError(f"n must be an integer from 1 to {MAX_N}, got {self.n!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        temperature = self.temperature
        if not isinstance(temperature, int | float) or not (math.isfinite(temperature) and temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not isinstance(self.top_p, int | float) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be 0 or -1 (disabled) or a positive integer, got {self.top_k!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must be non-empty strings, got {self.stop!r}")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop: at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        if any(len(s) > MAX_STOP_STRING_CHARS for s in self.stop):
            raise ValueError(f"stop: each stop string at most {MAX_STOP_STRING_CHARS} characters, got one of "
                             f"{max(len(s) for s in self.stop)}")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"stop_token_ids: at most {MAX_STOP_TOKEN_IDS}, got {len(self.stop_token_ids)}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

