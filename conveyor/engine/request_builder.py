"""Building a request: where a prompt becomes token ids, is checked, and gets its ``max_tokens``.

The engine (offline and behind the server), the replicas' front end (which holds only the tokenizer) and the
server all build requests here, so a prompt is checked the same way whichever path it takes, and a bad one is
refused with a :class:`FieldError` naming the field before it reaches a scheduler. ``max_tokens`` is settled
here and nowhere else: what the caller gave, else the caller's default, else the room left in the context.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass

from conveyor.core.errors import FieldError
from conveyor.core.pooling import PoolingParams
from conveyor.core.request import Request, check_prompt_length
from conveyor.core.sampling import SamplingParams
from conveyor.engine.tokenizer import Tokenizer


@dataclass(frozen=True, slots=True)
class MaxTokensRule:
    """How ``max_tokens`` is settled when a request is built.

    Offline, a ``max_tokens`` past the context is cut by the context's end (the request finishes with
    ``length``); the server refuses it instead (``fit_context``), as OpenAI's API does, so a client learns
    what it may ask for.
    """

    default: int | None = None  # for SamplingParams with max_tokens None; None: the room left in the context
    fit_context: bool = False  # refuse prompt + max_tokens past max_model_len (FieldError naming max_tokens)


CUT_AT_CONTEXT = MaxTokensRule()  # the offline rule: the room left by default, the context's end stops the rest
# A pooled request's sampling parameters: it draws nothing, but the scheduler's policies read max_tokens (one).
POOLED_PARAMS = SamplingParams(max_tokens=1, temperature=0.0)


class RequestBuilder:
    """Tokenizes and checks prompts for one model; touches no engine state, so any thread may call it."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, max_model_len: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self._clock = clock
        self._ids = itertools.count()

    def build(
        self,
        prompt: str | list[int],
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        max_tokens: MaxTokensRule = CUT_AT_CONTEXT,
    ) -> Request:
        """A request the engine can take; FieldError naming the field (``prompt``, ``logit_bias``,
        ``max_tokens``, ``min_tokens``) otherwise."""
        params = sampling_params if sampling_params is not None else SamplingParams()
        check_logit_bias(params, self.vocab_size)
        token_ids = self.prompt_token_ids(prompt)
        return Request(
            request_id=request_id if request_id is not None else f"req-{next(self._ids)}",
            prompt_token_ids=token_ids,
            sampling_params=self._settle_max_tokens(params, len(token_ids), max_tokens),
            arrival_time=self._clock() if arrival_time is None else arrival_time,
            eos_token_id=self.tokenizer.eos_token_id,
            priority=priority,
            prompt_text=prompt if isinstance(prompt, str) else None,
        )

    def build_pooled(self, prompt: str | list[int], pooling: PoolingParams, request_id: str | None = None,
                     priority: int = 0) -> Request:
        """A prompt-only request whose result is one vector (an embedding: conveyor.core.pooling); its prompt
        may fill the context, since it draws no token. FieldError naming ``input`` for a bad prompt."""
        token_ids = self.prompt_token_ids(prompt, pooled=True, field="input")
        return Request(
            request_id=request_id if request_id is not None else f"embd-{next(self._ids)}",
            prompt_token_ids=token_ids,
            sampling_params=POOLED_PARAMS,
            arrival_time=self._clock(),
            priority=priority,
            prompt_text=prompt if isinstance(prompt, str) else None,
            pooling=pooling,
        )

    def prompt_token_ids(self, prompt: str | list[int], pooled: bool = False, field: str = "prompt") -> list[int]:
        """Text tokenized, or ids checked against the vocabulary (an overlong list refused before each id is
        looked at); either way with room left for one output token, unless ``pooled`` (no token drawn).
        FieldError naming ``field``, the name the caller's API gives the prompt."""
        if isinstance(prompt, str):
            token_ids = _tokenize(prompt, self.tokenizer, field)
        else:
            check_prompt_length(len(prompt), self.max_model_len, pooled, field)
            token_ids = _checked_ids(prompt, self.vocab_size, field)
        check_prompt_length(len(token_ids), self.max_model_len, pooled, field)
        return token_ids

    def _settle_max_tokens(self, params: SamplingParams, num_prompt_tokens: int, rule: MaxTokensRule) -> SamplingParams:
        """The one place a request's ``max_tokens`` is decided (see MaxTokensRule)."""
        room = self.max_model_len - num_prompt_tokens
        if params.max_tokens is None:
            # As vLLM and OpenAI: no max_tokens means up to the model's context, not a short default.
            settled = room if rule.default is None else max(rule.default, params.min_tokens)
            params = dataclasses.replace(params, max_tokens=settled)  # checks min_tokens against it
        if rule.fit_context and params.max_tokens > room:
            raise FieldError("max_tokens", f"prompt ({num_prompt_tokens} tokens) + max_tokens ({params.max_tokens}) "
                                           f"is more than max_model_len ({self.max_model_len}); lower max_tokens to "
                                           f"{room}")
        return params


def check_logit_bias(params: SamplingParams, vocab_size: int) -> None:
    """logit_bias names token ids of this model's vocabulary; FieldError naming the field otherwise."""
    bad = [token for token, _ in params.logit_bias if token >= vocab_size]
    if bad:
        raise FieldError("logit_bias",
                         f"logit_bias: token ids must be below the vocabulary size {vocab_size}, got {bad[:5]}")


def _tokenize(prompt: str, tokenizer: Tokenizer, field: str) -> list[int]:
    if not prompt:
        raise FieldError(field, f"{field}: empty prompt")
    token_ids = tokenizer.encode(prompt)
    if not token_ids:  # a request of no tokens has no logits to sample from: it would fail its step
        raise FieldError(field, f"{field}: the text tokenizes to no tokens")
    return token_ids


def _checked_ids(prompt: list[int], vocab_size: int, field: str) -> list[int]:
    token_ids = list(prompt)
    if not token_ids:
        raise FieldError(field, f"{field}: empty list of token ids")
    bad = [t for t in token_ids if not isinstance(t, int) or not 0 <= t < vocab_size]
    if bad:
        raise FieldError(field, f"{field}: token ids must be integers in [0, {vocab_size}), got {bad[:5]}")
    return token_ids
