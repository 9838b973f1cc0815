"""Scheduling policies as objects: what differs between fcfs, priority and lpm, chosen once at construction.

The continuous scheduler owns the mechanics of a step (the token budget, admission by memory and
``max_num_seqs``, preemption, swap); a policy owns the three choices that differ (SGLang keeps its
policies as functions over the waiting queue; here each is a small object, since lpm keeps a per-step
order and priority a thrash guard):

* ``order``: the key every queue is kept sorted by (arrival, or priority then arrival);
* ``next_to_admit``: whom admission considers next among the waiting;
* ``victims_for``: whom to preempt so that a newcomer fits (most policies: nobody);

and hears of requests entering and leaving the queues and of the tokens each step drew, which a
policy that keeps accounts (``fair``: a virtual counter per tenant) needs.

Whom to preempt for memory is the same for every policy: the back of the running queue in the
policy's order, the request the policy cares least about.
"""

from collections.abc import Mapping

from conveyor.core.kv import PagedKVCacheManager
from conveyor.core.scheduler.policies.base import SchedulingPolicy, arrival_order, priority_order
from conveyor.core.scheduler.policies.fair import FairPolicy, TenantAccount
from conveyor.core.scheduler.policies.lpm import LongestPrefixMatch
from conveyor.core.scheduler.policies.priority import PriorityPolicy

POLICY_CLASSES: dict[str, type[SchedulingPolicy]] = {
    "fcfs": SchedulingPolicy,
    "priority": PriorityPolicy,
    "lpm": LongestPrefixMatch,
    "fair": FairPolicy,
}


def make_policy(name: str, kv_manager: PagedKVCacheManager,
                tenant_weights: Mapping[str, float] | None = None) -> SchedulingPolicy:
    """The policy ``--scheduling-policy`` names, over the scheduler's KV manager (lpm reads its prefix cache);
    ``tenant_weights`` are fair's (a tenant not named weighs 1)."""
    if name == FairPolicy.name:
        return FairPolicy(kv_manager, tenant_weights)
    return POLICY_CLASSES[name](kv_manager)


__all__ = ["POLICY_CLASSES", "FairPolicy", "LongestPrefixMatch", "PriorityPolicy", "SchedulingPolicy",
           "TenantAccount", "arrival_order", "make_policy", "priority_order"]
