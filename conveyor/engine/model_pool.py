"""Several models behind one server: each served name to an engine, started on first use, the least recently
used ones stopped to stay within a budget (a number of models, bytes, or both).

The server asks the pool for the engine of a request's model (``use``) and holds it while it builds and submits
the request; from then on the engine's own ledger of open requests keeps the model in. A model is stopped only
when nothing holds it and it has no open request: a model chosen to make room is drained first, and requests
that arrive for it meanwhile wait for its next load, so a model waiting for room is not starved by a busy one.

Loading runs in a thread of its own, never on the event loop, and all requests that arrive for a model while it
loads wait for that one load. Every decision is made on the event loop, so the pool needs no lock of its own
beyond the one that lets one load or eviction happen at a time. It imports no torch: what builds an engine is
the ``load`` function it is given, and what reads a model's files for its facts (an API's listing of models)
the ``describe`` function.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from conveyor.core.model_facts import ModelFacts
from conveyor.engine.client import EngineClient, EngineOverloaded, RequestFailed

logger = logging.getLogger("conveyor.engine.model_pool")
DRAIN_POLL_S = 0.05  # how often a model being drained is looked at: its requests end in the engine's thread

Loader = Callable[[str], tuple[EngineClient, int]]  # a model's reported name -> its started engine, its bytes
UnloadHook = Callable[[str, EngineClient], None]
Describer = Callable[[str], ModelFacts]  # a model's reported name -> what its files say of it


@dataclass(slots=True)
class PooledModel:
    """One served model: the names it answers to (the first reported) and its bytes as the budget counts them
    (an estimate until it has loaded once; then what the loaded engine holds)."""

    names: tuple[str, ...]
    size_bytes: int = 0
    engine: EngineClient | None = None
    leases: int = 0  # requests being built or submitted with this engine (after submit, the engine counts them)
    waiters: int = 0  # requests waiting for it to load
    last_used: float = 0.0
    draining: bool = False  # chosen to make room: new requests wait for its next load
    loading: asyncio.Task | None = field(default=None, repr=False)

    @property
    def name(self) -> str:
        return self.names[0]

    def in_flight(self) -> int:
        """Requests that hold this model in: being built, or submitted and not ended."""
        open_requests = self.engine.request_counts().open if self.engine is not None else 0
        return self.leases + open_requests


@dataclass(frozen=True, slots=True)
class Budget:
    """How many models may be loaded at once, and how many of their bytes (None: no limit)."""

    max_loaded_models: int | None = None
    max_loaded_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.max_loaded_models is not None and self.max_loaded_models < 1:
            raise ValueError(f"--max-loaded-models must be >= 1, got {self.max_loaded_models}")
        if self.max_loaded_bytes is not None and self.max_loaded_bytes < 1:
            raise ValueError(f"--max-loaded-bytes must be positive, got {self.max_loaded_bytes}")

    def exceeded(self, count: int, size: int) -> bool:
        over_count = self.max_loaded_models is not None and count > self.max_loaded_models
        return over_count or (self.max_loaded_bytes is not None and size > self.max_loaded_bytes)


class ModelPool:
    """The served models by name (see the module's docstring). Call everything but ``stop`` from the event loop."""

    def __init__(self, models: Sequence[PooledModel], load: Loader | None = None,
                 budget: Budget | None = None, describe: Describer | None = None) -> None:
        self._models = list(models)
        if not self._models:
            raise ValueError("a server needs at least one model")
        self._by_name: dict[str, PooledModel] = {}
        for model in self._models:
            for name in model.names:
                if name in self._by_name:
                    raise ValueError(f"two models would be served as {name!r}; give each its own name")
                self._by_name[name] = model
        self._load_fn = load
        self.budget = budget or Budget()
        self.on_unload: list[UnloadHook] = []  # told before a model's engine stops (a last scrape, caches dropped)
        self._one_at_a_time = asyncio.Lock()  # loads and evictions, so the budget is judged on settled facts
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="conveyor-model-load")
        self._closing = False
        self._describe = describe
        self._facts: dict[str, ModelFacts] = {}  # each model's, read once

    @classmethod
    def single(cls, names: Sequence[str], engine: EngineClient, describe: Describer | None = None) -> ModelPool:
        """One model, already loaded, never stopped by the pool: a server as it was before there were several."""
        return cls([PooledModel(tuple(names), engine=engine)], describe=describe)

    # ----- what the server reads ---------------------------------------------

    @property
    def served_names(self) -> list[str]:
        """Every name a client may send, each model's in turn (its reported name first)."""
        return list(self._by_name)

    @property
    def several(self) -> bool:
        return len(self._models) > 1

    def reported_name(self, name: str) -> str | None:
        """The name responses report for a request that sent ``name``; None where no model answers to it."""
        model = self._by_name.get(name)
        return None if model is None else model.name

    def not_served(self, name: str) -> str:
        """What a client is told of a name no model answers to: every name that does."""
        return f"model {name!r} does not exist; this server serves {', '.join(map(repr, self.served_names))}"

    def default_name(self) -> str:
        """The model of a request that names none: the first given."""
        return self._models[0].name

    def loaded(self) -> dict[str, EngineClient]:
        """The engines running now, by reported name."""
        return {m.name: m.engine for m in self._models if m.engine is not None}

    def held_bytes(self) -> dict[str, int | None]:
        """What each running model holds, by reported name, as the budget counts it (its weights' file and its KV
        pool); None where the pool was handed an engine without its size."""
        return {m.name: m.size_bytes or None for m in self._models if m.engine is not None}

    def facts(self, name: str) -> ModelFacts:
        """What the files of the model ``name`` (a reported name) say of it, read on the first call (seconds for
        a large GGUF file: call it off the event loop); empty where the pool was given no way to read them."""
        facts = self._facts.get(name)
        if facts is not None or self._describe is None:
            return facts or ModelFacts()
        try:
            facts = self._facts[name] = self._describe(name)
        except Exception:  # a listing shows the model without its facts; the next call reads again
            logger.exception("model %s: its files could not be read for its facts", name)
            return ModelFacts()
        return facts

    @property
    def error(self) -> BaseException | None:
        """Set once a running engine cannot serve (its loop stopped)."""
        return next((e.error for e in self.loaded().values() if e.error is not None), None)

    def health_report(self) -> dict[str, Any] | None:
        """The one model's report (replicas behind a router say how each is); several models have none."""
        engines = self.loaded()
        return next(iter(engines.values())).health_report() if len(self._models) == 1 and engines else None

    # ----- using a model -------------------------------------------------------

    @contextlib.asynccontextmanager
    async def use(self, name: str) -> AsyncIterator[EngineClient]:
        """The engine of the model ``name`` names, loaded first if it is not (the caller waits); the model is not
        stopped while the block runs. Raises EngineOverloaded once the server is shutting down, and RequestFailed
        where the model could not be loaded."""
        model = self._by_name[name]
        engine = await self._acquire(model)
        try:
            yield engine
        finally:
            model.leases -= 1

    async def _acquire(self, model: PooledModel) -> EngineClient:
        while model.engine is None or model.draining:
            if self._closing:
                raise EngineOverloaded("the server is shutting down")
            if model.loading is None:
                model.loading = asyncio.ensure_future(self._load(model))
            if await self._wait_for(model, model.loading):
                break  # the load handed this request its lease
        else:
            model.leases += 1
        model.last_used = time.monotonic()
        return model.engine

    async def _wait_for(self, model: PooledModel, load: asyncio.Task) -> bool:
        """Wait for ``load`` (one load for every request that waits for it); True where it loaded the model and
        handed this request a lease. Every waiting request gets its lease as the load ends, before any of them
        runs again: otherwise the next load could stop the model before they took one, and two models under a
        budget of one would stop each other forever."""
        model.waiters += 1
        try:
            granted = await asyncio.shield(load)
        except BaseException:  # the load failed, or this request's caller left
            if _granted(load):
                model.leases -= 1
            else:
                model.waiters -= 1
            raise
        if not granted:
            model.waiters -= 1
        return granted

    async def _load(self, model: PooledModel) -> bool:
        """Load ``model`` (making room first); True where it did, its waiting requests then holding leases."""
        try:
            async with self._one_at_a_time:
                if model.engine is not None or self._closing:  # loaded already, or nobody will need it
                    return False
                await self._make_room(model)
                engine, size = await self._start(model)
                model.engine, model.size_bytes = engine, size
                await self._evict_idle_over_budget(keep=model)  # the estimate may have been low
                model.leases, model.waiters = model.leases + model.waiters, 0  # no await from here to the end
                return True
        finally:
            model.loading = None

    async def _start(self, model: PooledModel) -> tuple[EngineClient, int]:
        if self._load_fn is None:
            raise RequestFailed(f"model {model.name!r} is not loaded and this server cannot load it")
        logger.info("loading model %s", model.name)
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self._loader, self._load_fn, model.name)
        except Exception as error:  # its requests fail with the reason; the next request tries again
            logger.exception("model %s could not be loaded", model.name)
            raise RequestFailed(f"model {model.name!r} could not be loaded: {error}") from None

    # ----- the budget ------------------------------------------------------------

    def _over_budget(self, adding: PooledModel) -> bool:
        others = [m for m in self._models if m.engine is not None and m is not adding]
        return self.budget.exceeded(len(others) + 1, sum(m.size_bytes for m in others) + adding.size_bytes)

    def _victim(self, keep: PooledModel) -> PooledModel | None:
        """The model to stop for room: an idle one before a busy one, the least recently used first."""
        loaded = [m for m in self._models if m.engine is not None and m is not keep]
        return min(loaded, key=lambda m: (m.in_flight() + m.waiters > 0, m.last_used), default=None)

    async def _make_room(self, adding: PooledModel) -> None:
        """Stop models until ``adding`` fits, waiting for a busy one's requests where no idle one is left."""
        while self._over_budget(adding):
            victim = self._victim(adding)
            if victim is None:
                return  # nothing else is loaded: it loads alone (a model over the budget alone is refused at start)
            await self._evict(victim)

    async def _evict_idle_over_budget(self, keep: PooledModel) -> None:
        while self._over_budget(keep):
            victim = self._victim(keep)
            if victim is None or victim.in_flight() + victim.waiters > 0:
                return  # the rest are busy: the next load makes room
            await self._evict(victim)

    async def _evict(self, model: PooledModel) -> None:
        """Drain ``model`` (new requests wait for its next load), then stop its engine in the loader thread."""
        model.draining = True
        try:
            while model.in_flight() > 0:
                await asyncio.sleep(DRAIN_POLL_S)
            engine, model.engine = model.engine, None
        finally:
            model.draining = False
        logger.info("unloading model %s to stay within the budget", model.name)
        for hook in self.on_unload:
            hook(model.name, engine)
        engine.begin_shutdown(0.0)  # ends the dashboards watching it
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._loader, engine.stop)
        del engine
        # A model holds hundreds of MB, some of it in reference cycles: let it go now, off the event loop.
        await loop.run_in_executor(self._loader, gc.collect)

    # ----- the server's life ---------------------------------------------------

    def begin_shutdown(self, timeout: float) -> None:
        """Refuse new requests and loads now; after ``timeout`` seconds, end the unfinished ones with an error."""
        self._closing = True
        for engine in self.loaded().values():
            engine.begin_shutdown(timeout)

    def stop(self) -> None:
        self._closing = True
        for engine in self.loaded().values():
            engine.stop()
        self._loader.shutdown(wait=False, cancel_futures=True)


def _granted(load: asyncio.Task) -> bool:
    """Whether ``load`` ended by loading its model (and so handed a lease to each request waiting for it)."""
    return load.done() and not load.cancelled() and load.exception() is None and load.result() is True
