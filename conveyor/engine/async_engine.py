"""The engine's step loop in a background thread, fed and read from asyncio.

The loop thread is the only one that touches the engine. Callers hand it
requests and aborts through a queue; it applies them between steps (never in
the middle of one), runs a step, and passes each output to the asyncio queue
of the request it belongs to, so every token reaches its stream as soon as
its step ends. A caller that goes away (a client disconnect) aborts its
request: it leaves the batch at the next step and its blocks return at once.

Every submitted request ends exactly once, in one of three ways, counted in
:meth:`AsyncEngine.request_counts`: finished (its last output was delivered),
aborted (its caller stopped listening) or errored (the engine failed on it,
could not take it, or stopped). A step that raises ends only its own requests
(see :mod:`conveyor.core.engine_core`); if the loop itself cannot go on, every
open request gets :class:`EngineDead` and ``on_fatal`` is called, so that the
process can exit and be restarted (crash-only).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from conveyor.core.burst import first_step_at
from conveyor.core.request import Request
from conveyor.core.stats import EngineStats
from conveyor.core.structured import StructuredOutput
from conveyor.engine.client import CompilesOverloaded, EngineDead, EngineOverloaded, RequestCounts, RequestFailed
from conveyor.engine.live_stream import LiveStream, Watcher
from conveyor.engine.llm_engine import Engine
from conveyor.engine.output import RequestOutput
from conveyor.engine.request_builder import RequestBuilder
from conveyor.engine.tokenizer import Tokenizer
from conveyor.executor.compute_threads import release_openmp_pool
from conveyor.executor.grammar_compilers import CompilersBusy

logger = logging.getLogger("conveyor.engine.async_engine")
OUTCOMES = ("finished", "aborted", "errored")


class _CallerGone(Exception):
    """Put in a request's queue when its caller closes the stream, to wake a reader still waiting on it."""


@dataclass(slots=True)
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    num_open: int = 1  # sequences not finished yet (n of them, for a request with n > 1)
    final_only: bool = False  # its reader wants each sequence's last output alone (a response not streamed)


class RequestStream:
    """One submitted request's outputs, as an async iterator; ``close()`` aborts the request if it is still open.

    Iteration raises :class:`RequestFailed` or :class:`EngineDead` when the request ends with an error, and
    stops after the last sequence's final output.
    """

    def __init__(self, engine: AsyncEngine, request_id: str, stream: _Stream) -> None:
        self.request_id = request_id
        self._engine, self._stream = engine, stream
        self._num_open = stream.num_open
        self.done = False  # the request ended (finished, errored or closed): nothing more will come

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.done:
            raise StopAsyncIteration
        item = await self._stream.queue.get()
        if isinstance(item, _CallerGone):
            self.done = True
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            self.done = True
            raise item
        self._num_open -= item.finished
        self.done = self._num_open == 0
        return item

    def close(self) -> None:
        """The caller is done listening: abort the request if it is still open (its blocks return at once)."""
        if not self.done:
            self.done = True
            self._engine._caller_gone(self.request_id, self._stream)


class AsyncEngine:
    """One engine behind the server: an :class:`~conveyor.engine.client.EngineClient` whose step loop runs in a
    background thread (see the module's docstring)."""

    def __init__(
        self,
        engine: Engine,
        max_waiting_requests: int = 1024,
        on_step: Callable[[EngineStats, list[RequestOutput]], None] | None = None,
        live_show_text: bool = False,
        on_fatal: Callable[[BaseException], None] | None = None,
    ) -> None:
        self._engine = engine
        self._live = LiveStream(engine, live_show_text)  # the dashboards watching; touched by the loop thread only
        self.max_waiting_requests = max_waiting_requests
        self._on_step = on_step
        self.on_fatal = on_fatal  # called once, from the loop thread, after every open request was failed
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._outcomes: Counter[str] = Counter()
        self._num_submitted = 0
        self._num_pending = 0  # added by callers, not yet taken in by the loop
        self._pending_load = (0, 0)  # their sequences and tokens, which admission control counts as queued
        scheduler = engine.core.scheduler
        self._scheduler = scheduler  # read here only for its immutable rules and pure judgement (refusal)
        self._admission_view = scheduler.admission_view() if scheduler.admission.active else None
        # Guards the streams, the counts and ``error``: a request is either registered before the loop
        # fails (and then failed by it) or refused, never left unanswered.
        self._lock = threading.Lock()
        self._stopping = False
        self.draining = False  # shutting down: no new requests
        self.error: BaseException | None = None
        self._stats = engine.stats()  # published by the loop thread between steps; read from any thread
        self._burst_wait_s = engine.config.burst_wait_ms / 1000
        self._latest_submit = 0.0  # time.monotonic() of the latest request submitted (see _await_burst)
        self._thread = threading.Thread(target=self._run, name="conveyor-engine", daemon=True)

    def start(self) -> None:
        """Start the loop thread. Call from the thread that built the engine: it gives its OpenMP workers back,
        so that the loop thread's are the only ones (see conveyor.executor.compute_threads)."""
        release_openmp_pool()
        self._thread.start()

    def stop(self) -> None:
        """Stop the loop; a request still open then ends with EngineDead."""
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout=10)
        self._fail_all(EngineDead("the server is shutting down"))

    @property
    def num_unfinished(self) -> int:
        return len(self._streams)

    def request_counts(self) -> RequestCounts:
        with self._lock:
            o = self._outcomes
            return RequestCounts(self._num_submitted, o["finished"], o["aborted"], o["errored"], len(self._streams))

    # ----- what the server may use: fixed at start-up, or a frozen snapshot ----

    @property
    def tokenizer(self) -> Tokenizer:
        return self._engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self._engine.max_model_len

    @property
    def vocab_size(self) -> int:
        return self._engine.model_config.vocab_size

    @property
    def requests(self) -> RequestBuilder:
        """The engine's own builder: it touches no engine state, so the server's threads may use it."""
        return self._engine.requests

    def compile_grammar(self, spec: StructuredOutput) -> None:
        """Compile ``spec``'s grammar into the engine's cache, so that ``add_request`` finds it there: the server
        calls this from a pool of its own, and a slow compile never holds up the tokenizer's. ValueError naming
        what cannot be compiled (or not within the budget); CompilesOverloaded when the compilers stay busy."""
        try:
            self._engine.grammars.compile(spec)
        except CompilersBusy as error:
            raise CompilesOverloaded(str(error)) from None

    def stats(self) -> EngineStats:
        """The engine's state as of the latest step, without waiting for the loop thread."""
        return self._stats

    def health_report(self) -> dict | None:
        """Nothing beyond /health's status code for one engine (replicas behind a router report each one)."""
        return None

    def submit(self, request: Request, final_only: bool = False) -> RequestStream:
        """Hand ``request`` (built by ``requests``) to the loop; its outputs as a stream: every step's, or with
        ``final_only`` each sequence's last (outputs are cumulative, so a reader that answers whole loses
        nothing, and its event loop is not woken once a step for nothing).

        Raises EngineDead or EngineOverloaded at once, before anything is queued. Call from the event loop
        that will read the stream, and close the stream when done with it (``finally: stream.close()``).
        """
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue(), request.sampling_params.n, final_only)
        with self._lock:
            if self.error is not None:
                raise EngineDead("the engine stopped after an internal error; the server is restarting")
            if self.draining or self._stopping:
                raise EngineOverloaded("the server is shutting down")
            waiting = self._stats.num_waiting + self._num_pending
            if waiting >= self.max_waiting_requests:
                raise EngineOverloaded(f"{waiting} requests are waiting, the limit is {self.max_waiting_requests}")
            if self._admission_view is not None:  # judged here, at once, on the queue as of the latest step
                refused = self._scheduler.refusal(request, self._admission_view, self._pending_load)
                if refused is not None:
                    raise refused
            if request.request_id in self._streams:
                raise ValueError(f"request_id {request.request_id!r} is already in the engine")
            self._num_pending += 1
            self._pending_load = _plus(self._pending_load, request, 1)
            self._num_submitted += 1
            self._streams[request.request_id] = stream
        self._latest_submit = time.monotonic()
        self._commands.put(("add", request))
        self._wake.set()
        return RequestStream(self, request.request_id, stream)

    async def generate(self, request: Request, final_only: bool = False) -> AsyncIterator[RequestOutput]:
        """``submit`` as an async generator: the request's outputs as they come; leaving early aborts it."""
        stream = self.submit(request, final_only)
        try:
            async for output in stream:
                yield output
        finally:
            stream.close()

    def watch(self) -> AsyncIterator[dict[str, Any]]:
        """The live dashboard's stream: a keyframe, then deltas at most 10 a second (see ``conveyor.observe.live``)."""
        return self._watch()

    async def _watch(self) -> AsyncIterator[dict[str, Any]]:
        watcher = Watcher(asyncio.get_running_loop())
        self._commands.put(("watch", watcher))
        self._wake.set()
        try:
            while not self.draining and self.error is None:  # a shutdown ends the stream, or it would hold it up
                try:
                    yield await asyncio.wait_for(watcher.next(), timeout=1.0)
                except TimeoutError:
                    continue
        finally:
            self._commands.put(("unwatch", watcher))
            self._wake.set()

    def abort(self, request_id: str) -> None:
        """Abort a request by id (its caller counts it as aborted if it was still open)."""
        stream = self._streams.get(request_id)
        if stream is not None:
            self._caller_gone(request_id, stream)

    def begin_shutdown(self, timeout: float) -> None:
        """Refuse new requests now; after ``timeout`` seconds, end the unfinished ones with an error."""
        self.draining = True
        timer = threading.Timer(timeout, lambda: (self._commands.put(("fail_all", None)), self._wake.set()))
        timer.daemon = True
        timer.start()

    # ----- ending a request: each path pops its stream under the lock, so only one of them counts it ----

    def _close(self, request_id: str, outcome: str, stream: _Stream | None = None) -> _Stream | None:
        with self._lock:
            current = self._streams.get(request_id)
            if current is None or (stream is not None and current is not stream):
                return None
            del self._streams[request_id]
            self._outcomes[outcome] += 1
            return current

    def _caller_gone(self, request_id: str, stream: _Stream) -> None:
        if self._close(request_id, "aborted", stream) is not None:
            self._commands.put(("abort", request_id))
            self._wake.set()
            _put(stream, _CallerGone())

    def _fail(self, request_id: str, error: BaseException) -> None:
        stream = self._close(request_id, "errored")
        if stream is not None:
            _put(stream, error)

    def _fail_all(self, error: BaseException) -> None:
        for request_id in list(self._streams):
            self._fail(request_id, error)

    # ----- the loop thread ----------------------------------------------------

    def _run(self) -> None:
        try:
            idle = True
            while not self._stopping:
                self._apply_commands()
                if not self._engine.has_unfinished_requests():
                    self._live.publish(idle=True)
                    self._report([])  # let gauges settle after aborts
                    self._wake.wait(timeout=0.5)
                    self._wake.clear()
                    idle = True
                    continue
                if idle:  # the first step after a pause: the rest of a burst joins it
                    idle = False
                    self._await_burst()
                    continue
                outputs = self._engine.step()
                self._stats = self._engine.stats()
                self._publish_admission_view()
                self._deliver_all(outputs)
                self._report(outputs)
                self._live.publish()
        except BaseException as error:  # the loop must report whatever stopped it
            logger.exception("the engine loop stopped; every open request ends with an error")
            with self._lock:
                self.error = error
            self._fail_all(EngineDead("the engine stopped after an internal error; the server is restarting"))
            if self.on_fatal is not None:
                try:
                    self.on_fatal(error)
                except Exception:
                    logger.exception("on_fatal failed")

    def _await_burst(self) -> None:
        """Sleep until no request has been submitted for ``--burst-wait-ms`` (at most BURST_WAIT_CAP such waits):
        requests sent at once reach the engine over a few milliseconds (conveyor.core.burst)."""
        start = time.monotonic()
        while not self._stopping:
            remaining = first_step_at(start, self._latest_submit, self._burst_wait_s) - time.monotonic()
            if remaining <= 0:
                return
            self._wake.wait(timeout=remaining)
            self._wake.clear()

    def _report(self, outputs: list[RequestOutput]) -> None:
        if self._on_step is None:
            return
        try:
            self._on_step(self._stats, outputs)
        except Exception:  # a metrics bug must not stop the engine
            logger.exception("on_step failed")

    def _apply_commands(self) -> None:
        num_added, taken = 0, (0, 0)
        while True:
            try:
                command, value = self._commands.get_nowait()
            except queue.Empty:
                break
            if command == "add":
                num_added += 1
                taken = _plus(taken, value, 1)
                if value.request_id not in self._streams:
                    continue  # its caller left before the loop took it in
                try:
                    self._engine.add_request(value, check_admission=False)  # judged in submit
                except Exception as error:  # this request cannot be served; the others can
                    logger.warning("request %s refused by the engine: %s", value.request_id, error)
                    self._fail(value.request_id, RequestFailed(f"the engine could not take the request: {error}"))
            elif command == "abort":
                self._engine.abort_request(value)
            elif command == "watch":
                self._live.add(value)
            elif command == "unwatch":
                self._live.remove(value)
            else:  # fail_all: the shutdown timeout passed
                for request_id in list(self._streams):
                    self._engine.abort_request(request_id)
                self._fail_all(EngineDead("the server is shutting down"))
        # One lock for both: a caller never sees a request counted twice (pending and waiting) or not at all.
        with self._lock:
            self._num_pending -= num_added
            self._pending_load = _plus(self._pending_load, taken, -1)
            self._stats = self._engine.stats()
            self._publish_admission_view()

    def _publish_admission_view(self) -> None:
        """The queue as admission control in ``submit`` reads it (only where admission control is on)."""
        if self._admission_view is not None:
            self._admission_view = self._scheduler.admission_view()

    def _deliver_all(self, outputs: list[RequestOutput]) -> None:
        """Hand a step's outputs to their readers: one wake-up per event loop for the whole step, not one per
        output (each wake-up takes the GIL, and a core, from the next step)."""
        batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestOutput]]] = {}
        for output in outputs:
            stream = self._to_deliver(output)
            if stream is not None:
                batches.setdefault(stream.loop, []).append((stream.queue, output))
        for loop, items in batches.items():
            with contextlib.suppress(RuntimeError):  # its event loop is closed: nobody is reading any more
                loop.call_soon_threadsafe(_put_each, items)

    def _to_deliver(self, output: RequestOutput) -> _Stream | None:
        """The stream ``output`` goes to, None where it goes nowhere: its caller left, its request failed (the
        error goes at once), or its reader wants final outputs only and this is not one."""
        request_id = output.request_id
        if output.error is not None:
            self._fail(request_id, RequestFailed(output.error))
            return None
        stream = self._streams.get(request_id)
        if stream is None:
            return None  # aborted by its caller, or already ended
        if output.finished:
            stream.num_open -= 1
            if stream.num_open == 0 and self._close(request_id, "finished", stream) is None:
                return None
        elif stream.final_only:
            return None
        return stream


def _plus(load: tuple[int, int], what: Request | tuple[int, int], sign: int) -> tuple[int, int]:
    """``load`` (sequences, tokens) with a request's (n sequences of its tokens each), or another load, added
    (``sign`` 1) or taken away (-1)."""
    if isinstance(what, Request):
        n = what.sampling_params.n
        what = (n, n * what.num_tokens)
    return load[0] + sign * what[0], load[1] + sign * what[1]


def _put_each(items: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    for queue_, output in items:
        queue_.put_nowait(output)


def _put(stream: _Stream, item: RequestOutput | BaseException) -> None:
    """Hand an item to the stream's reader, from any thread."""
    with contextlib.suppress(RuntimeError):  # its event loop is closed: nobody is reading any more
        stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)
