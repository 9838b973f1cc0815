"""One request's state as the scheduler sees it.

The scheduler reasons with two numbers only: ``num_computed_tokens`` (tokens
whose KV is in the cache) and ``num_tokens`` (prompt plus output so far).
Each step hands a request enough tokens for the first to catch up with the
second, which makes prefill, chunked prefill, recompute after preemption and
decode one and the same path.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from conveyor.core.errors import FieldError
from conveyor.core.pooling import PoolingParams
from conveyor.core.sampling import SamplingParams


def check_prompt_length(num_prompt_tokens: int, max_model_len: int, pooled: bool = False,
                        param: str = "prompt") -> None:
    """FieldError (naming ``param``) unless a prompt of that length leaves room for at least one output token
    (a ``pooled`` prompt, which draws none, may fill the context)."""
    if pooled and num_prompt_tokens > max_model_len:
        raise FieldError(param, f"{param}: {num_prompt_tokens} tokens, but max_model_len is {max_model_len}")
    if not pooled and num_prompt_tokens >= max_model_len:
        raise FieldError(param, f"{param}: {num_prompt_tokens} tokens, but max_model_len is {max_model_len}, "
                                "which leaves no room for output")


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # back in the waiting queue; its KV was dropped
    SWAPPED = "swapped"  # preempted with its KV copied to CPU, to be copied back
    FINISHED = "finished"


class FinishReason(enum.StrEnum):
    """Why a request ended; values match the OpenAI API's ``finish_reason``."""

    STOP = "stop"  # EOS, a stop token or a stop string
    LENGTH = "length"  # max_tokens or the model's maximum length
    ABORT = "abort"  # cancelled by the caller
    ERROR = "error"  # the engine failed while computing it (vLLM v1's name); ``Request.error`` says how


@dataclass(slots=True, eq=False)  # a request is equal only to itself: queues find it by identity, fast
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    eos_token_id: int | None = None
    priority: int = 0
    arrival_order: int = 0  # set by the scheduler; breaks ties between equal arrival times
    prompt_text: str | None = None
    cache_salt: str | None = None  # prefix caching shares blocks only between requests with the same salt
    tenant: str = ""  # who the request is served for (the fair policy's unit of share); "" when nobody is named
    # Latency targets in seconds (None: none): time to first token, and mean time per output token after it.
    # The slo policy orders and protects by them, admission control refuses by the first, goodput counts both.
    ttft_slo: float | None = None
    tpot_slo: float | None = None
    # Positions from here on hold tokens no other request will ever send (the simulator's stand-in ids of a
    # request's own question and answer): a block holding any is found again only by this request, after a
    # preemption, so prefix caching indexes such blocks only then (conveyor.core.kv.prefix_cache). None: any
    # block may be found by any request (the real engine's requests).
    private_after: int | None = None
    # A pooled request (an embedding): its prompt only, no token drawn; the scheduler ends it once the prompt
    # is computed, and the executor pools its hidden states (conveyor.core.pooling).
    pooling: PoolingParams | None = None
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache when first admitted (OpenAI's cached_tokens)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    error: str | None = None  # with finish_reason ERROR: what went wrong, in words a client may see (no trace)
    num_preemptions: int = 0
    last_preempted_by: tuple[str, int] | None = None  # (waiting request, step): guards against thrash
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def tokens_left(self, max_model_len: int) -> int:
        """Output tokens the request may still draw: the fewer of what ``max_tokens`` and the model's length
        allow. The one stop rule: the scheduler ends a request at 0, and the simulator's fast-forward, the
        speculator's draft room and the dashboard's "remaining" all count from here."""
        num_output = len(self.output_token_ids)
        return min(self.sampling_params.max_tokens - num_output,
                   max_model_len - len(self.prompt_token_ids) - num_output)

    def token_ids(self, start: int, end: int) -> list[int]:
        """Token ids at positions ``[start, end)`` of prompt + output."""
        prompt = self.prompt_token_ids
        num_prompt = len(prompt)
        if end <= num_prompt:
            return prompt[start:end]
        if start >= num_prompt:  # a decode: output tokens only
            return self.output_token_ids[start - num_prompt : end - num_prompt]
        return prompt[start:] + self.output_token_ids[: end - num_prompt]

    def cut_output(self, num_tokens: int) -> int:
        """Keep the first ``num_tokens`` output tokens only (a stop string ended the text there, and a step that
        accepted drafts had drawn more); how many were dropped."""
        dropped = max(0, len(self.output_token_ids) - num_tokens)
        del self.output_token_ids[num_tokens:]
        return dropped

    def finish(self, reason: FinishReason, now: float, stop_reason: str | int | None = None) -> None:
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason
        self.finish_time = now
