"""The engine's step loop in a background thread, fed and read from asyncio.

The loop thread is the only one that touches the engine. Callers hand it
requests and aborts through a queue; it applies them between steps (never in
the middle of one), runs a step, and passes each output to the asyncio queue
of the request it belongs to, so every token reaches its stream as soon as
its step ends. A caller that goes away (a client disconnect) aborts its
request: it leaves the batch at the next step and its blocks return at once.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from conveyor.core.request import Request
from conveyor.core.stats import EngineStats
from conveyor.engine.live_stream import LiveStream, Watcher
from conveyor.engine.llm_engine import Engine
from conveyor.engine.output import RequestOutput
from conveyor.engine.tokenizer import Tokenizer

logger = logging.getLogger("conveyor.engine.async_engine")


class EngineOverloaded(Exception):
    """The waiting queue is at its limit; the caller should retry later."""


class EngineDead(Exception):
    """The step loop stopped (an error, or the server shutting down); the request cannot be served."""


@dataclass(slots=True)
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    num_open: int = 1  # sequences not finished yet (n of them, for a request with n > 1)


class AsyncEngine:
    def __init__(
        self,
        engine: Engine,
        max_waiting_requests: int = 1024,
        on_step: Callable[[EngineStats, list[RequestOutput]], None] | None = None,
        live_show_text: bool = False,
    ) -> None:
        self._engine = engine
        self._live = LiveStream(engine, live_show_text)  # the dashboards watching; touched by the loop thread only
        self.max_waiting_requests = max_waiting_requests
        self._on_step = on_step
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._num_pending = 0  # added by callers, not yet taken in by the loop
        self._lock = threading.Lock()
        self._stopping = False
        self.draining = False  # shutting down: no new requests
        self.error: BaseException | None = None
        self._stats = engine.stats()  # published by the loop thread between steps; read from any thread
        self._thread = threading.Thread(target=self._run, name="conveyor-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout=10)

    @property
    def num_unfinished(self) -> int:
        return len(self._streams)

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

    def make_request(self, *args, **kwargs) -> Request:
        """Tokenize and check a request (see ``Engine.make_request``); touches no engine state."""
        return self._engine.make_request(*args, **kwargs)

    def stats(self) -> EngineStats:
        """The engine's state as of the latest step, without waiting for the loop thread."""
        return self._stats

    def health_report(self) -> dict | None:
        """Nothing beyond /health's status code for one engine (replicas behind a router report each one)."""
        return None

    async def generate(self, request: Request) -> AsyncIterator[RequestOutput]:
        """Submit ``request`` (already checked by ``Engine.make_request``) and yield its outputs as they come."""
        if self.error is not None:
            raise EngineDead(str(self.error))
        if self.draining:
            raise EngineOverloaded("the server is shutting down")
        with self._lock:
            waiting = self._stats.num_waiting + self._num_pending
            if waiting >= self.max_waiting_requests:
                raise EngineOverloaded(f"{waiting} requests are waiting, the limit is {self.max_waiting_requests}")
            self._num_pending += 1
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue(), request.sampling_params.n)
        self._streams[request.request_id] = stream
        self._commands.put(("add", request))
        self._wake.set()
        num_open, finished = request.sampling_params.n, False
        try:
            while not finished:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                num_open -= item.finished
                finished = num_open == 0
                yield item
        finally:
            if not finished:  # the caller stopped listening: free the request's slot and memory
                self.abort(request.request_id)

    async def watch(self) -> AsyncIterator[dict[str, Any]]:
        """The live dashboard's stream: a keyframe, then deltas at most 10 a second (see ``conveyor.core.live``)."""
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
        self._commands.put(("abort", request_id))
        self._wake.set()

    def begin_shutdown(self, timeout: float) -> None:
        """Refuse new requests now; after ``timeout`` seconds, end the unfinished ones with an error."""
        self.draining = True
        timer = threading.Timer(timeout, lambda: (self._commands.put(("fail_all", None)), self._wake.set()))
        timer.daemon = True
        timer.start()

    # ----- the loop thread ----------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stopping:
                self._apply_commands()
                if not self._engine.has_unfinished_requests():
                    self._live.publish(idle=True)
                    if self._on_step is not None:
                        self._on_step(self._stats, [])  # let gauges settle after aborts
                    self._wake.wait(timeout=0.5)
                    self._wake.clear()
                    continue
                outputs = self._engine.step()
                self._stats = self._engine.stats()
                for output in outputs:
                    self._deliver(output.request_id, output)
                if self._on_step is not None:
                    self._on_step(self._stats, outputs)
                self._live.publish()
        except BaseException as error:  # the loop must report whatever stopped it
            logger.exception("the engine loop stopped")
            self.error = error
            for request_id in list(self._streams):
                self._deliver(request_id, EngineDead(f"the engine stopped: {error!r}"))

    def _apply_commands(self) -> None:
        num_added = 0
        while True:
            try:
                command, value = self._commands.get_nowait()
            except queue.Empty:
                break
            if command == "add":
                num_added += 1
                try:
                    self._engine.add_request(value)
                except ValueError as error:  # e.g. a request id already in use
                    self._deliver(value.request_id, error)
            elif command == "abort":
                self._engine.abort_request(value)
                self._streams.pop(value, None)
            elif command == "watch":
                self._live.add(value)
            elif command == "unwatch":
                self._live.remove(value)
            else:  # fail_all: the shutdown timeout passed
                for request_id in list(self._streams):
                    self._engine.abort_request(request_id)
                    self._deliver(request_id, EngineDead("the server is shutting down"))
        # One lock for both: a caller never sees a request counted twice (pending and waiting) or not at all.
        with self._lock:
            self._num_pending -= num_added
            self._stats = self._engine.stats()

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        stream = self._streams.get(request_id)
        if stream is None:
            return
        if not isinstance(item, BaseException) and item.finished:
            stream.num_open -= 1
        if isinstance(item, BaseException) or stream.num_open == 0:
            del self._streams[request_id]
        stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)
