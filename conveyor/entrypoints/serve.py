"""``conveyor serve``: the engine in the background, the OpenAI-compatible API in front.

Crash-only: if the engine's loop cannot go on, every open request gets an error, ``/health`` answers 503,
and the process exits with status 1 for its supervisor (systemd, Kubernetes, a shell loop) to restart it.
"""

from __future__ import annotations

import argparse
import logging
import os
import threading
from pathlib import Path

import uvicorn

from conveyor.core.config import EngineConfig
from conveyor.engine import AsyncEngine, Engine
from conveyor.entrypoints.metrics import EngineMetrics
from conveyor.entrypoints.openai_server import ServerSettings, build_app

logger = logging.getLogger("conveyor.server")
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
EXIT_ENGINE_DEAD = 1
FATAL_EXIT_GRACE_S = 10.0  # time the error events get to reach their clients before the process ends anyway


def serve(args: argparse.Namespace, config: EngineConfig) -> int:
    name = args.served_model_name or (Path(config.model).stem if config.model else DEFAULT_MODEL_NAME)
    # Checked before the model loads: an empty key is refused at once, with a clear error.
    settings = ServerSettings(name, args.api_key, args.max_request_bytes, args.default_max_tokens,
                              args.metrics_without_auth)
    engine = Engine(config)
    metrics = EngineMetrics(name)
    async_engine = AsyncEngine(engine, args.max_waiting_requests, on_step=metrics.on_step)
    app = build_app(async_engine, settings, metrics)
    server = _GracefulServer(uvicorn.Config(
        app, host=args.host, port=args.port, log_level="warning",
        # A backstop: the engine ends unfinished streams with an error event at the shutdown timeout.
        timeout_graceful_shutdown=args.shutdown_timeout + 5,
    ))
    server.on_exit = lambda: async_engine.begin_shutdown(args.shutdown_timeout)
    async_engine.on_fatal = lambda error: _exit_after_fatal(server)
    async_engine.start()
    print(f"Serving {name} on http://{args.host}:{args.port}  (try: curl http://{args.host}:{args.port}/v1/models)",
          flush=True)
    try:
        server.run()  # returns after SIGTERM/SIGINT, once in-flight requests finished or timed out
    finally:
        async_engine.stop()
    if async_engine.error is not None:
        logger.error("exiting with status %d: the engine stopped (%s)", EXIT_ENGINE_DEAD,
                     type(async_engine.error).__name__)
        return EXIT_ENGINE_DEAD
    return 0


def _exit_after_fatal(server: uvicorn.Server) -> None:
    """The engine loop died (its open requests already have their error): stop serving, exit non-zero."""
    logger.error("the engine loop cannot go on; the server stops, to be restarted by its supervisor")
    server.should_exit = True  # uvicorn finishes the open responses (their error events), then run() returns
    timer = threading.Timer(FATAL_EXIT_GRACE_S, lambda: os._exit(EXIT_ENGINE_DEAD))
    timer.daemon = True
    timer.start()


class _GracefulServer(uvicorn.Server):
    """On SIGTERM/SIGINT: refuse new requests, let in-flight ones finish, then end the rest with an error."""

    on_exit = None

    def handle_exit(self, sig, frame) -> None:
        if self.on_exit is not None and not self.should_exit:
            self.on_exit()
        super().handle_exit(sig, frame)
        # uvicorn re-raises captured signals once it has stopped, which would end the process with
        # the signal's status; a shutdown that went as planned exits 0 instead.
        self._captured_signals.clear()
