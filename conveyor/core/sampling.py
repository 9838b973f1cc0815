"""Sampling parameters of one request, validated when they are made.

Validation lives here, not in the executor, so that a bad request is refused
before it touches the engine and the other requests never see it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from conveyor.core.errors import FieldError
from conveyor.core.structured import StructuredOutput

# Below this temperature, sampling is greedy: dividing logits by it would overflow float32.
GREEDY_TEMPERATURE = 1e-5
MAX_N = 64  # sequences one request may ask for: each takes a batch slot, so a bound protects the others
MAX_LOGPROBS = 20  # top alternatives per token, as OpenAI's top_logprobs allows
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for a logit_bias value: -100 bans a token, 100 forces it
# Every stop string is looked for after every token, on the engine's thread: bounded, so one request cannot
# slow the step of all the others.
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 64


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick each next token and when to stop.

    ``temperature == 0`` (or below 1e-5) means greedy. ``top_k == 0`` (or -1) disables top-k,
    ``top_p == 1`` disables nucleus sampling, ``min_p == 0`` disables min-p (vLLM's: after temperature, a
    token less likely than ``min_p`` times the likeliest one is dropped). A ``seed`` makes the request's
    random draws its own: the same seed gives the same tokens whatever else
    is in the batch.

    Penalties follow OpenAI and vLLM: ``presence_penalty`` and ``frequency_penalty`` subtract from the
    logits of tokens already in the output (once, and once per occurrence); ``repetition_penalty`` divides
    positive (multiplies negative) logits of tokens in the prompt or output. ``logit_bias`` adds to
    chosen tokens' logits; ``min_tokens`` masks EOS and ``stop_token_ids`` until that many tokens are out.
    ``logprobs`` (0-20) returns each chosen token's log-probability and that many alternatives,
    ``prompt_logprobs`` the same for every prompt token after the first; both are computed from the raw
    model distribution, before penalties, bias, temperature or constraints (as vLLM does by default).
    ``structured_output`` constrains the text to a JSON schema, any JSON object, a regex or a choice.
    A stop string ends the text before it, or after it with ``include_stop_str_in_output`` (vLLM's name).
    """

    # vLLM's default; None: as many as the context leaves room for, decided when the request is built
    # (conveyor.engine.request_builder, the one place a request's max_tokens is settled).
    max_tokens: int | None = 16
    n: int = 1  # sequences to draw for the prompt (parallel sampling); they share the prompt's KV blocks
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs; a dict is accepted
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    structured_output: StructuredOutput | None = None

    def __post_init__(self) -> None:
        # Accept a single string or any iterable for the tuple fields.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        if isinstance(self.logit_bias, Mapping):
            object.__setattr__(self, "logit_bias", tuple(self.logit_bias.items()))
        else:
            object.__setattr__(self, "logit_bias", tuple(tuple(pair) for pair in self.logit_bias or ()))
        self._validate()
        self._validate_processing()

    def _validate(self) -> None:
        if not isinstance(self.n, int) or isinstance(self.n, bool) or not 1 <= self.n <= MAX_N:
            raise _invalid("n", f"must be an integer from 1 to {MAX_N}, got {self.n!r}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise _invalid("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        temperature = self.temperature
        if not isinstance(temperature, int | float) or not (math.isfinite(temperature) and temperature >= 0):
            raise _invalid("temperature", f"must be a finite number >= 0, got {self.temperature!r}")
        if not isinstance(self.top_p, int | float) or not 0 < self.top_p <= 1:
            raise _invalid("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise _invalid("min_p", f"must be a number in [0, 1], got {self.min_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise _invalid("top_k", f"must be 0 or -1 (disabled) or a positive integer, got {self.top_k!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise _invalid("seed", f"must be an integer, got {self.seed!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise _invalid("stop", f"must be non-empty strings, got {self.stop!r}")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise FieldError("stop", f"stop: at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        if any(len(s) > MAX_STOP_STRING_CHARS for s in self.stop):
            raise FieldError("stop", f"stop: each stop string at most {MAX_STOP_STRING_CHARS} characters, got one "
                                     f"of {max(len(s) for s in self.stop)}")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise _invalid("stop_token_ids", f"must be non-negative integers, got {self.stop_token_ids!r}")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise FieldError("stop_token_ids",
                             f"stop_token_ids: at most {MAX_STOP_TOKEN_IDS}, got {len(self.stop_token_ids)}")

    def _validate_processing(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2.0 <= value <= 2.0:
                raise _invalid(name, f"must be a number in [-2, 2], got {value!r}")
        if not _is_number(self.repetition_penalty) or not 0 < self.repetition_penalty <= 100:
            raise _invalid("repetition_penalty", f"must be a number in (0, 100], got {self.repetition_penalty!r}")
        for pair in self.logit_bias:
            if len(pair) != 2 or not _is_index(pair[0]) or not _is_number(pair[1]) or abs(pair[1]) > MAX_LOGIT_BIAS:
                raise _invalid("logit_bias", f"must map token ids >= 0 to numbers in [-100, 100], got {pair!r}")
        if not _is_index(self.min_tokens) or self.min_tokens > (self.max_tokens or self.min_tokens):
            raise _invalid("min_tokens", f"must be an integer from 0 to max_tokens, got {self.min_tokens!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_index(value) or value > MAX_LOGPROBS):
                raise _invalid(name, f"must be an integer from 0 to {MAX_LOGPROBS}, got {value!r}")
        if self.structured_output is not None and not isinstance(self.structured_output, StructuredOutput):
            raise _invalid("structured_output", f"must be a StructuredOutput, got {self.structured_output!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def has_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    @property
    def processes_logits(self) -> bool:
        """Whether anything changes this request's logits before sampling (a plain request skips it all)."""
        return bool(self.has_penalties or self.logit_bias or self.min_tokens or self.structured_output)


def _invalid(field: str, rule: str) -> FieldError:
    """``field`` broke ``rule``: the message names the field first, as the API's 400 shows it."""
    return FieldError(field, f"{field} {rule}")


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _is_index(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0

