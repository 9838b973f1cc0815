"""Prometheus metrics of data-parallel replicas: vLLM's engine gauges with a ``replica`` label, plus the
router's and failover's counts, updated from the front end's polls of each replica's stats; and the front
end's request ledger, as one engine's server reports it."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from conveyor.core.stats import EngineStats
from conveyor.engine import EngineClient
from conveyor.engine.replicas import FailoverCounts, ReplicaHealth
from conveyor.entrypoints.metrics import RequestLedgerMetrics


class ReplicaMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        r, labels = self.registry, ["model_name", "replica"]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"conveyor:{name}", doc, labels, registry=r)

        def counter(name: str, doc: str, label_names: list[str] = labels) -> Counter:
            return Counter(f"conveyor:{name}", doc, label_names, registry=r)

        self.running = gauge("num_requests_running", "Requests in the replica's running batch")
        self.waiting = gauge("num_requests_waiting", "Requests waiting to be admitted on the replica")
        self.swapped = gauge("num_requests_swapped", "Requests whose KV is swapped out to CPU on the replica")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of the replica's KV blocks held by requests, 0..1")
        self.healthy = gauge("replica_healthy", "1 while the replica answers and is routed to, else 0")
        self.prefix_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the replica's prefix cache")
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens found in the replica's prefix cache")
        self.preemptions = counter("num_preemptions", "Preemptions on the replica (recompute or swap)")
        self.restarts = counter("replica_restarts", "Times the replica came back in a new process")
        self.routed = counter("router_requests_routed", "Requests the router sent to the replica")
        self.failover = counter("router_failover_requests", "Requests a replica failure touched, by outcome",
                                ["model_name", "outcome"])
        self.ledger = RequestLedgerMetrics(r, model_name)
        self._model = model_name
        self._counted: dict[tuple[str, int], float] = {}  # running totals as last added, per replica

    def on_scrape(self, engine: EngineClient) -> None:
        """The front end's request ledger (see ReplicaSet.request_counts), read when the metrics are scraped;
        each replica's gauges come from its own snapshot at every poll (``on_poll``), not from their sum."""
        self.ledger.on_requests(engine.request_counts())

    def on_poll(self, replica: int, health: ReplicaHealth, num_routed: int, failover: FailoverCounts) -> None:
        """After the front end polled ``replica``: its gauges, and counters advanced to its running totals."""
        m, label = self._model, str(replica)
        self.healthy.labels(m, label).set(1 if health.healthy else 0)
        self._advance(self.restarts, replica, "restarts", health.restarts)
        self._advance(self.routed, replica, "routed", num_routed)
        for outcome in ("retried", "errored", "unplaced"):
            self._advance(self.failover, -1, outcome, getattr(failover, outcome), (m, outcome))
        stats: EngineStats | None = health.stats
        if stats is None:
            return
        self.running.labels(m, label).set(stats.num_running)
        self.waiting.labels(m, label).set(stats.num_waiting)
        self.swapped.labels(m, label).set(stats.num_swapped)
        self.kv_usage.labels(m, label).set(stats.kv_usage)
        self._advance(self.preemptions, replica, "preemptions", stats.num_preemptions)
        self._advance(self.prefix_queries, replica, "prefix_queries", stats.prefix_cache_queries)
        self._advance(self.prefix_hits, replica, "prefix_hits", stats.prefix_cache_hits)

    def _advance(self, counter: Counter, replica: int, name: str, total: float,
                 labels: tuple[str, ...] | None = None) -> None:
        """Move a counter to a running total; a restarted replica's totals start again from 0."""
        key = (name, replica)
        last = self._counted.get(key, 0)
        increase = total - last if total >= last else total
        counter.labels(*(labels or (self._model, str(replica)))).inc(increase)
        self._counted[key] = total
