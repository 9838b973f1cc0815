"""Routing policies: which replica a new request goes to, given each replica's load and (for
cache-aware routing) what prefixes it is believed to hold.

All policies share one interface, :class:`RoutingPolicy`, and see the replicas only through
:class:`ReplicaView`: the router hands them healthy replicas only, so no policy can pick a dead one.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True)
class ReplicaView:
    """What a policy may know of one healthy replica when a request arrives."""

    replica: int  # its index among the router's replicas
    num_requests: int  # waiting + running (the router's count of requests sent and not finished, if higher)
    kv_usage: float  # share of its KV blocks held by requests, 0..1
    matched_blocks: int = 0  # leading blocks of this prompt it is believed to hold (cache-aware only)

    @property
    def load(self) -> float:
        """Requests first; KV usage (0..1) only separates replicas with as many requests."""
        return self.num_requests + self.kv_usage


class RoutingPolicy(Protocol):
    name: str
    uses_prefix_index: bool  # whether the router should fill ``matched_blocks``

    def choose(self, replicas: Sequence[ReplicaView], num_prompt_blocks: int) -> int:
        """The index (``ReplicaView.replica``) of the replica to send the request to; ``replicas`` is not empty."""
        ...


class RandomPolicy:
    """Uniformly at random: the baseline llm-d compares its scorers with."""

    name = "random"
    uses_prefix_index = False

    def __init__(self, seed: int = 0) -> None:
        self._rng = random.Random(seed)

    def choose(self, replicas: Sequence[ReplicaView], num_prompt_blocks: int) -> int:
        return self._rng.choice(replicas).replica


class RoundRobinPolicy:
    """Each replica in turn, skipping unhealthy ones; blind to load and to caches."""

    name = "round-robin"
    uses_prefix_index = False

    def __init__(self) -> None:
        self._next = 0

    def choose(self, replicas: Sequence[ReplicaView], num_prompt_blocks: int) -> int:
        ordered = sorted(replicas, key=lambda view: view.replica)
        pick = next((view for view in ordered if view.replica >= self._next), ordered[0])
        self._next = pick.replica + 1
        return pick.replica


def least_loaded(replicas: Sequence[ReplicaView], rotation: int = 0) -> int:
    """The replica with the least load; ties go round the replicas (from ``rotation``), not always to the first."""
    count = len(replicas)
    best = min(range(count), key=lambda i: (replicas[i].load, (i - rotation) % count))
    return replicas[best].replica


class LeastLoadedPolicy:
    """The replica with the fewest waiting + running requests (then the lowest KV usage)."""

    name = "least-loaded"
    uses_prefix_index = False

    def __init__(self) -> None:
        self._rotation = 0

    def choose(self, replicas: Sequence[ReplicaView], num_prompt_blocks: int) -> int:
        self._rotation += 1
        return least_loaded(replicas, self._rotation)


@dataclass(frozen=True, slots=True)
class CacheAwareSettings:
    """When cache affinity gives way to load (the shape of SGLang's cache-aware router).

    Loads are imbalanced when the busiest replica has more than ``balance_abs_threshold`` requests
    above the idlest *and* more than ``balance_rel_threshold`` times as many; then the least loaded
    replica takes the request. Otherwise the best prefix match does, if it covers at least
    ``cache_threshold`` of the prompt's full blocks; a weaker match goes to the least loaded.
    """

    balance_abs_threshold: int = 32
    balance_rel_threshold: float = 1.5
    cache_threshold: float = 0.5

    def __post_init__(self) -> None:
        if self.balance_abs_threshold < 0 or self.balance_rel_threshold < 1 or not 0 <= self.cache_threshold <= 1:
            raise ValueError("cache-aware routing needs balance_abs_threshold >= 0, balance_rel_threshold >= 1 "
                             f"and 0 <= cache_threshold <= 1, got {self}")


class CacheAwarePolicy:
    """The replica believed to hold the longest prefix of the prompt, unless loads are imbalanced."""

    name = "cache-aware"
    uses_prefix_index = True

    def __init__(self, settings: CacheAwareSettings | None = None) -> None:
        self.settings = settings or CacheAwareSettings()
        self._rotation = 0

    def is_imbalanced(self, replicas: Sequence[ReplicaView]) -> bool:
        busiest = max(view.num_requests for view in replicas)
        idlest = min(view.num_requests for view in replicas)
        s = self.settings
        return busiest - idlest > s.balance_abs_threshold and busiest > s.balance_rel_threshold * idlest

    def choose(self, replicas: Sequence[ReplicaView], num_prompt_blocks: int) -> int:
        self._rotation += 1
        if self.is_imbalanced(replicas):
            return least_loaded(replicas, self._rotation)
        best = max(replicas, key=lambda view: (view.matched_blocks, -view.load))
        if best.matched_blocks > 0 and best.matched_blocks >= self.settings.cache_threshold * num_prompt_blocks:
            return best.replica
        return least_loaded(replicas, self._rotation)


POLICY_NAMES = ("round-robin", "least-loaded", "cache-aware", "random")


def make_policy(name: str, seed: int = 0, settings: CacheAwareSettings | None = None) -> RoutingPolicy:
    """The policy ``--router-policy`` names."""
    if name == "round-robin":
        return RoundRobinPolicy()
    if name == "least-loaded":
        return LeastLoadedPolicy()
    if name == "cache-aware":
        return CacheAwarePolicy(settings)
    if name == "random":
        return RandomPolicy(seed)
    raise ValueError(f"router policy: {name!r} is not one of {', '.join(POLICY_NAMES)}")
