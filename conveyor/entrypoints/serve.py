"""``conveyor serve``: the engine in the background, the OpenAI-compatible API and Ollama's in front.

``--model`` given more than once serves several models: the first is loaded at start, the others on their first
request, and the least recently used are stopped to stay within ``--max-loaded-models`` and
``--max-loaded-bytes`` (see :mod:`conveyor.engine.model_pool`).

Crash-only: if an engine's loop cannot go on, every open request gets an error, ``/health`` answers 503,
and the process exits with status 1 for its supervisor (systemd, Kubernetes, a shell loop) to restart it.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path

import uvicorn

from conveyor.core.config import EngineConfig
from conveyor.core.pooling import PoolingMethod, PoolingParams
from conveyor.engine import AsyncEngine, Engine, EngineClient
from conveyor.engine.model_pool import Budget, ModelPool, PooledModel
from conveyor.engine.replicas import ReplicaSet, ReplicaSettings
from conveyor.entrypoints.metrics import EngineMetrics, ModelsMetrics
from conveyor.entrypoints.ollama import add_ollama_routes
from conveyor.entrypoints.openai.api_server import build_app
from conveyor.entrypoints.openai.serving import ServerSettings
from conveyor.entrypoints.replica_metrics import ReplicaMetrics
from conveyor.model.weights.facts import describe_model
from conveyor.model.weights.paths import DEFAULT_MODEL_NAME, weight_file_bytes

logger = logging.getLogger("conveyor.server")
EXIT_ENGINE_DEAD = 1
FATAL_EXIT_GRACE_S = 10.0  # time the error events get to reach their clients before the process ends anyway


def serve(args: argparse.Namespace, config: EngineConfig) -> int:
    given = args.model if isinstance(args.model, list) else [args.model]  # the parser appends; a caller may not
    models = [dataclasses.replace(config, model=model) for model in given]
    names_per_model = served_names_per_model(args.served_model_name, given)
    # Checked before the model loads: an empty key is refused at once, with a clear error.
    if args.tool_call_parser and not args.enable_auto_tool_choice:
        raise ValueError("--tool-call-parser: reads tool_choice auto's replies, which --enable-auto-tool-choice "
                         "turns on; give both")
    settings = _settings(args, config, names_per_model[0])
    _check_replica_args(args, len(models))
    budget = Budget(args.max_loaded_models, args.max_loaded_bytes)
    # Every model found and its weight files sized now, once (a name found nowhere is refused at start, not at
    # its first request): the byte budget refuses a model over it now, and counts one not loaded yet by them.
    weights = [weight_file_bytes(model.model) for model in models]
    _check_weights_fit(budget, models, weights)
    single: AsyncEngine | None = None  # this process's own first engine; replicas run in processes of Ray's
    if args.data_parallel_size > 1 or args.ray_address:
        engine, replica_metrics = _replicas(args, config, settings.model_name)
        engine.start()  # Ray starts the replicas here; they report the tokenizer and limits the app needs
        pool = ModelPool.single(settings.model_names, engine, describe=lambda _: describe_model(config.model))
        metrics = ModelsMetrics({settings.model_name: replica_metrics})
    else:
        pool, metrics, single = _local_pool(args, models, weights, names_per_model, budget,
                                            on_fatal=lambda error: _exit_after_fatal(server))
    app = build_app(pool, settings, metrics, more_apis=(add_ollama_routes,))
    server = _GracefulServer(uvicorn.Config(
        app, host=args.host, port=args.port, log_level="warning",
        # A backstop: the engine ends unfinished streams with an error event at the shutdown timeout.
        timeout_graceful_shutdown=args.shutdown_timeout + 5,
    ))
    server.on_exit = lambda: pool.begin_shutdown(args.shutdown_timeout)
    if single is not None:  # a replica that dies is restarted by Ray; this process's own engines are not
        single.on_fatal = lambda error: _exit_after_fatal(server)
        single.start()
    url = f"http://{args.host}:{args.port}"
    print(f"Serving {', '.join(pool.served_names)} on {url}  (try: curl {url}/v1/models; the batch, live: "
          f"{url}/dashboard)", flush=True)
    try:
        server.run()  # returns after SIGTERM/SIGINT, once in-flight requests finished or timed out
    finally:
        pool.stop()
    if pool.error is not None:
        logger.error("exiting with status %d: the engine stopped (%s)", EXIT_ENGINE_DEAD,
                     type(pool.error).__name__)
        return EXIT_ENGINE_DEAD
    return 0


def _settings(args: argparse.Namespace, config: EngineConfig, names: tuple[str, ...]) -> ServerSettings:
    """The server's own flags; ``names``: the first model's served names (the reported one first)."""
    return ServerSettings(
        names[0], args.api_key, args.max_request_bytes, args.default_max_tokens, args.metrics_without_auth,
        max_sequences_per_request=args.max_sequences_per_request, body_read_timeout=args.body_read_timeout,
        allowed_origins=args.allowed_origins, allowed_methods=args.allowed_methods,
        allowed_headers=args.allowed_headers, allowed_hosts=args.allowed_hosts, tenant_header=config.tenant_header,
        reasoning_parser=args.reasoning_parser, pooling=PoolingParams(PoolingMethod(args.pooling)),
        tool_call_parser=(args.tool_call_parser or "template") if args.enable_auto_tool_choice else None,
        model_aliases=tuple(names[1:]))


def _local_pool(args: argparse.Namespace, models: list[EngineConfig], weights: list[int],
                names_per_model: list[tuple[str, ...]], budget: Budget, on_fatal: Callable[[BaseException], None],
                ) -> tuple[ModelPool, ModelsMetrics, AsyncEngine]:
    """The models in this process: the first built now (not started: the caller starts it from this thread),
    the others by the pool on their first request; each its own metrics, labelled with its name. A model not
    loaded yet counts, for the budget, as its weight files (``weights``) and the KV pool --kv-cache-memory asks
    for."""
    per_model = {names[0]: EngineMetrics(names[0]) for names in names_per_model}
    estimates = [size + int(model.kv_cache_memory or 0) for model, size in zip(models[1:], weights[1:], strict=True)]
    first = _build_engine(models[0], args, per_model[names_per_model[0][0]])
    print(f"memory: {first.memory_report}", flush=True)
    configs = {names[0]: model for names, model in zip(names_per_model, models, strict=True)}

    def load(name: str) -> tuple[EngineClient, int]:  # in the pool's loader thread
        built = _build_engine(configs[name], args, per_model[name])
        built.engine.on_fatal = on_fatal
        built.engine.start()  # from the thread that built it, as AsyncEngine.start asks
        print(f"loaded {name}: memory: {built.memory_report}", flush=True)
        return built.engine, built.size_bytes

    pooled = [PooledModel(names_per_model[0], first.size_bytes, engine=first.engine),
              *(PooledModel(names, size) for names, size in zip(names_per_model[1:], estimates, strict=True))]
    pool = ModelPool(pooled, load, budget, describe=lambda name: describe_model(configs[name].model))
    return pool, ModelsMetrics(dict(per_model)), first.engine


def served_model_names(given: list[str] | None, model: str | None) -> list[str]:
    """The names clients may send, the first reported (vLLM's --served-model-name). Without any: a file's or a
    folder's name without its suffix, a name as given (``ORG/NAME``, as vLLM serves --model), or the default
    model's name."""
    if given:
        _check_not_empty(given)
        return list(dict.fromkeys(given))
    if model is None:
        return [DEFAULT_MODEL_NAME]
    return [Path(model).stem if Path(model).expanduser().exists() else model]


def _check_not_empty(given: list[str]) -> None:
    if any(not name.strip() for name in given):
        raise ValueError(f"--served-model-name: an empty name in {given}")


def served_names_per_model(given: list[str] | None, models: list[str | None]) -> list[tuple[str, ...]]:
    """Each model's served names, the first reported. One model takes any number of names (as vLLM); several
    take one each, the i-th name naming the i-th model (as Ollama names each model once), or none: each is
    then named as one model would be."""
    if len(models) == 1:
        return [tuple(served_model_names(given, models[0]))]
    if given and len(given) != len(models):
        raise ValueError(f"--served-model-name: {len(given)} names for {len(models)} --model; with several --model "
                         "give one name per model, in the same order (the i-th names the i-th), or none")
    if given:
        _check_not_empty(given)
    names = list(given) if given else [served_model_names(None, model)[0] for model in models]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"--model: several models would be served as {', '.join(map(repr, repeated))}; "
                         "name each with --served-model-name (one name per --model, in order)")
    return [(n,) for n in names]


def _check_weights_fit(budget: Budget, models: list[EngineConfig], weights: list[int]) -> None:
    """A model whose weights alone are over the byte budget is refused now, not at its first request."""
    if budget.max_loaded_bytes is None:
        return
    for model, size in zip(models, weights, strict=True):
        if size > budget.max_loaded_bytes:
            raise ValueError(f"--max-loaded-bytes: the model {model.model or DEFAULT_MODEL_NAME}'s weights are "
                             f"{size:,} bytes, over the budget of {budget.max_loaded_bytes:,}")


@dataclasses.dataclass(frozen=True, slots=True)
class _Built:
    engine: AsyncEngine
    size_bytes: int  # the weights' file and the KV pool: what the budget counts
    memory_report: str


def _build_engine(config: EngineConfig, args: argparse.Namespace, metrics: EngineMetrics) -> _Built:
    """One model's engine, built (not started) in the calling thread: ``start`` must come from that thread."""
    built = Engine(config)
    engine = AsyncEngine(built, args.max_waiting_requests, on_step=metrics.on_step,
                         live_show_text=args.dashboard_show_text)
    return _Built(engine, built.weight_file_bytes + built.kv_pool_bytes, built.memory_report())


def _check_replica_args(args: argparse.Namespace, num_models: int) -> None:
    """Refuse bad replica flags before anything (a model, Ray) is started."""
    if args.data_parallel_size < 1:
        raise ValueError(f"--data-parallel-size must be >= 1, got {args.data_parallel_size}")
    if args.max_replica_restarts < 0:
        raise ValueError(f"--max-replica-restarts must be >= 0, got {args.max_replica_restarts}")
    if num_models > 1 and (args.data_parallel_size > 1 or args.ray_address):
        raise ValueError("--model given more than once: several models are served by one engine each in this "
                         "process; replicas (--data-parallel-size > 1, --ray-address) serve one model")


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
