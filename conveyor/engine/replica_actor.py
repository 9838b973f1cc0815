"""One engine replica: the engine and its background loop inside a Ray actor process.

The front end (:mod:`conveyor.engine.replicas`) tokenizes and routes; a replica only runs
requests. ``generate`` is an async generator, so Ray streams each output back as its step ends;
cancelling the stream (a client that hung up) cancels the generator, whose cleanup aborts the
request in the engine, so its slot and blocks return at once.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import AsyncIterator
from typing import Any

from conveyor.core.config import EngineConfig
from conveyor.core.request import Request
from conveyor.core.stats import EngineStats
from conveyor.engine.async_engine import AsyncEngine
from conveyor.engine.llm_engine import Engine
from conveyor.engine.output import RequestOutput


class EngineReplica:
    """The actor's class (Ray wraps it with ``ray.remote``); a restarted replica runs ``__init__`` again."""

    def __init__(self, config: EngineConfig, max_waiting_requests: int) -> None:
        """``config.num_threads``: the replica's share of the cores (the engine sets its threads from it)."""
        self._engine = Engine(config)
        self._async_engine = AsyncEngine(self._engine, max_waiting_requests)
        self._async_engine.start()
        self._started = time.time()

    async def describe(self) -> dict[str, Any]:
        """What the front end needs once (limits, tokenizer folder) and what /health shows of this process."""
        return {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": self._started,
            "model_path": str(self._engine.model_path),
            "max_model_len": self._engine.max_model_len,
            "vocab_size": self._engine.model_config.vocab_size,
        }

    async def stats(self) -> EngineStats:
        if self._async_engine.error is not None:
            raise RuntimeError(f"the replica's engine stopped: {self._async_engine.error!r}")
        return self._async_engine.stats()

    async def generate(self, request: Request, final_only: bool = False) -> AsyncIterator[RequestOutput]:
        # The front end's clock is another process's (maybe another machine's): time from arrival here.
        request.arrival_time = time.monotonic()
        async for output in self._async_engine.generate(request, final_only):
            yield output
