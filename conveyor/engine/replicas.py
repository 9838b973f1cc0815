"""Data-parallel replicas on Ray behind the router, with the face of one :class:`AsyncEngine`.

The server talks to a :class:`ReplicaSet` as it would to one engine: both are an
:class:`~conveyor.engine.client.EngineClient`, and requests are built by the same
:class:`~conveyor.engine.request_builder.RequestBuilder`, here over the first replica's
tokenizer. Underneath, each request goes to the replica the router picks
(:mod:`conveyor.router`), and its outputs stream back through a Ray generator. A replica
that dies is taken out of routing at once; a request that had no output yet is sent to
another replica, one that had streamed ends with an error. Ray restarts the
actor (up to ``max_restarts`` times), and a monitor thread, which polls every replica's stats,
puts it back when it answers again.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from conveyor.core.config import EngineConfig, usable_cores
from conveyor.core.request import Request
from conveyor.core.stats import EngineStats
from conveyor.core.structured import StructuredOutput
from conveyor.engine.client import EngineDead, EngineOverloaded, LiveViewUnavailable, RequestCounts
from conveyor.engine.output import RequestOutput
from conveyor.engine.replica_actor import EngineReplica
from conveyor.engine.request_builder import RequestBuilder
from conveyor.engine.tokenizer import Tokenizer
from conveyor.model.weights.paths import resolve_model
from conveyor.router import NoHealthyReplica, Router

logger = logging.getLogger("conveyor.replicas")
POLL_INTERVAL_S = 0.5
POLL_TIMEOUT_S = 5.0
START_TIMEOUT_S = 600.0
LOOPBACK = frozenset({"127.0.0.1", "localhost", "::1"})
# Ray replaces a loopback node address by the machine's own unless this is off; with it off, its GCS, raylets,
# workers and agents all listen on the node address, loopback (by default they listened on every interface).
RAY_LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


@dataclass(slots=True)
class ReplicaSettings:
    num_replicas: int = 2
    router_policy: str = "cache-aware"
    num_threads: int | None = None  # torch threads (and Ray CPUs) per replica; None: cores / replicas
    ray_address: str | None = None  # None: start Ray here; "auto" or host:port: join a cluster
    ray_host: str = "127.0.0.1"  # the node address of a Ray started here, where all its processes listen
    max_restarts: int = 3  # per replica, by Ray
    max_waiting_requests: int = 1024  # per replica


@dataclass(slots=True)
class ReplicaHealth:
    """What /health and /metrics show of one replica."""

    healthy: bool = False
    pid: int | None = None
    host: str | None = None
    restarts: int = 0  # times it came back in a new process
    missed_polls: int = 0  # in a row; a slow replica stays in routing (a dead one raises, and is taken out)
    down_since: float | None = None
    last_recovery_s: float | None = None  # from seen down to serving again, the latest time
    stats: EngineStats | None = None


@dataclass(slots=True)
class FailoverCounts:
    """Requests a replica failure touched, since start."""

    retried: int = 0  # had no output yet: sent to another replica
    errored: int = 0  # had streamed already: ended with an error event
    unplaced: int = 0  # no healthy replica was left to retry on
    by_replica: dict[int, int] = field(default_factory=dict)  # failures seen per replica


def ray_start(settings: ReplicaSettings, cpus: int) -> tuple[dict[str, Any], dict[str, str]]:
    """``ray.init``'s arguments, and the environment Ray must see before it is imported: a Ray started here
    listens on ``ray_host`` only when that is loopback (another address lets other machines join, and Ray then
    listens on every interface); a cluster joined at ``ray_address`` is as its operator set it up."""
    if settings.ray_address:
        return {"address": settings.ray_address, "log_to_driver": False}, {}
    options = {"address": "local", "num_cpus": cpus, "include_dashboard": False, "log_to_driver": False,
               "_node_ip_address": settings.ray_host}
    return options, ({RAY_LOOPBACK_ENV: "0"} if settings.ray_host in LOOPBACK else {})


def _import_ray(environment: dict[str, str]):
    """``import ray`` after setting ``environment``; refused if Ray was imported before and would not keep to
    loopback (it reads the switch once, at import)."""
    os.environ.update(environment)
    import ray
    from ray._private import ray_constants

    if environment.get(RAY_LOOPBACK_ENV) == "0" and ray_constants.ENABLE_RAY_CLUSTER:
        raise RuntimeError(f"Ray was imported before {RAY_LOOPBACK_ENV}=0 could be set: it would listen on "
                           "every interface, not on loopback")
    return ray


def _ray_errors() -> tuple[type[BaseException], ...]:
    from ray.exceptions import RayActorError

    return (RayActorError,)


class ReplicaSet:
    """N engine replicas as Ray actors, one router in front; the server's engine."""

    def __init__(self, config: EngineConfig, settings: ReplicaSettings, on_poll=None) -> None:
        if settings.num_replicas < 1:
            raise ValueError(f"--data-parallel-size must be >= 1, got {settings.num_replicas}")
        self.config = config
        self.settings = settings
        self.router = Router(settings.num_replicas, settings.router_policy, block_size=config.block_size,
                             seed=config.seed)
        self.health = [ReplicaHealth() for _ in range(settings.num_replicas)]
        self.failover = FailoverCounts()
        self._on_poll = on_poll  # (replica, ReplicaHealth, requests routed there, FailoverCounts) after each poll
        self._lock = threading.Lock()  # the router and health are shared by the event loop and the monitor
        self._actors: list[Any] = []
        self._started_ray = False
        self._stopping = threading.Event()
        self._monitor = threading.Thread(target=self._watch, name="conveyor-replica-monitor", daemon=True)
        self._in_flight: dict[str, int] = {}  # request id -> replica
        self.draining = False
        self._failing_all = False
        self._ledger = _Ledger()
        self.requests: RequestBuilder  # set by start(), from what the first replica reports

    # ----- life cycle ---------------------------------------------------------

    def start(self) -> None:
        """Start Ray (or join ``ray_address``), create the replicas, and wait until each has loaded its model."""
        threads = self._threads_per_replica()
        cpus = max(os.cpu_count() or 1, threads * self.settings.num_replicas)
        options, environment = ray_start(self.settings, cpus)
        ray = _import_ray(environment)
        if not ray.is_initialized():
            # Ray runs its workers at nice 15 by default, as background jobs; replicas are the service itself
            # and must not yield their cores to every other process on the machine.
            os.environ.setdefault("RAY_worker_niceness", "0")
            ray.init(**options)
            self._started_ray = True
        # Resolved (a GGUF converted) once, here: replicas starting together would otherwise race to convert it.
        config = dataclasses.replace(self.config, model=str(resolve_model(self.config.model)))
        actor_class = ray.remote(EngineReplica)
        self._actors = [
            actor_class.options(name=f"conveyor-replica-{index}-{os.getpid()}", num_cpus=threads,
                                max_restarts=self.settings.max_restarts, max_task_retries=0,
                                max_concurrency=10_000)
            .remote(dataclasses.replace(config, num_threads=threads), self.settings.max_waiting_requests)
            for index in range(self.settings.num_replicas)
        ]
        described = ray.get([actor.describe.remote() for actor in self._actors], timeout=START_TIMEOUT_S)
        first = described[0]
        tokenizer = Tokenizer(first["model_path"], self.config.chat_template_text())  # the server templates here
        self.requests = RequestBuilder(tokenizer, first["vocab_size"], first["max_model_len"])
        for index, (health, info) in enumerate(zip(self.health, described)):
            health.healthy, health.pid, health.host = True, info["pid"], info["host"]
            self._report(index)
        self._monitor.start()

    def _threads_per_replica(self) -> int:
        if self.settings.num_threads is not None:
            if self.settings.num_threads < 1:
                raise ValueError(f"--num-threads must be >= 1, got {self.settings.num_threads}")
            return self.settings.num_threads
        return max(usable_cores() // self.settings.num_replicas, 1)

    def stop(self) -> None:
        import ray

        self._stopping.set()
        for actor in self._actors:
            ray.kill(actor, no_restart=True)
        if self._started_ray:
            ray.shutdown()

    def begin_shutdown(self, timeout: float) -> None:
        """Refuse new requests now; after ``timeout`` seconds, end the unfinished ones with an error."""
        self.draining = True
        timer = threading.Timer(timeout, lambda: setattr(self, "_failing_all", True))
        timer.daemon = True
        timer.start()

    # ----- the engine's face --------------------------------------------------

    @property
    def error(self) -> BaseException | None:
        """Set once no replica is healthy: the server cannot serve until one comes back."""
        if any(health.healthy for health in self.health):
            return None
        return EngineDead("no replica is healthy")

    @property
    def num_unfinished(self) -> int:
        return len(self._in_flight)

    @property
    def tokenizer(self) -> Tokenizer:
        return self.requests.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.requests.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.requests.vocab_size

    def request_counts(self) -> RequestCounts:
        """The front end's ledger: every request submitted here, by how its stream ended."""
        return self._ledger.counts()

    def watch(self) -> AsyncIterator[dict[str, Any]]:
        """No live view: each replica has its own scheduler, and the dashboard shows one."""
        raise LiveViewUnavailable("the live dashboard shows one engine's scheduler; this server routes to several "
                                  "replicas (--data-parallel-size), each with its own")

    def compile_grammar(self, spec: StructuredOutput) -> None:
        """Nothing here: the replica that takes the request compiles its grammar, and refuses it if it does not
        compile (the request then ends with RequestFailed)."""

    def stats(self) -> EngineStats:
        """All healthy replicas' latest stats, summed (KV usage: the mean)."""
        with self._lock:
            snapshots = [health.stats for health in self.health if health.healthy and health.stats is not None]
        return sum_stats(snapshots)

    def health_report(self) -> dict[str, Any]:
        """Each replica's state, and the failover counts: the body of /health."""
        with self._lock:
            replicas = [
                {"replica": index, "healthy": h.healthy, "pid": h.pid, "host": h.host, "restarts": h.restarts,
                 "missed_polls": h.missed_polls,
                 "last_recovery_s": h.last_recovery_s,
                 "num_requests_running": h.stats.num_running if h.stats else None,
                 "num_requests_waiting": h.stats.num_waiting if h.stats else None}
                for index, h in enumerate(self.health)
            ]
            counts = self.failover
            failover = {"retried": counts.retried, "errored": counts.errored, "unplaced": counts.unplaced}
        return {"router_policy": self.router.policy.name, "replicas": replicas, "failover": failover}

    def submit(self, request: Request, final_only: bool = False) -> GeneratorStream:
        """``generate`` with the face the server reads (as ``AsyncEngine.submit``): ``close()`` aborts."""
        if self.draining:
            raise EngineOverloaded("the server is shutting down")
        self._ledger.submitted += 1
        return GeneratorStream(self.generate(request, final_only), self._ledger.ended)

    async def generate(self, request: Request, final_only: bool = False) -> AsyncIterator[RequestOutput]:
        """Route ``request``, stream its outputs; on a replica's death, retry it elsewhere if nothing was sent."""
        if self.draining:
            raise EngineOverloaded("the server is shutting down")
        tried: list[int] = []
        while True:
            replica = self._place(request, tried)
            streamed = False
            try:
                async for output in self._stream(replica, request, final_only):
                    streamed = True
                    yield output
                return
            except _ReplicaFailed as failure:
                if streamed:
                    self._count("errored", replica)
                    raise EngineDead(f"replica {replica} failed mid-stream: {failure}") from None
                self._count("retried", replica)
                tried.append(replica)

    def _place(self, request: Request, tried: list[int]) -> int:
        with self._lock:
            try:
                replica = self.router.route(request.prompt_token_ids, exclude=tried)
            except NoHealthyReplica as error:
                if tried:
                    self.failover.unplaced += 1
                raise EngineDead(f"cannot place the request: {error}") from None
        self._in_flight[request.request_id] = replica
        return replica

    async def _stream(self, replica: int, request: Request, final_only: bool) -> AsyncIterator[RequestOutput]:
        """One replica's outputs for ``request`` (with ``final_only``, each sequence's last); its death raises
        :class:`_ReplicaFailed`."""
        import ray

        errors = _ray_errors()
        stream = self._actors[replica].generate.remote(request, final_only)
        finished = False
        try:
            async for reference in stream:
                try:
                    output = await reference
                except errors as error:
                    self._mark_down(replica)
                    raise _ReplicaFailed(repr(error)) from None
                if self._failing_all:
                    raise EngineDead("the server is shutting down")
                if output.finished and output.finish_reason in ("stop", "length"):
                    with self._lock:  # the replica caches the answer too, and a chat's next turn resends it
                        self.router.remember(replica, output.prompt_token_ids + output.token_ids[:-1])
                yield output
            finished = True
        except errors as error:
            self._mark_down(replica)
            raise _ReplicaFailed(repr(error)) from None
        finally:
            self._in_flight.pop(request.request_id, None)
            with self._lock:
                self.router.finished(replica)
            if not finished:
                # The replica's generator is cancelled, and its cleanup aborts the request there; a dead
                # replica has nothing left to cancel.
                with contextlib.suppress(*_ray_errors()):
                    ray.cancel(stream)

    def _count(self, what: str, replica: int) -> None:
        with self._lock:
            setattr(self.failover, what, getattr(self.failover, what) + 1)
            self.failover.by_replica[replica] = self.failover.by_replica.get(replica, 0) + 1

    def _mark_down(self, replica: int) -> None:
        with self._lock:
            health = self.health[replica]
            if health.healthy:
                logger.warning("replica %d is down; routing around it until it answers again", replica)
                health.healthy, health.down_since, health.stats = False, time.monotonic(), None
                self.router.set_healthy(replica, False)

    # ----- the monitor thread -------------------------------------------------

    def _watch(self) -> None:
        while not self._stopping.wait(POLL_INTERVAL_S):
            for index in range(len(self._actors)):
                self._poll(index)

    def _poll(self, index: int) -> None:
        """Ask one replica for its stats: an answer feeds the router (and brings a restarted replica back)."""
        import ray
        from ray.exceptions import GetTimeoutError

        actor = self._actors[index]
        try:
            stats = ray.get(actor.stats.remote(), timeout=POLL_TIMEOUT_S)
            info = ray.get(actor.describe.remote(), timeout=POLL_TIMEOUT_S) if not self.health[index].healthy else None
        except GetTimeoutError:
            # Slow, not dead: an overloaded machine (or a replica compiling its kernels) answers late, and
            # taking it out of routing would only move its load elsewhere and drop its cache affinity.
            self.health[index].missed_polls += 1
            self._report(index)
            return
        except _ray_errors():
            self._mark_down(index)
            self._report(index)
            return
        except Exception:  # the replica's engine stopped: as good as dead until Ray restarts it
            logger.exception("replica %d failed its health check", index)
            self._mark_down(index)
            self._report(index)
            return
        with self._lock:
            health = self.health[index]
            health.stats, health.missed_polls = stats, 0
            if info is not None:
                if info["pid"] != health.pid:
                    health.restarts += 1
                    self.router.forget(index)
                health.pid, health.host, health.healthy = info["pid"], info["host"], True
                if health.down_since is not None:
                    health.last_recovery_s = time.monotonic() - health.down_since
                    health.down_since = None
                logger.warning("replica %d is serving again (pid %s)", index, info["pid"])
                self.router.set_healthy(index, True)
            self.router.report_load(index, stats.num_waiting + stats.num_swapped, stats.num_running, stats.kv_usage,
                                    stats.num_kv_blocks)
        self._report(index)

    def _report(self, index: int) -> None:
        if self._on_poll is not None:
            with self._lock:
                self._on_poll(index, self.health[index], self.router.replicas[index].num_routed, self.failover)


class GeneratorStream:
    """An async generator of outputs as a stream that ``close()`` ends. The generator runs in a task of its
    own, so closing cancels it wherever it waits, and its ``finally`` aborts the request on its replica."""

    _END = object()

    def __init__(self, outputs: AsyncIterator[RequestOutput], on_end: Callable[[str], None]) -> None:
        self._queue: asyncio.Queue = asyncio.Queue()
        self._on_end: Callable[[str], None] | None = on_end  # called once: finished, aborted or errored
        self._task = asyncio.get_running_loop().create_task(self._pump(outputs))
        self.done = False

    async def _pump(self, outputs: AsyncIterator[RequestOutput]) -> None:
        outcome = "aborted"  # unless it gets to the end: cancelled by close()
        try:
            async for output in outputs:
                self._queue.put_nowait(output)
            outcome = "finished"
        except Exception as error:  # handed to the reader, which raises it
            outcome = "errored"
            self._queue.put_nowait(error)
        finally:
            self._end(outcome)
            self._queue.put_nowait(self._END)

    def _end(self, outcome: str) -> None:
        """Report how the stream ended, the first time only (close() may come before or after the end)."""
        if self._on_end is not None:
            self._on_end(outcome)
            self._on_end = None

    def __aiter__(self) -> GeneratorStream:
        return self

    async def __anext__(self) -> RequestOutput:
        item = self._END if self.done else await self._queue.get()
        if item is self._END:
            self.done = True
            raise StopAsyncIteration
        if isinstance(item, Exception):
            self.done = True
            raise item
        return item

    def close(self) -> None:
        self.done = True
        self._end("aborted")  # here, not in the task: a task cancelled before it ran never runs its finally
        self._task.cancel()


@dataclass(slots=True)
class _Ledger:
    """Requests through the front end by how they ended (touched on the event loop only)."""

    submitted: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)

    def ended(self, outcome: str) -> None:
        self.outcomes[outcome] += 1

    def counts(self) -> RequestCounts:
        o = self.outcomes
        ended = o["finished"] + o["aborted"] + o["errored"]
        return RequestCounts(self.submitted, o["finished"], o["aborted"], o["errored"], self.submitted - ended)


class _ReplicaFailed(Exception):
    """The replica serving a request died (or became unreachable) before the request finished."""


def sum_stats(snapshots: list[EngineStats]) -> EngineStats:
    """Replicas' stats as one engine's: counts summed, KV usage averaged over the replicas."""
    if not snapshots:
        return EngineStats(0, 0, 0, 0, 0, 0, 0.0, 0, 0, 0, 0, 0)
    total = {name: sum(getattr(s, name) for s in snapshots) for name in EngineStats.__dataclass_fields__}
    total["kv_usage"] = total["kv_usage"] / len(snapshots)
    return EngineStats(**total)
