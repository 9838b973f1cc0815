"""Draft proposers: guesses of a request's next tokens from tokens already seen, with no second model.

* ``ngram`` (prompt lookup, as vLLM's and llama.cpp's): the request's last n tokens (n from
  ``prompt_lookup_max`` down to ``prompt_lookup_min``) are looked up earlier in its own prompt and output;
  the tokens that followed the most recent earlier occurrence are the draft. It pays where the output
  repeats its input: code edits, quoting summaries, RAG answers, JSON echoing a schema.
* ``suffix`` (after SuffixDecoding): the same lookup in the request itself, and where that finds nothing, a
  walk through the continuations seen in recent requests' outputs, each next token the most frequent one
  after the current context, for as long as the walk stays likely. It pays where outputs repeat each other
  (agents, templated answers, the same question asked again).

Both keep an index per request, brought up to date with the tokens added since the last call, so a step
costs a few dictionary lookups per request whatever the length of its context. A draft model or EAGLE-style
heads would be a third kind behind the same ``Proposer`` protocol; they need weights this project does not
ship.
"""

from __future__ import annotations

from collections import deque
from typing import Protocol

from conveyor.core.request import Request
from conveyor.core.spec.config import SpeculativeConfig

SUFFIX_WINDOW = 256  # finished requests whose outputs the suffix proposer learns from
SUFFIX_MIN_PROBABILITY = 0.1  # the suffix walk stops where its tokens' product of frequencies falls below this


class Proposer(Protocol):
    def propose(self, request: Request, max_drafts: int) -> list[int]:
        """Up to ``max_drafts`` guesses of the tokens that follow the request's tokens so far (maybe none)."""
        ...

    def finished(self, request: Request) -> None:
        """The request ended: drop what was kept for it (the suffix proposer first learns from its output)."""
        ...


class _OwnIndex:
    """One request's n-grams, each mapped to where the tokens after its most recent occurrence begin."""

    __slots__ = ("history", "index", "indexed_end")

    def __init__(self) -> None:
        self.history: list[int] = []
        self.index: dict[tuple[int, ...], int] = {}
        self.indexed_end = 0  # n-grams ending at or before this position are indexed

    def catch_up(self, request: Request, min_n: int, max_n: int) -> None:
        """Add the request's tokens not seen yet; index every n-gram that has a token after it."""
        history = self.history
        seen = len(history)
        num_prompt = len(request.prompt_token_ids)
        if seen < num_prompt:
            history.extend(request.prompt_token_ids[seen:])
            seen = num_prompt
        history.extend(request.output_token_ids[seen - num_prompt:])
        index = self.index
        for end in range(self.indexed_end + 1, len(history)):  # an n-gram ending at `end` is followed by a token
            for n in range(min_n, min(max_n, end) + 1):
                index[tuple(history[end - n:end])] = end
        self.indexed_end = max(self.indexed_end, len(history) - 1)

    def lookup(self, min_n: int, max_n: int, max_drafts: int) -> list[int]:
        """The tokens that followed the most recent earlier occurrence of the longest suffix seen before (of
        ``min_n`` to ``max_n`` tokens); none when no suffix was seen."""
        history = self.history
        length = len(history)
        for n in range(min(max_n, length), min_n - 1, -1):
            start = self.index.get(tuple(history[length - n:]))
            if start is not None:
                return history[start:start + max_drafts]
        return []


class NgramProposer:
    """Prompt lookup over the request's own prompt and output."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self._own: dict[str, _OwnIndex] = {}

    def _own_match(self, request: Request, max_drafts: int) -> list[int]:
        own = self._own.get(request.request_id)
        if own is None:
            own = self._own[request.request_id] = _OwnIndex()
        own.catch_up(request, self.min_n, self.max_n)
        return own.lookup(self.min_n, self.max_n, max_drafts)

    def propose(self, request: Request, max_drafts: int) -> list[int]:
        return self._own_match(request, max_drafts)

    def finished(self, request: Request) -> None:
        self._own.pop(request.request_id, None)


class SuffixProposer(NgramProposer):
    """The request's own n-grams first; else a walk through recent requests' outputs (see the module's doc)."""

    def __init__(self, min_n: int, max_n: int, window: int = SUFFIX_WINDOW) -> None:
        super().__init__(min_n, max_n)
        # context n-gram -> {next token: times seen}, over the outputs of the last `window` finished requests
        self._next: dict[tuple[int, ...], dict[int, int]] = {}
        self._learned: deque[list[tuple[tuple[int, ...], int]]] = deque()
        self._window = window

    def propose(self, request: Request, max_drafts: int) -> list[int]:
        draft = self._own_match(request, max_drafts)
        if draft:
            return draft
        history = self._own[request.request_id].history
        return self._walk(history[len(history) - self.max_n:], max_drafts)

    def _walk(self, context: list[int], max_drafts: int) -> list[int]:
        """Follow the most frequent continuation of the longest known suffix of ``context``, token by token,
        while the product of their frequencies stays at SUFFIX_MIN_PROBABILITY or more."""
        draft: list[int] = []
        probability = 1.0
        context = list(context)
        while len(draft) < max_drafts:
            counts = self._longest_known(context)
            if counts is None:
                break
            token, seen = max(counts.items(), key=lambda pair: pair[1])
            probability *= seen / sum(counts.values())
            if probability < SUFFIX_MIN_PROBABILITY:
                break
            draft.append(token)
            context.append(token)
        return draft

    def _longest_known(self, context: list[int]) -> dict[int, int] | None:
        for n in range(min(self.max_n, len(context)), self.min_n - 1, -1):
            counts = self._next.get(tuple(context[len(context) - n:]))
            if counts:
                return counts
        return None

    def finished(self, request: Request) -> None:
        """Learn the request's output (with the end of its prompt as the first context), then forget it."""
        super().finished(request)
        tokens = request.prompt_token_ids[-self.max_n:] + request.output_token_ids
        start = len(tokens) - len(request.output_token_ids)
        learned = []
        for end in range(max(start, self.min_n), len(tokens)):
            for n in range(self.min_n, min(self.max_n, end) + 1):
                key = tuple(tokens[end - n:end])
                counts = self._next.setdefault(key, {})
                counts[tokens[end]] = counts.get(tokens[end], 0) + 1
                learned.append((key, tokens[end]))
        self._learned.append(learned)
        if len(self._learned) > self._window:
            self._unlearn(self._learned.popleft())

    def _unlearn(self, learned: list[tuple[tuple[int, ...], int]]) -> None:
        for key, token in learned:
            counts = self._next[key]
            counts[token] -= 1
            if not counts[token]:
                del counts[token]
                if not counts:
                    del self._next[key]


def make_proposer(config: SpeculativeConfig) -> NgramProposer:
    kind = SuffixProposer if config.method == "suffix" else NgramProposer
    return kind(config.prompt_lookup_min, config.prompt_lookup_max)
