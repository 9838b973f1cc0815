"""Request routing across engine replicas: policies, the approximate prefix index, and the router.

Pure Python and torch-free: the Ray front end (:mod:`conveyor.engine.replicas`) and the simulator
(:mod:`conveyor.sim.cluster`) run the same code.
"""

from conveyor.router.policies import (
    POLICY_NAMES,
    CacheAwarePolicy,
    CacheAwareSettings,
    LeastLoadedPolicy,
    RandomPolicy,
    ReplicaView,
    RoundRobinPolicy,
    RoutingPolicy,
    make_policy,
)
from conveyor.router.prefix_index import PrefixIndex, block_hashes
from conveyor.router.router import NoHealthyReplica, ReplicaState, Router

__all__ = [
    "POLICY_NAMES",
    "CacheAwarePolicy",
    "CacheAwareSettings",
    "LeastLoadedPolicy",
    "NoHealthyReplica",
    "PrefixIndex",
    "RandomPolicy",
    "ReplicaState",
    "ReplicaView",
    "RoundRobinPolicy",
    "Router",
    "RoutingPolicy",
    "block_hashes",
    "make_policy",
]
