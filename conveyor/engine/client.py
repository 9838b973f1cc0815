"""The one way into an engine for a front end: :class:`EngineClient`, and what it hands back and raises.

The server is written against this protocol only. Two classes implement it: :class:`AsyncEngine` (one engine,
its step loop in a background thread) and :class:`ReplicaSet` (engine replicas on Ray behind a router). What
one of them cannot do is part of the protocol too (``watch`` raises :class:`LiveViewUnavailable` behind a
router), so a caller never asks which of the two it holds.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Protocol

from conveyor.core.request import Request
from conveyor.core.stats import EngineStats
from conveyor.core.structured import StructuredOutput
from conveyor.engine.output import RequestOutput
from conveyor.engine.request_builder import RequestBuilder
from conveyor.engine.tokenizer import Tokenizer


class EngineOverloaded(Exception):
    """The waiting queue is at its limit; the caller should retry later."""


class CompilesOverloaded(EngineOverloaded):
    """Every grammar compiler stayed busy for the compile budget: what holds them is constraints sent to this
    server (a client's own, often), so it is answered as too many requests (429) rather than the server being
    down (503); the caller may retry later."""


class EngineDead(Exception):
    """The step loop stopped (an error, or the server shutting down); the request cannot be served."""


class RequestFailed(Exception):
    """The engine failed on this request (a step that raised, or a request it could not take); the others go on.
    The message is meant for the client: it names what failed, never a trace."""


class LiveViewUnavailable(Exception):
    """This engine has no one scheduler to watch live (replicas: each has its own); the message says so."""


@dataclass(frozen=True, slots=True)
class RequestCounts:
    """Requests since start, by how they ended; ``submitted == finished + aborted + errored + open`` always."""

    submitted: int
    finished: int
    aborted: int
    errored: int
    open: int


class OutputStream(Protocol):
    """One submitted request's outputs as they come; ``close()`` aborts it if it is still open.

    Iteration raises :class:`RequestFailed` or :class:`EngineDead` when the request ends with an error.
    """

    def __aiter__(self) -> OutputStream: ...

    async def __anext__(self) -> RequestOutput: ...

    def close(self) -> None: ...


class EngineClient(Protocol):
    """What a front end may ask of an engine. Facts fixed at start (tokenizer, limits, the request builder) are
    read from any thread; ``submit`` and ``watch`` are called from the event loop that reads their streams."""

    @property
    def tokenizer(self) -> Tokenizer: ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def requests(self) -> RequestBuilder:
        """Turns a prompt and its SamplingParams into a Request this engine takes (see request_builder)."""
        ...

    @property
    def error(self) -> BaseException | None:
        """Set once the engine cannot serve (its loop stopped; no replica is healthy)."""
        ...

    def compile_grammar(self, spec: StructuredOutput) -> None:
        """Compile a constraint before its request is submitted, so a bad one is a 400 naming the field
        (a FieldError); EngineOverloaded when the compilers stay busy. Called from a thread pool."""
        ...

    def submit(self, request: Request, final_only: bool = False) -> OutputStream:
        """Hand over a built request; EngineDead or EngineOverloaded at once, before anything is queued. Its
        stream holds every step's output, or with ``final_only`` each sequence's last one."""
        ...

    def stats(self) -> EngineStats:
        """The queues, KV pools and counters as of the latest step (summed over replicas)."""
        ...

    def request_counts(self) -> RequestCounts:
        """The ledger of requests submitted here, by how they ended."""
        ...

    def health_report(self) -> dict[str, Any] | None:
        """The body of /health beyond its status code; None where there is nothing more to say."""
        ...

    def watch(self) -> AsyncIterator[dict[str, Any]]:
        """The live dashboard's stream (a keyframe, then deltas); LiveViewUnavailable where there is none."""
        ...

    def start(self) -> None: ...

    def begin_shutdown(self, timeout: float) -> None:
        """Refuse new requests now; after ``timeout`` seconds, end the unfinished ones with an error."""
        ...

    def stop(self) -> None: ...
