"""Structured output through xgrammar: grammars compiled once per constraint, a matcher per request, and
each step's constrained rows masked to the tokens their grammar allows.

A matcher is kept in step with its request's output lazily: before its row is masked, it accepts the
output tokens it has not seen (or rolls back any it saw that the output no longer holds). So whatever
happened between two steps (a preemption and recompute, a swap, a stop string ending the text) the
matcher's state is that of the output so far, and a request is never advanced twice by one token.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from dataclasses import dataclass
from typing import Any

import torch

from conveyor.core.scheduler.output import ScheduledRequest
from conveyor.core.structured import StructuredOutput

logger = logging.getLogger("conveyor.grammar")

# The characters of a JSON string as xgrammar writes them in EBNF: for a string with a maxLength, and for
# one without (which, as JSON requires, excludes the control characters U+0000-U+001F).
_BOUNDED_STRING_CHAR = r"[^\"\\\r\n]"
_JSON_STRING_CHAR = r"[^\0-\x1f\"\\\r\n]"


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

    def __init__(self, hf_tokenizer: Any, vocab_size: int, eos_token_id: int | None) -> None:
        import xgrammar

        self._xgr = xgrammar
        stop_ids = [eos_token_id] if eos_token_id is not None else None
        info = xgrammar.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=vocab_size, stop_token_ids=stop_ids)
        self._compiler = xgrammar.GrammarCompiler(info, max_threads=2)
        self.vocab_size = vocab_size
        self._compiled: dict[tuple[str, str], Any] = {}
        self._lock = threading.Lock()  # compile() is called from the server's thread and the engine's
        self._matchers: dict[str, _Matcher] = {}

    def compile(self, spec: StructuredOutput) -> Any:
        """The compiled grammar of ``spec``, compiled on first use; ValueError naming what cannot be compiled."""
        key = spec.key
        with self._lock:
            compiled = self._compiled.get(key)
        if compiled is not None:
            return compiled
        try:
            compiled = self._compile(spec)
        except Exception as error:  # xgrammar reports a bad schema or regex as a RuntimeError (or a ValueError)
            # Drop xgrammar's "[time] source-file:line: " prefix: the client needs the reason only.
            reason = re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", str(error).strip().splitlines()[0])
            raise ValueError(f"structured_output.{spec.kind}: cannot be compiled: {reason}") from None
        with self._lock:
            self._compiled[key] = compiled
        return compiled

    def _compile(self, spec: StructuredOutput) -> Any:
        kind, compiler = spec.kind, self._compiler
        if kind in ("json", "json_object"):
            schema = json.dumps(spec.json) if kind == "json" else '{"type": "object"}'
            grammar = str(self._xgr.Grammar.from_json_schema(schema, any_whitespace=False))
            # xgrammar lets a string with a maxLength hold raw control characters (its unbounded strings do
            # not), which JSON forbids; its character class gets the same exclusion as the unbounded one's.
            return compiler.compile_grammar(grammar.replace(_BOUNDED_STRING_CHAR, _JSON_STRING_CHAR))
        if kind == "regex":
            return compiler.compile_regex(spec.regex)
        alternatives = " | ".join(json.dumps(choice, ensure_ascii=False) for choice in spec.choice or ())
        return compiler.compile_grammar(f"root ::= {alternatives}")

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

    def __init__(self, hf_tokenizer: Any, vocab_size: int, eos_token_id: int | None) -> None:
        self._args = (hf_tokenizer, vocab_size, eos_token_id)
        self._backend: GrammarBackend | None = None
        self._lock = threading.Lock()

    def _get(self) -> GrammarBackend:
        with self._lock:
            if self._backend is None:
                try:
                    self._backend = GrammarBackend(*self._args)
                except ImportError:
                    raise ValueError("structured_output: xgrammar is not installed (pip install xgrammar)") from None
            return self._backend

    def compile(self, spec: StructuredOutput) -> Any:
        return self._get().compile(spec)

    def constrain(self, logits: torch.Tensor, batch: list[ScheduledRequest]) -> None:
        self._get().constrain(logits, batch)

    def forget(self, request_ids: list[str]) -> None:
        if self._backend is not None:
            self._backend.forget(request_ids)
