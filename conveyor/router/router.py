"""The router: one object that the real front end and the simulator both ask where a request goes.

It holds what it knows of each replica (healthy or not, its latest load, the requests it sent
there and not yet seen finish, and for cache-aware routing the prefixes it sent there), and
hands a policy the healthy replicas only. Pure Python and torch-free, so the simulator runs it
unchanged; time comes from a clock it is given (the simulator's virtual one).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from conveyor.router.policies import CacheAwareSettings, ReplicaView, RoutingPolicy, make_policy
from conveyor.router.prefix_index import PrefixIndex, block_hashes

DEFAULT_INDEX_CAPACITY_BLOCKS = 1 << 16  # until a replica reports its KV capacity
DEFAULT_INDEX_TTL_S = 600.0


class NoHealthyReplica(Exception):
    """Every replica is down (or excluded for this request): the request cannot be placed now."""


@dataclass(slots=True)
class ReplicaState:
    """The router's view of one replica."""

    healthy: bool = True
    num_waiting: int = 0  # from the replica's latest stats
    num_running: int = 0
    kv_usage: float = 0.0
    in_flight: int = 0  # sent by this router and not finished yet
    num_routed: int = 0  # since start

    def view(self, replica: int, matched_blocks: int = 0) -> ReplicaView:
        num_requests = max(self.num_waiting + self.num_running, self.in_flight)
        return ReplicaView(replica, num_requests, self.kv_usage, matched_blocks)


class Router:
    """Places requests on ``num_replicas`` replicas with one :class:`RoutingPolicy`."""

    def __init__(
        self,
        num_replicas: int,
        policy: str | RoutingPolicy,
        *,
        block_size: int = 16,
        seed: int = 0,
        settings: CacheAwareSettings | None = None,
        index_ttl: float = DEFAULT_INDEX_TTL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if num_replicas < 1 or block_size < 1:
            raise ValueError(f"a router needs num_replicas >= 1 and block_size >= 1, got {num_replicas}, {block_size}")
        self.policy = make_policy(policy, seed, settings) if isinstance(policy, str) else policy
        self.block_size = block_size
        self.clock = clock
        self.replicas = [ReplicaState() for _ in range(num_replicas)]
        self.indexes = [PrefixIndex(DEFAULT_INDEX_CAPACITY_BLOCKS, index_ttl) for _ in range(num_replicas)]

    @property
    def num_replicas(self) -> int:
        return len(self.replicas)

    def route(self, prompt_token_ids: Sequence[int], exclude: Sequence[int] = ()) -> int:
        """The replica for a new request (counted in flight there until :meth:`finished`).

        ``exclude``: replicas not to use for this request (one that just failed it). Raises
        :class:`NoHealthyReplica` when no healthy replica is left.
        """
        candidates = [i for i, state in enumerate(self.replicas) if state.healthy and i not in exclude]
        if not candidates:
            raise NoHealthyReplica(f"no healthy replica among {self.num_replicas}")
        now = self.clock()
        hashes = block_hashes(prompt_token_ids, self.block_size) if self.policy.uses_prefix_index else []
        views = [
            self.replicas[i].view(i, self.indexes[i].match_length(hashes, now) if hashes else 0) for i in candidates
        ]
        chosen = self.policy.choose(views, len(hashes))
        if chosen not in candidates:
            raise RuntimeError(f"policy {self.policy.name} chose replica {chosen}, not one of {candidates}")
        if hashes:
            self.indexes[chosen].insert(hashes, now)
        state = self.replicas[chosen]
        state.in_flight += 1
        state.num_routed += 1
        return chosen

    def finished(self, replica: int) -> None:
        """A request routed to ``replica`` ended (finished, aborted or failed)."""
        state = self.replicas[replica]
        state.in_flight = max(state.in_flight - 1, 0)

    def remember(self, replica: int, token_ids: Sequence[int]) -> None:
        """``replica`` finished a sequence whose KV it now caches: its prompt and its answer but the last token
        (sampled, never fed back). A chat's next turn resends that answer, so the index must know it: with the
        prompt alone a turn's match stops where the previous answer began, and an exchange longer than the
        history before it falls under ``cache_threshold`` and is placed on load alone, off its cache."""
        if self.policy.uses_prefix_index and self.replicas[replica].healthy:
            self.indexes[replica].insert(block_hashes(token_ids, self.block_size), self.clock())

    def report_load(
        self, replica: int, num_waiting: int, num_running: int, kv_usage: float, num_kv_blocks: int | None = None
    ) -> None:
        """The replica's latest stats; ``num_kv_blocks`` bounds its prefix index to what its cache can hold."""
        state = self.replicas[replica]
        state.num_waiting, state.num_running, state.kv_usage = num_waiting, num_running, kv_usage
        if num_kv_blocks is not None and num_kv_blocks != self.indexes[replica].capacity_blocks:
            self.indexes[replica].resize(num_kv_blocks)

    def set_healthy(self, replica: int, healthy: bool) -> None:
        """Take a replica out of routing, or back. A replica that is only slow to answer keeps its cache, and
        so its index; one that restarted is :meth:`forget` first."""
        state = self.replicas[replica]
        if not healthy:
            state.in_flight = 0
            state.num_waiting = state.num_running = 0
            state.kv_usage = 0.0
        state.healthy = healthy

    def forget(self, replica: int) -> None:
        """The replica restarted with an empty cache: nothing routed there before is cached any more."""
        self.indexes[replica].clear()

    def healthy_replicas(self) -> list[int]:
        return [i for i, state in enumerate(self.replicas) if state.healthy]
