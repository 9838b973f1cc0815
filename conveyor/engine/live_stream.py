"""The live dashboard's stream: the loop thread publishes deltas, each watcher reads them at its own pace.

Recording costs nothing while nobody watches: the first watcher starts the
engine's live recorder, the last one to leave stops it. The loop thread sends
a delta at most every ``min_interval`` seconds (steps in between are coalesced
by the recorder); a watcher that has not read its previous delta yet gets the
new one folded into it, so a slow browser never slows the engine or piles up
messages. Only the loop thread calls ``LiveStream``; watchers read from asyncio.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from conveyor.engine.llm_engine import Engine
from conveyor.observe.live import LiveRecorder, merge_deltas


class Watcher:
    """One dashboard's inbox: at most one unread delta, into which newer ones are merged."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._ready = asyncio.Event()
        self._lock = threading.Lock()
        self._unread: dict[str, Any] | None = None
        self.needs_keyframe = False  # fell too far behind: the loop thread sends a fresh keyframe instead

    def push(self, delta: dict[str, Any]) -> None:
        """Called by the loop thread."""
        with self._lock:
            if self._unread is None or delta["keyframe"]:
                self._unread = dict(delta)  # a copy of its own: merging changes the top level only
            elif not merge_deltas(self._unread, delta):
                self.needs_keyframe = True
                return
        self._loop.call_soon_threadsafe(self._ready.set)

    async def next(self) -> dict[str, Any]:
        """The next (possibly merged) delta; waits for one."""
        while True:
            await self._ready.wait()
            self._ready.clear()
            with self._lock:
                delta, self._unread = self._unread, None
            if delta is not None:
                return delta


class LiveStream:
    """The watchers of one engine, fed from its loop thread."""

    def __init__(self, engine: Engine, show_text: bool = False) -> None:
        self._engine = engine
        self._show_text = show_text
        self._watchers: list[Watcher] = []
        self._recorder: LiveRecorder | None = None

    def add(self, watcher: Watcher) -> None:
        if self._recorder is None:
            self._recorder = self._engine.start_live(self._show_text)
        self._watchers.append(watcher)
        watcher.push(self._recorder.keyframe())

    def remove(self, watcher: Watcher) -> None:
        if watcher in self._watchers:
            self._watchers.remove(watcher)
        if not self._watchers and self._recorder is not None:
            self._engine.stop_live()
            self._recorder = None

    def publish(self, idle: bool = False) -> None:
        """After a step (or when the engine goes idle, so the last step's outcome is shown): send what is due."""
        recorder = self._recorder
        if recorder is None:
            return
        if recorder.due() or (idle and recorder.has_pending()):
            delta = recorder.flush()
            for watcher in self._watchers:
                if watcher.needs_keyframe:
                    watcher.needs_keyframe = False
                    watcher.push(recorder.keyframe())
                else:
                    watcher.push(delta)
