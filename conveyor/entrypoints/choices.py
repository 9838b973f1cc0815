"""Several prompts in one /v1/completions request: one engine request each, their outputs merged into one
stream of choices, indexed as OpenAI does (prompt by prompt, ``n`` choices each: ``prompt * n + index``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator

from conveyor.core.request import Request
from conveyor.engine import AsyncEngine, RequestOutput

_DONE = object()


def merged_outputs(engine: AsyncEngine, requests: list[Request]) -> AsyncIterator[RequestOutput]:
    """Every output of every request as it comes, with its choice index. The requests run side by side
    in the engine's batch; an error in one (e.g. overload) ends the whole response, and a caller that stops
    listening aborts them all. One request is the engine's own stream."""
    return engine.generate(requests[0]) if len(requests) == 1 else _merged(engine, requests)


async def _merged(engine: AsyncEngine, requests: list[Request]) -> AsyncIterator[RequestOutput]:
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(request: Request, offset: int) -> None:
        try:
            async for output in engine.generate(request):
                queue.put_nowait(dataclasses.replace(output, index=offset + output.index) if offset else output)
        except Exception as error:  # handed to the consumer, which raises it
            queue.put_nowait(error)
        finally:
            queue.put_nowait(_DONE)

    n = requests[0].sampling_params.n
    tasks = [asyncio.create_task(pump(request, i * n)) for i, request in enumerate(requests)]
    num_open = len(tasks)
    try:
        while num_open:
            item = await queue.get()
            if item is _DONE:
                num_open -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
