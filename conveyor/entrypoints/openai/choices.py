"""Several prompts in one /v1/completions request: one engine request each, their outputs merged into one
stream of choices, indexed as OpenAI does (prompt by prompt, ``n`` choices each: ``prompt * n + index``).
"""

from __future__ import annotations

import asyncio
import dataclasses

from conveyor.core.request import Request
from conveyor.engine import EngineClient, OutputStream, RequestOutput

_DONE = object()


def open_streams(engine: EngineClient, requests: list[Request], final_only: bool = False) -> OutputStream:
    """Submit every request (all or none: if one is refused, those already in are aborted) and return their
    outputs as one stream (with ``final_only``, each sequence's last output alone: for an answer sent whole).
    One request is the engine's own stream."""
    streams: list[OutputStream] = []
    try:
        for request in requests:
            streams.append(engine.submit(request, final_only))
    except BaseException:
        for stream in streams:
            stream.close()
        raise
    return streams[0] if len(streams) == 1 else _Merged(streams, requests[0].sampling_params.n)


class _Merged:
    """The outputs of several streams as they come, each choice's index offset by its prompt's place. An
    error in one ends the whole response; ``close()`` closes them all."""

    def __init__(self, streams: list[OutputStream], n: int) -> None:
        self._streams = streams
        self._queue: asyncio.Queue = asyncio.Queue()
        self._tasks = [asyncio.create_task(self._pump(stream, i * n)) for i, stream in enumerate(streams)]
        self._num_open = len(streams)

    async def _pump(self, stream: OutputStream, offset: int) -> None:
        try:
            async for output in stream:
                self._queue.put_nowait(dataclasses.replace(output, index=offset + output.index) if offset else output)
        except Exception as error:  # handed to the reader, which raises it
            self._queue.put_nowait(error)
        finally:
            self._queue.put_nowait(_DONE)

    def __aiter__(self) -> _Merged:
        return self

    async def __anext__(self) -> RequestOutput:
        while self._num_open:
            item = await self._queue.get()
            if item is _DONE:
                self._num_open -= 1
            elif isinstance(item, Exception):
                self.close()
                raise item
            else:
                return item
        raise StopAsyncIteration

    def close(self) -> None:
        for stream in self._streams:
            stream.close()
        for task in self._tasks:
            task.cancel()
