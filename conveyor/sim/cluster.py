"""N simulated engine replicas behind the real router, on one virtual timeline: cluster sizing.

Each replica is the single-engine simulation's parts (the engine core with its scheduler and
prefix-caching KV manager, a cost-model executor on its own virtual clock); the router is
:class:`conveyor.router.Router`, the same object the Ray front end asks. Events are taken in time
order: an arrival is routed (on the replicas' stats at that instant) when no replica's next
step starts earlier; otherwise the replica whose clock is furthest behind takes one step.
"""

from __future__ import annotations

import heapq
import itertools
import time
from dataclasses import dataclass
from typing import Any

from conveyor.core.burst import first_step_at
from conveyor.core.config import EngineConfig
from conveyor.core.engine_core import EngineCore, plan_kv_cache
from conveyor.core.request import Request, RequestStatus
from conveyor.core.scheduler.fast_forward import FastForwardScheduler
from conveyor.observe.figures import request_figures
from conveyor.router import Router
from conveyor.sim.cost import CostModel
from conveyor.sim.executor import SimulatedExecutor, VirtualClock
from conveyor.sim.simulator import (
    FinishedSums,
    closed_loop_feeds,
    fast_forward_group,
    mid_run_rates,
    run_step,
    tenant_figures,
    workload_request,
)
from conveyor.sim.workload import ConversationShape, SenderShape, WorkloadRequest

FINISHED = RequestStatus.FINISHED


@dataclass(slots=True)
class SimulatedReplica:
    """One engine: its clock runs ahead of the cluster's by the step it is in."""

    clock: VirtualClock
    executor: SimulatedExecutor
    core: EngineCore
    group: FastForwardScheduler | None = None  # its fast-forward's group of decodes (simulator.run_step)
    num_routed: int = 0
    burst_first: float | None = None  # woken from idle at this time, its first step not taken yet (core.burst)

    def busy(self) -> bool:
        return self.core.has_unfinished_requests()


class ClusterSimulation:
    """One workload on ``num_replicas`` identical replicas behind ``router_policy``; run once with :meth:`run`."""

    def __init__(
        self,
        config: EngineConfig,
        cost: CostModel,
        workload: list[WorkloadRequest],
        num_replicas: int,
        router_policy: str,
        conversations: list[ConversationShape] | None = None,
        seed: int = 0,
        fast_forward: bool = True,
        senders: list[SenderShape] | None = None,
    ) -> None:
        """``fast_forward``: each replica advances its determined decodes as a group (the same results).
        ``conversations`` and ``senders`` are closed loops, as in :class:`~conveyor.sim.simulator.Simulation`: a
        request's follow-up arrives at the router as it finishes, and is routed like any other."""
        if num_replicas < 1:
            raise ValueError(f"--num-replicas must be >= 1, got {num_replicas}")
        self.config = config
        self.cost = cost
        self.fast_forward = fast_forward
        self.plan = plan_kv_cache(config, cost.kv_bytes_per_token, cost.model.max_position_embeddings,
                                  cost.model.layer_windows)
        self.replicas = [self._replica() for _ in range(num_replicas)]
        self.router_clock = VirtualClock()
        self.router = Router(num_replicas, router_policy, block_size=config.block_size, seed=seed,
                             clock=self.router_clock)
        self.feeds = closed_loop_feeds(conversations, senders, self.plan.max_model_len)
        self._arrivals: list[tuple[float, int, Request]] = []  # (time, tie-break, request): a heap
        self._order = itertools.count()
        for index, item in enumerate(sorted(workload, key=lambda r: r.arrival_time)):
            self._push(workload_request(item, index, self.plan.max_model_len))
        for feed in self.feeds:
            for request in feed.first_requests():
                self._push(request)
        self._replica_of: dict[str, int] = {}

    def _replica(self) -> SimulatedReplica:
        clock = VirtualClock()
        executor = SimulatedExecutor(self.cost, clock, self.config.block_size)
        token = executor.token_id if self.fast_forward else None
        core = EngineCore(self.config, self.plan, executor, clock, fast_forward_token=token)
        executor.listed = core.scheduler.listed
        return SimulatedReplica(clock, executor, core, fast_forward_group(core))

    def _push(self, request: Request) -> None:
        heapq.heappush(self._arrivals, (request.arrival_time, next(self._order), request))

    def run(self) -> dict[str, Any]:
        """Run to the last finish; the single-engine figures for the whole cluster, and a few per replica."""
        wall_start = time.perf_counter()
        finished = FinishedSums(serving_latency=self.cost.serving_s_per_request)
        steps = 0
        while True:
            busy = [replica for replica in self.replicas if replica.busy()]
            next_step = min((replica.clock.now for replica in busy), default=float("inf"))
            if self._arrivals and self._arrivals[0][0] <= next_step:
                self._route(heapq.heappop(self._arrivals)[2])
            elif busy:
                replica = min(busy, key=lambda r: r.clock.now)
                self._step(replica, finished)
                steps += 1
            else:
                break
        end = max(replica.clock.now for replica in self.replicas)
        figures = self._figures(finished, steps, end)
        figures["simulation_wall_s"] = time.perf_counter() - wall_start
        return figures

    def _route(self, request: Request) -> None:
        now = self.router_clock.now = request.arrival_time
        for index, replica in enumerate(self.replicas):
            stats = replica.core.stats()
            self.router.report_load(index, stats.num_waiting + stats.num_swapped, stats.num_running, stats.kv_usage,
                                    stats.num_kv_blocks)
        index = self.router.route(request.prompt_token_ids)
        replica = self.replicas[index]
        if not replica.busy() and now >= replica.clock.now:  # idle since its last step: a burst begins
            replica.burst_first = now
        if replica.burst_first is not None:  # its first step waits for the rest of the burst
            replica.clock.now = first_step_at(replica.burst_first, now, self.config.burst_wait_ms / 1000)
        replica.core.add_request(request)
        replica.num_routed += 1
        self._replica_of[request.request_id] = index

    def _step(self, replica: SimulatedReplica, finished: FinishedSums) -> None:
        replica.burst_first = None
        for request in run_step(replica.core, replica.executor, replica.group)[0]:
            if request.status is not FINISHED:
                continue
            finished.add(request)
            index = self._replica_of.pop(request.request_id)
            self.router.finished(index)
            self.router_clock.now = max(self.router_clock.now, replica.clock.now)
            self.router.remember(index, request.prompt_token_ids + request.output_token_ids[:-1])
            for feed in self.feeds:
                if (follow_up := feed.follow_up(request, replica.clock.now)) is not None:
                    self._push(follow_up)

    def _figures(self, finished: FinishedSums, steps: int, end: float) -> dict[str, Any]:
        start = min(finished.arrivals, default=0.0)
        prompt_tokens = sum(finished.prompt_lens)
        busy_time = sum(replica.executor.busy_time for replica in self.replicas)
        offered, completed = mid_run_rates(finished.arrivals, finished.finishes)
        return {
            "hardware": self.cost.hardware.name,
            "dtype": self.cost.dtype,
            "tensor_parallel_size": self.cost.tensor_parallel_size,
            "num_replicas": len(self.replicas),
            "router_policy": self.router.policy.name,
            "num_kv_blocks_per_replica": self.plan.num_blocks,
            "max_model_len": self.plan.max_model_len,
            **request_figures(finished.prompt_lens, finished.output_lens, finished.ttft, finished.latency,
                              max(end - start, 1e-9), steps),
            "prompt_tokens_computed": prompt_tokens - finished.cached_tokens,
            "prefix_cache_hit_rate": finished.cached_tokens / max(prompt_tokens, 1),
            "preemptions": finished.preemptions,
            "requests_per_replica": [replica.num_routed for replica in self.replicas],
            "busy_fraction": busy_time / (len(self.replicas) * (end - start)) if end > start else 0.0,
            "offered_rate": offered,
            "completion_rate": completed,
            "steps_fast_forwarded": sum(r.group.num_group_steps for r in self.replicas if r.group is not None),
            **tenant_figures(finished),
        }


def simulate_cluster(
    config: EngineConfig,
    cost: CostModel,
    workload: list[WorkloadRequest],
    num_replicas: int,
    router_policy: str,
    conversations: list[ConversationShape] | None = None,
    seed: int = 0,
    fast_forward: bool = True,
    senders: list[SenderShape] | None = None,
) -> dict[str, Any]:
    """Run ``workload`` (and ``conversations``, ``senders``) on the cluster to the end; its figures."""
    return ClusterSimulation(config, cost, workload, num_replicas, router_policy, conversations, seed,
                             fast_forward, senders).run()
