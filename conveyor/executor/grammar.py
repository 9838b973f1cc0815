"""Structured output through xgrammar: grammars compiled once per constraint, a matcher per request, and
each step's constrained rows masked to the tokens their grammar allows.

A matcher is kept in step with its request's output lazily: before its row is masked, it accepts the
output tokens it has not seen (or rolls back any it saw that the output no longer holds). So whatever
happened between two steps (a preemption and recompute, a swap, a stop string ending the text) the
matcher's state is that of the output so far, and a request is never advanced twice by one token.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from conveyor.core.errors import FieldError
from conveyor.core.scheduler.output import ScheduledRequest
from conveyor.core.structured import StructuredOutput
from conveyor.executor.grammar_compilers import CompileRefused, GrammarCompilers

logger = logging.getLogger("conveyor.grammar")

GRAMMAR_CACHE_BYTES = 64 * 2**20  # compiled grammars kept, by xgrammar's own count of their size


class CompiledCache:
    """Compiled grammars by constraint, bounded in bytes: the least recently used leave first (150 different
    schemas once added 52 MiB that stayed). A grammar in use by a request stays alive through its matcher."""

    def __init__(self, limit_bytes: int = GRAMMAR_CACHE_BYTES) -> None:
        self.limit_bytes = limit_bytes
        self.num_bytes = 0
        self._entries: OrderedDict[tuple[str, str], tuple[Any, int]] = OrderedDict()
        self._lock = threading.Lock()  # the server's threads and the engine's ask at once

    def get(self, key: tuple[str, str]) -> Any:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            self._entries.move_to_end(key)
            return entry[0]

    def put(self, key: tuple[str, str], compiled: Any, size: int) -> None:
        with self._lock:
            if key in self._entries:
                return
            self._entries[key] = (compiled, size)
            self.num_bytes += size
            while self.num_bytes > self.limit_bytes and len(self._entries) > 1:
                _, (_, evicted) = self._entries.popitem(last=False)
                self.num_bytes -= evicted

    def __len__(self) -> int:
        return len(self._entries)


@dataclass(slots=True)
class _Matcher:
    matcher: Any  # xgrammar.GrammarMatcher
    num_accepted: int = 0
    broken: bool = False  # a token its grammar refused (cannot happen under its own mask): no longer constrained

    def catch_up(self, output_token_ids: list[int], request_id: str) -> None:
        if self.num_accepted > len(output_token_ids):
            self.matcher.rollback(self.num_accepted - len(output_token_ids))
            self.num_accepted = len(output_token_ids)
        for token in output_token_ids[self.num_accepted :]:
            if self.matcher.is_terminated():  # the grammar is complete (ignore_eos goes on past its end)
                self.num_accepted = len(output_token_ids)
                return
            if not self.matcher.accept_token(token):
                logger.warning("request %s: token %d breaks its grammar; no longer constrained", request_id, token)
                self.broken = True
                return
            self.num_accepted += 1


class GrammarBackend:
    """One per engine: the xgrammar compiler over the model's vocabulary, the compiled grammars by
    constraint, and the matchers of the constrained requests in the engine."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, eos_token_id: int | None, compile_budget_s: float) -> None:
        import xgrammar

        self._xgr = xgrammar
        stop_ids = [eos_token_id] if eos_token_id is not None else None
        self._info = xgrammar.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=vocab_size,
                                                             stop_token_ids=stop_ids)
        self._compilers = GrammarCompilers(self._info.serialize_json(), compile_budget_s)
        self.vocab_size = vocab_size
        self.cache = CompiledCache()
        self._matchers: dict[str, _Matcher] = {}

    def compile(self, spec: StructuredOutput) -> Any:
        """The compiled grammar of ``spec``, compiled on first use in a compiler process (within its budget);
        ValueError naming what cannot be compiled, CompilersBusy when no compiler came free in time."""
        key = spec.key
        compiled = self.cache.get(key)
        if compiled is not None:
            return compiled
        try:
            serialized = self._compilers.compile(*key)
        except CompileRefused as error:
            raise FieldError(f"structured_output.{spec.kind}", f"structured_output.{spec.kind}: {error}") from None
        compiled = self._xgr.CompiledGrammar.deserialize_json(serialized, self._info)
        self.cache.put(key, compiled, compiled.memory_size_bytes)
        return compiled

    def close(self) -> None:
        """End the compiler processes (they end with this process anyway: they are daemons)."""
        self._compilers.close()

    def constrain(self, logits: torch.Tensor, batch: list[ScheduledRequest]) -> None:
        """Mask the rows of constrained requests in ``logits`` [len(batch), vocab] to what their grammars allow."""
        rows, matchers = [], []
        for row, item in enumerate(batch):
            spec = item.sampling_params.structured_output
            if spec is None:
                continue
            state = self._matchers.get(item.request_id)
            if state is None:
                state = self._matchers[item.request_id] = _Matcher(self._xgr.GrammarMatcher(self.compile(spec)))
            state.catch_up(item.output_token_ids, item.request_id)
            if not state.broken and not state.matcher.is_terminated():
                rows.append(row)
                matchers.append(state.matcher)
        if not rows:
            return
        bitmask = self._xgr.allocate_token_bitmask(len(batch), self.vocab_size)
        for row, matcher in zip(rows, matchers):
            matcher.fill_next_token_bitmask(bitmask, row)
        on_cpu = logits if logits.device.type == "cpu" else logits.cpu()
        self._xgr.apply_token_bitmask_inplace(on_cpu, bitmask, vocab_size=self.vocab_size, indices=rows)
        if on_cpu is not logits:
            logits.copy_(on_cpu)

    def forget(self, request_ids: list[str]) -> None:
        """Drop the matchers of requests that ended."""
        for request_id in request_ids:
            self._matchers.pop(request_id, None)


class LazyGrammarBackend:
    """A GrammarBackend built on the first constrained request: an engine that never sees one never
    imports xgrammar nor builds its token table."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, eos_token_id: int | None, compile_budget_s: float) -> None:
        self._args = (hf_tokenizer, vocab_size, eos_token_id, compile_budget_s)
        self._backend: GrammarBackend | None = None
        self._lock = threading.Lock()

    def _get(self) -> GrammarBackend:
        with self._lock:
            if self._backend is None:
                try:
                    self._backend = GrammarBackend(*self._args)
                except ImportError:
                    raise FieldError("structured_output",
                                     "structured_output: xgrammar is not installed (pip install xgrammar)") from None
            return self._backend

    def compile(self, spec: StructuredOutput) -> Any:
        return self._get().compile(spec)

    def constrain(self, logits: torch.Tensor, batch: list[ScheduledRequest]) -> None:
        self._get().constrain(logits, batch)

    def forget(self, request_ids: list[str]) -> None:
        if self._backend is not None:
            self._backend.forget(request_ids)
