"""What a caller gets back for a request after each step, and the text side of it (detokenizing, stop strings).

Stop strings live here, not in the core, because they are about text: the
core draws token ids, this module turns them into text, finds where a stop
string starts, and the engine then asks the core to end the request.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from conveyor.core.logprobs import TokenLogprob
from conveyor.core.request import Request
from conveyor.engine.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass(slots=True)
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finish_time: float | None
    num_preemptions: int

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def latency(self) -> float | None:
        return None if self.finish_time is None else self.finish_time - self.arrival_time


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    delta_text: str  # text added by this step, for streaming
    finished: bool
    finish_reason: str | None
    stop_reason: str | int | None
    metrics: RequestMetrics
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    index: int = 0  # which of the request's ``n`` sequences this is
    # One per output token (with SamplingParams.logprobs), and one per prompt token, None for the first
    # (with prompt_logprobs, once the prompt is computed); None when not asked for.
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    error: str | None = None  # finish_reason "error": what failed, in words a client may see (never a trace)
    embedding: list[float] | None = None  # a pooled request's vector, on its one (final) output


@dataclass(slots=True)
class LogprobState:
    """One sequence's logprobs so far: the sampled tokens', and the prompt's by position (a prompt
    computed again after preemption overwrites the same positions)."""

    sampled: list[TokenLogprob] | None = None
    prompt: dict[int, TokenLogprob] = field(default_factory=dict)

    def prompt_list(self, num_prompt_tokens: int) -> list[TokenLogprob | None] | None:
        """None for the first prompt token, then each one's; None until all are computed."""
        if len(self.prompt) < num_prompt_tokens - 1:
            return None
        return [None, *(self.prompt[position] for position in range(1, num_prompt_tokens))]


class TextState:
    """One request's text so far: incremental detokenization, stop strings, and what was already streamed."""

    __slots__ = ("_detokenizer", "_held_back", "_include_stop", "_num_sent", "_num_tokens", "prompt", "stop",
                 "stop_string", "text")

    def __init__(self, request: Request, tokenizer: Tokenizer) -> None:
        params = request.sampling_params
        self.prompt = request.prompt_text
        self.stop = params.stop
        self.text = ""
        self.stop_string: str | None = None  # the stop string that ended the text, once one did
        self._include_stop = params.include_stop_str_in_output  # the text ends after the stop string, not before
        self._detokenizer = IncrementalDetokenizer(tokenizer, request.prompt_token_ids, params.skip_special_tokens)
        # A stream holds back a tail that may be the start of a stop string, so it never shows one.
        self._held_back = max((len(s) for s in self.stop), default=1) - 1
        self._num_sent = 0  # characters already handed out as deltas
        self._num_tokens = 0  # output tokens already turned into text

    def add_tokens(self, token_ids: list[int]) -> bool:
        """Detokenize the output tokens not seen yet; True if a stop string now ends the text (cut before it)."""
        for token in token_ids[self._num_tokens :]:
            before = len(self.text)
            self.text += self._detokenizer.add(token)
            self._num_tokens += 1
            if self.stop and self._cut_at_stop_string(before):
                return True
        return False

    @property
    def num_tokens(self) -> int:
        """Output tokens turned into text: once a stop string ended it, the output's length up to that token
        (a step that accepted drafts may have drawn more)."""
        return self._num_tokens

    def _cut_at_stop_string(self, before: int) -> bool:
        search_from = max(before - self._held_back, 0)
        hits = [(at, s) for s in self.stop if (at := self.text.find(s, search_from)) >= 0]
        if not hits:
            return False
        at, self.stop_string = min(hits)
        self.text = self.text[: at + len(self.stop_string) if self._include_stop else at]
        return True

    def delta(self, finished: bool) -> str:
        """The text not streamed yet (all of it once the request has finished)."""
        sendable = len(self.text) if finished else max(len(self.text) - self._held_back, self._num_sent)
        delta, self._num_sent = self.text[self._num_sent : sendable], sendable
        return delta
