"""``conveyor serve``: the engine in the background, the OpenAI-compatible API in front.

Crash-only: if the engine's loop cannot go on, every open request gets an error, ``/health`` answers 503,
and the process exits with status 1 for its supervisor (systemd, Kubernetes, a shell loop) to restart it.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import threading
from pathlib import Path

import uvicorn

from conveyor.core.config import EngineConfig
from conveyor.engine import AsyncEngine, Engine, EngineClient
from conveyor.engine.replicas import ReplicaSet, ReplicaSettings
from conveyor.entrypoints.metrics import EngineMetrics, ServerMetrics
from conveyor.entrypoints.openai.api_server import ServerSettings, build_app
from conveyor.entrypoints.replica_metrics import ReplicaMetrics
from conveyor.model.weights.paths import DEFAULT_MODEL_NAME

logger = logging.getLogger("conveyor.server")
EXIT_ENGINE_DEAD = 1
FATAL_EXIT_GRACE_S = 10.0  # time the error events get to reach their clients before the process ends anyway


def serve(args: argparse.Namespace, config: EngineConfig) -> int:
    names = served_model_names(args.served_model_name, config.model)
    name = names[0]  # what responses and metrics report
    # Checked before the model loads: an empty key is refused at once, with a clear error.
    if args.tool_call_parser and not args.enable_auto_tool_choice:
        raise ValueError("--tool-call-parser: reads tool_choice auto's replies, which --enable-auto-tool-choice "
                         "turns on; give both")
    settings = ServerSettings(
        name, args.api_key, args.max_request_bytes, args.default_max_tokens, args.metrics_without_auth,
        max_sequences_per_request=args.max_sequences_per_request, body_read_timeout=args.body_read_timeout,
        allowed_origins=args.allowed_origins, allowed_methods=args.allowed_methods,
        allowed_headers=args.allowed_headers, allowed_hosts=args.allowed_hosts, tenant_header=config.tenant_header,
        reasoning_parser=args.reasoning_parser,
        tool_call_parser=(args.tool_call_parser or "template") if args.enable_auto_tool_choice else None,
        model_aliases=tuple(names[1:]))
    _check_replica_args(args)
    engine: EngineClient
    metrics: ServerMetrics
    single: AsyncEngine | None = None  # this process's own engine; replicas run in processes of Ray's
    if args.data_parallel_size > 1 or args.ray_address:
        engine, metrics = _replicas(args, config, name)
        engine.start()  # Ray starts the replicas here; they report the tokenizer and limits the app needs
    else:
        metrics = EngineMetrics(name)
        built = Engine(config)
        print(f"memory: {built.memory_report()}", flush=True)
        engine = single = AsyncEngine(built, args.max_waiting_requests, on_step=metrics.on_step,
                                      live_show_text=args.dashboard_show_text)
    app = build_app(engine, settings, metrics)
    server = _GracefulServer(uvicorn.Config(
        app, host=args.host, port=args.port, log_level="warning",
        # A backstop: the engine ends unfinished streams with an error event at the shutdown timeout.
        timeout_graceful_shutdown=args.shutdown_timeout + 5,
    ))
    server.on_exit = lambda: engine.begin_shutdown(args.shutdown_timeout)
    if single is not None:  # a replica that dies is restarted by Ray; this process's own engine is not
        single.on_fatal = lambda error: _exit_after_fatal(server)
        single.start()
    url = f"http://{args.host}:{args.port}"
    print(f"Serving {', '.join(names)} on {url}  (try: curl {url}/v1/models; the batch, live: {url}/dashboard)",
          flush=True)
    try:
        server.run()  # returns after SIGTERM/SIGINT, once in-flight requests finished or timed out
    finally:
        engine.stop()
    if engine.error is not None:
        logger.error("exiting with status %d: the engine stopped (%s)", EXIT_ENGINE_DEAD,
                     type(engine.error).__name__)
        return EXIT_ENGINE_DEAD
    return 0


def served_model_names(given: list[str] | None, model: str | None) -> list[str]:
    """The names clients may send, the first reported (vLLM's --served-model-name). Without any: a file's or a
    folder's name without its suffix, a name as given (``ORG/NAME``, as vLLM serves --model), or the default
    model's name."""
    if given:
        if any(not name.strip() for name in given):
            raise ValueError(f"--served-model-name: an empty name in {given}")
        return list(dict.fromkeys(given))
    if model is None:
        return [DEFAULT_MODEL_NAME]
    return [Path(model).stem if Path(model).expanduser().exists() else model]


def _check_replica_args(args: argparse.Namespace) -> None:
    """Refuse bad replica flags before anything (a model, Ray) is started."""
    if args.data_parallel_size < 1:
        raise ValueError(f"--data-parallel-size must be >= 1, got {args.data_parallel_size}")
    if args.max_replica_restarts < 0:
        raise ValueError(f"--max-replica-restarts must be >= 0, got {args.max_replica_restarts}")


def _replicas(args: argparse.Namespace, config: EngineConfig, name: str) -> tuple[ReplicaSet, ReplicaMetrics]:
    if importlib.util.find_spec("ray") is None:  # found, not imported: Ray reads its loopback switch at import
        raise ValueError("--data-parallel-size > 1 runs replicas on Ray: pip install 'conveyor[ray]'")
    metrics = ReplicaMetrics(name)
    replica_settings = ReplicaSettings(args.data_parallel_size, args.router_policy, args.num_threads,
                                       args.ray_address, args.ray_host, args.max_replica_restarts,
                                       args.max_waiting_requests)
    return ReplicaSet(config, replica_settings, on_poll=metrics.on_poll), metrics


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
