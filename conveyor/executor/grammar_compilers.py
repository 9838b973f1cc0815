"""Grammar compiles in processes of their own, each given a time budget.

A compile is C++ that no thread can interrupt: a thread that waits past the budget can give up waiting,
but the compile goes on using a core, and a few such compiles hold every thread of a pool. A process can
be ended. So each compile runs in one of a few compiler processes (xgrammar over the model's token table),
and the compiled grammar comes back serialized; a compile past its budget ends its process, which is started
again for the next one. The pool is bounded: a request finds a free compiler within the budget, or is told
the compilers are busy.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import queue
import re
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from conveyor.executor.faults import grammar_hang_marker

logger = logging.getLogger("conveyor.grammar")

NUM_COMPILERS = 2  # compiler processes: at most this many compiles at once
_START_TIMEOUT_S = 120.0  # a compiler process starting (it imports xgrammar, which imports torch)

# The characters of a JSON string as xgrammar writes them in EBNF: for a string with a maxLength, and for
# one without (which, as JSON requires, excludes the control characters U+0000-U+001F).
_BOUNDED_STRING_CHAR = r"[^\"\\\r\n]"
_JSON_STRING_CHAR = r"[^\0-\x1f\"\\\r\n]"


class CompileRefused(ValueError):
    """The constraint cannot be compiled (a bad schema or regex), or not within the budget."""


class CompilersBusy(RuntimeError):
    """No compiler came free within the budget: every one is compiling someone else's grammar."""


def compile_source(xgrammar: Any, compiler: Any, kind: str, source: str) -> Any:
    """``source`` (a JSON schema's text, a regex, or a JSON list of choices) compiled by ``compiler``."""
    if kind in ("json", "json_object"):
        grammar = str(xgrammar.Grammar.from_json_schema(source or '{"type": "object"}', any_whitespace=False))
        # xgrammar lets a string with a maxLength hold raw control characters (its unbounded strings do not),
        # which JSON forbids; its character class gets the same exclusion as the unbounded one's.
        return compiler.compile_grammar(grammar.replace(_BOUNDED_STRING_CHAR, _JSON_STRING_CHAR))
    if kind == "regex":
        return compiler.compile_regex(source)
    alternatives = " | ".join(json.dumps(choice, ensure_ascii=False) for choice in json.loads(source))
    return compiler.compile_grammar(f"root ::= {alternatives}")


def client_reason(error: BaseException) -> str:
    """xgrammar's message without its "[time] source-file:line: " prefix: the client needs the reason only."""
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", first)


def serve_compiles(connection: Connection, tokenizer_info_json: str) -> None:
    """A compiler process's loop: (kind, source) in, ("ok", serialized grammar) or ("error", reason) out."""
    import xgrammar

    info = xgrammar.TokenizerInfo.deserialize_json(tokenizer_info_json)
    compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)  # the caller caches
    hang_marker = grammar_hang_marker()  # a test's compile bomb (see conveyor.executor.faults)
    connection.send("ready")
    while True:
        try:
            kind, source = connection.recv()
        except EOFError:  # the engine's process ended
            return
        if hang_marker and hang_marker in source:
            time.sleep(3600)
        try:
            connection.send(("ok", compile_source(xgrammar, compiler, kind, source).serialize_json()))
        except Exception as error:  # xgrammar reports a bad schema or regex as a RuntimeError (or a ValueError)
            connection.send(("error", client_reason(error)))


@dataclass(slots=True)
class _Compiler:
    """One compiler process and its end of the pipe; started on first use, and again after it was ended."""

    tokenizer_info_json: str
    process: Any = None
    connection: Connection | None = None

    def compile(self, kind: str, source: str, budget_s: float) -> tuple[str, str]:
        if self.process is None or not self.process.is_alive():
            self._start()
        assert self.connection is not None
        self.connection.send((kind, source))
        if self.connection.poll(budget_s):
            return self.connection.recv()
        self._end()
        raise CompileRefused(f"compiling took longer than the budget of {budget_s:g} s and was abandoned; "
                             "simplify the constraint")

    def _start(self) -> None:
        context = multiprocessing.get_context("spawn")  # not fork: the engine's process runs threads (torch, ...)
        ours, theirs = context.Pipe()
        self.process = context.Process(target=serve_compiles, args=(theirs, self.tokenizer_info_json),
                                       name="conveyor-grammar", daemon=True)
        self.process.start()
        theirs.close()
        if not ours.poll(_START_TIMEOUT_S) or ours.recv() != "ready":
            raise RuntimeError("a grammar compiler process did not start")
        self.connection = ours

    def _end(self) -> None:
        logger.warning("a grammar compile ran past its budget: its compiler process is ended")
        self.process.kill()
        self.process.join(timeout=10)
        if self.connection is not None:
            self.connection.close()
        self.process = self.connection = None

    def close(self) -> None:
        if self.process is not None and self.process.is_alive():
            self.process.kill()


class GrammarCompilers:
    """A bounded pool of compiler processes; ``compile`` blocks its calling thread (waiting on a pipe, which
    holds no core) until the grammar comes back, the budget runs out, or no compiler comes free in time."""

    def __init__(self, tokenizer_info_json: str, budget_s: float, num_compilers: int = NUM_COMPILERS) -> None:
        """``budget_s``: a compile still running after this is abandoned (its process ended) and refused, and
        a compile that waits this long for a free compiler is told they are busy (the engine's
        ``grammar_compile_timeout_ms``)."""
        self.budget_s = budget_s
        self._idle: queue.Queue[_Compiler] = queue.Queue()
        self._all = [_Compiler(tokenizer_info_json) for _ in range(num_compilers)]
        for compiler in self._all:
            self._idle.put(compiler)

    def compile(self, kind: str, source: str) -> str:
        """The serialized compiled grammar; CompileRefused with the reason, or CompilersBusy."""
        try:
            compiler = self._idle.get(timeout=self.budget_s)
        except queue.Empty:
            raise CompilersBusy(f"all {len(self._all)} grammar compilers stayed busy for {self.budget_s:g} s") from None
        try:
            status, payload = compiler.compile(kind, source, self.budget_s)
        finally:
            self._idle.put(compiler)
        if status != "ok":
            raise CompileRefused(f"cannot be compiled: {payload}")
        return payload

    def close(self) -> None:
        for compiler in self._all:
            compiler.close()
