"""Prometheus metrics, named as vLLM's with a ``conveyor:`` prefix.

Gauges and counters are read from the engine's latest snapshot when /metrics is scraped, not set after every
step: a step at batch 1 takes a few milliseconds, and a dozen labelled updates each step cost over 1% of it.
Only what each finished request adds (its latencies, into histograms) is recorded by the engine's thread.
Every figure that only grows is taken from a running total of the engine (or of the server's request ledger)
rather than summed here from outputs, so nothing is kept per request: the metrics cost the same memory after
a million requests, disconnects included.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics_core import Metric

from conveyor.core.stats import EngineStats
from conveyor.engine import EngineClient, RequestCounts, RequestOutput

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320, 640)


def gauge_by_tenant(registry: CollectorRegistry, name: str, doc: str) -> Gauge:
    return Gauge(f"conveyor:{name}", doc, ["model_name", "tenant"], registry=registry)


class ServerMetrics(Protocol):
    """What the server's /metrics reads: one engine's (EngineMetrics) or the replicas' (ReplicaMetrics)."""

    registry: CollectorRegistry

    def on_scrape(self, engine: EngineClient) -> None:
        """Read what the figures need of the engine client (its request ledger, its latest snapshot): called
        when the metrics are scraped."""
        ...


class RequestLedgerMetrics:
    """The request ledger as Prometheus figures: every request the server took ends exactly once, so
    ``requests_submitted == sum(requests_ended) + requests_open``."""

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        self.submitted = Counter("conveyor:requests_submitted", "Requests handed to the engine", ["model_name"],
                                 registry=registry)
        self.ended = Counter("conveyor:requests_ended", "Requests ended, by outcome: finished, aborted (the client "
                             "left) or errored", ["model_name", "outcome"], registry=registry)
        self.open = Gauge("conveyor:requests_open", "Requests submitted and not ended yet", ["model_name"],
                          registry=registry)
        self._model = model_name
        self._counted: dict[str, int] = {}  # the ledger's totals, as last added to the counters

    def on_requests(self, counts: RequestCounts) -> None:
        """Advance the counters to the ledger's totals (scrapes come one at a time, on the event loop)."""
        self._advance(self.submitted.labels(self._model), "submitted", counts.submitted)
        for outcome in ("finished", "aborted", "errored"):
            self._advance(self.ended.labels(self._model, outcome), outcome, getattr(counts, outcome))
        self.open.labels(self._model).set(counts.open)

    def _advance(self, counter: Counter, name: str, total: int) -> None:
        counter.inc(total - self._counted.get(name, 0))
        self._counted[name] = total

    def engine_replaced(self) -> None:
        """The model's engine was stopped and another will count from 0: the counters go on from where they are."""
        self._counted.clear()


class EngineMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        r = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"conveyor:{name}", doc, labels, registry=r)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(f"conveyor:{name}", doc, labels + list(extra), registry=r)

        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(f"conveyor:{name}", doc, labels, buckets=_LATENCY_BUCKETS, registry=r)

        self.running = gauge("num_requests_running", "Requests in the running batch")
        self.waiting = gauge("num_requests_waiting", "Requests waiting to be admitted")
        self.swapped = gauge("num_requests_swapped", "Requests whose KV is swapped out to CPU")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of KV blocks held by requests, 0..1")
        self.kv_cached_free = gauge("kv_cache_cached_free_perc",
                                    "Fraction of KV blocks free but still holding a cached prefix, 0..1")
        self.prefix_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache")
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache")
        self.preemptions = counter("num_preemptions", "Preemptions (recompute or swap)")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens processed")
        self.generation_tokens = counter("generation_tokens", "Tokens generated")
        self.success = counter("request_success", "Requests finished, by reason", ("finished_reason",))
        self.failed_steps = counter("num_failed_steps", "Steps whose execution raised (their requests got an error)")
        self.ledger = RequestLedgerMetrics(r, model_name)
        self.spec_drafts = counter("spec_decode_num_drafts", "Request-steps that carried speculative drafts")
        self.spec_draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens verified")
        self.spec_accepted = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted")
        self.spec_accepted_per_pos = counter("spec_decode_num_accepted_tokens_per_pos",
                                             "Draft tokens accepted, by position in the draft (0: the first)",
                                             ("position",))
        self.ttft = histogram("time_to_first_token_seconds", "Arrival to first token")
        self.tpot = histogram("time_per_output_token_seconds", "Mean time between output tokens of a request")
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish")
        self.queue_time = histogram("request_queue_time_seconds", "Arrival to first scheduled")
        # The fair policy's accounts, per tenant (empty under the other policies).
        self.tenant_virtual = gauge_by_tenant(
            r, "tenant_virtual_tokens", "The fair policy's virtual token counter: weighted tokens served / weight")
        self.tenant_waiting = gauge_by_tenant(r, "tenant_requests_waiting", "Requests waiting or swapped, by tenant")
        self.tenant_prompt = Counter("conveyor:tenant_prompt_tokens", "Prompt tokens admitted, by tenant",
                                     [*labels, "tenant"], registry=r)
        self.tenant_generation = Counter("conveyor:tenant_generation_tokens", "Tokens generated, by tenant",
                                         [*labels, "tenant"], registry=r)
        self._model = model_name
        self._counted: dict[str, int] = {}  # the engine's running totals, as last added to the counters
        self._tenants: set[str] = set()  # tenants with gauges

    def engine_replaced(self) -> None:
        """The model's engine was stopped (several models under a budget) and the next one counts from 0: the
        counters go on from where they are rather than run backwards."""
        self._counted.clear()
        self.ledger.engine_replaced()

    def on_step(self, stats: EngineStats, outputs: list[RequestOutput]) -> None:
        """Called by the engine thread after each step: the finished requests' latencies."""
        for output in outputs:
            if output.finished and output.error is None:
                self._on_finish(output)

    def on_scrape(self, engine: EngineClient) -> None:
        """At a scrape (one at a time, on the event loop): the ledger, then the gauges and counters as of the
        latest step."""
        self.ledger.on_requests(engine.request_counts())
        self.on_stats(engine.stats())

    def on_stats(self, stats: EngineStats) -> None:
        """The gauges and counters as of the snapshot ``stats``."""
        m = self._model
        self.running.labels(m).set(stats.num_running)
        self.waiting.labels(m).set(stats.num_waiting)
        self.swapped.labels(m).set(stats.num_swapped)
        self.kv_usage.labels(m).set(stats.kv_usage)
        self.kv_cached_free.labels(m).set(stats.num_cached_free_kv_blocks / stats.num_kv_blocks)
        self._count(self.preemptions, "num_preemptions", stats.num_preemptions)
        self._count(self.prefix_queries, "prefix_cache_queries", stats.prefix_cache_queries)
        self._count(self.prefix_hits, "prefix_cache_hits", stats.prefix_cache_hits)
        self._count(self.prompt_tokens, "prompt_tokens", stats.prompt_tokens)
        self._count(self.generation_tokens, "generation_tokens", stats.generation_tokens)
        self._count(self.failed_steps, "num_failed_steps", stats.num_failed_steps)
        if stats.spec_decode_accepted_per_position:
            self._on_spec_decode(stats)
        for tenant, figures in stats.tenants.items():
            self._on_tenant(tenant, figures)
        if len(self._tenants) > len(stats.tenants):  # the policy forgot some: their gauges go too
            for tenant in self._tenants - stats.tenants.keys():
                self.tenant_virtual.remove(m, tenant)
                self.tenant_waiting.remove(m, tenant)
                # Its totals restart from 0 if it returns; the counters go on from where they are.
                self._counted.pop(f"tenant_prompt:{tenant}", None)
                self._counted.pop(f"tenant_generation:{tenant}", None)
            self._tenants &= stats.tenants.keys()

    def _on_spec_decode(self, stats: EngineStats) -> None:
        self._count(self.spec_drafts, "spec_decode_num_drafts", stats.spec_decode_num_drafts)
        self._count(self.spec_draft_tokens, "spec_decode_num_draft_tokens", stats.spec_decode_num_draft_tokens)
        self._count(self.spec_accepted, "spec_decode_num_accepted_tokens", stats.spec_decode_num_accepted_tokens)
        for position, total in enumerate(stats.spec_decode_accepted_per_position):
            self._count(self.spec_accepted_per_pos, f"spec_decode_per_pos:{position}", total, str(position))

    def _on_tenant(self, tenant: str, figures: dict[str, float]) -> None:
        m = self._model
        self._tenants.add(tenant)
        self.tenant_virtual.labels(m, tenant).set(figures["virtual_tokens"])
        self.tenant_waiting.labels(m, tenant).set(figures["num_waiting"] + figures["num_swapped"])
        for counter, name, total in ((self.tenant_prompt, f"tenant_prompt:{tenant}", figures["prompt_tokens"]),
                                     (self.tenant_generation, f"tenant_generation:{tenant}", figures["output_tokens"])):
            if total < self._counted.get(name, 0):  # forgotten and back within one step: its totals restarted
                self._counted[name] = 0
            self._count(counter, name, int(total), tenant)

    def _count(self, counter: Counter, name: str, total: int, *labels: str) -> None:
        """Advance a Prometheus counter to a running total (called from one thread at a time per name)."""
        counter.labels(self._model, *labels).inc(total - self._counted.get(name, 0))
        self._counted[name] = total

    def _on_finish(self, output: RequestOutput) -> None:
        m, metrics = self._model, output.metrics
        self.success.labels(m, output.finish_reason).inc()
        if metrics.time_to_first_token is not None:
            self.ttft.labels(m).observe(metrics.time_to_first_token)
        if metrics.latency is not None:
            self.e2e.labels(m).observe(metrics.latency)
        if metrics.first_scheduled_time is not None:
            self.queue_time.labels(m).observe(metrics.first_scheduled_time - metrics.arrival_time)
        n = len(output.token_ids)
        if n > 1 and metrics.finish_time is not None and metrics.first_token_time is not None:
            self.tpot.labels(m).observe((metrics.finish_time - metrics.first_token_time) / (n - 1))


class ModelsMetrics:
    """Several models' figures on one ``/metrics``: each model keeps its own metrics object (its samples
    labelled with its ``model_name``), and one registry shows them merged, a family's samples together, with
    whether each model is loaded and how often it was stopped for another. With one model it is that model's
    own registry, so the page is what it always was."""

    def __init__(self, by_model: dict[str, ServerMetrics]) -> None:
        self.by_model = by_model
        self.loaded: Gauge | None = None
        self.unloads: Counter | None = None
        if len(by_model) == 1:
            self.registry = next(iter(by_model.values())).registry
            return
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Merged([m.registry for m in by_model.values()]))
        self.loaded = Gauge("conveyor:model_loaded", "1 while the model is loaded, 0 while it is not",
                            ["model_name"], registry=self.registry)
        self.unloads = Counter("conveyor:model_unloads", "Times the model was stopped to make room for another",
                               ["model_name"], registry=self.registry)
        for name in by_model:
            self.unloads.labels(name)

    def on_scrape(self, loaded: dict[str, EngineClient]) -> None:
        """Read each running engine's figures (a model not loaded keeps its counters, and its gauges as its
        engine last left them)."""
        for name, engine in loaded.items():
            self.by_model[name].on_scrape(engine)
        if self.loaded is not None:
            for name in self.by_model:
                self.loaded.labels(name).set(name in loaded)

    def on_unload(self, name: str, engine: EngineClient) -> None:
        """A model's engine is about to stop: count what it did last, then let its next engine count from 0."""
        metrics = self.by_model[name]
        metrics.on_scrape(engine)
        if isinstance(metrics, EngineMetrics):
            metrics.engine_replaced()
        if self.unloads is not None:
            self.unloads.labels(name).inc()


class _Merged:
    """A Prometheus collector over several registries: a family that more than one holds is shown once, with
    every registry's samples (the text format allows one HELP and TYPE line per family)."""

    def __init__(self, registries: list[CollectorRegistry]) -> None:
        self._registries = registries

    def collect(self) -> Iterable[Metric]:
        families: dict[str, Metric] = {}
        for registry in self._registries:
            for family in registry.collect():
                merged = families.get(family.name)
                if merged is None:
                    merged = families[family.name] = Metric(family.name, family.documentation, family.type,
                                                            family.unit)
                merged.samples.extend(family.samples)
        return families.values()
