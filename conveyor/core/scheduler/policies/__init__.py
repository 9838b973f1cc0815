"""Scheduling policies as objects: what differs between fcfs, priority, lpm, fair and slo, chosen once at construction.

The continuous scheduler owns the mechanics of a step (the token budget, admission by memory and
``max_num_seqs``, preemption, swap); a policy owns the choices that differ (SGLang keeps its
policies as functions over the waiting queue; here each is a small object, since lpm keeps a per-step
order and priority a thrash guard):

* ``order``: the key every queue is kept sorted by (arrival, or priority then arrival);
* ``next_to_admit``: whom admission considers next among the waiting;
* ``next_to_resume``: which swapped request resuming considers next (most: the first in their order;
  fair: the least-served tenant's);
* ``victims_for``: whom to preempt so that a newcomer fits (most policies: nobody);
* ``memory_victim``: whom to preempt when a running request needs a block and none is free (most
  policies: the back of the running queue in their order, the request they care least about; slo: the
  one that can best afford it);
* ``admission_tokens``: how much of a step's budget admissions may take (all of it, but for slo, which
  keeps a step short enough for the running requests' next tokens to be on time);

and hears of requests entering and leaving the queues and of the tokens each step drew, which a
policy that keeps accounts (``fair``: a virtual counter per tenant; ``slo``: its queue by slack) needs.
"""

from collections.abc import Callable, Mapping

from conveyor.core.kv import PagedKVCacheManager
from conveyor.core.scheduler.policies.base import SchedulingPolicy, arrival_order, priority_order
from conveyor.core.scheduler.policies.fair import FairPolicy, TenantAccount
from conveyor.core.scheduler.policies.lpm import LongestPrefixMatch
from conveyor.core.scheduler.policies.priority import PriorityPolicy
from conveyor.core.scheduler.policies.slo import SloPolicy
from conveyor.core.scheduler.step_times import StepTimes

POLICY_CLASSES: dict[str, type[SchedulingPolicy]] = {
    "fcfs": SchedulingPolicy,
    "priority": PriorityPolicy,
    "lpm": LongestPrefixMatch,
    "fair": FairPolicy,
    "slo": SloPolicy,
}


def make_policy(name: str, kv_manager: PagedKVCacheManager,
                tenant_weights: Mapping[str, float] | None = None, clock: Callable[[], float] | None = None,
                step_times: StepTimes | None = None, max_num_batched_tokens: int = 2048) -> SchedulingPolicy:
    """The policy ``--scheduling-policy`` names, over the scheduler's KV manager (lpm reads its prefix cache);
    ``tenant_weights`` are fair's (a tenant not named weighs 1); the clock, the measured step times and the
    token budget are slo's."""
    if name == FairPolicy.name:
        return FairPolicy(kv_manager, tenant_weights)
    if name == SloPolicy.name:
        if clock is None:
            return SloPolicy(kv_manager, step_times=step_times, max_num_batched_tokens=max_num_batched_tokens)
        return SloPolicy(kv_manager, clock, step_times, max_num_batched_tokens)
    return POLICY_CLASSES[name](kv_manager)


__all__ = ["POLICY_CLASSES", "FairPolicy", "LongestPrefixMatch", "PriorityPolicy", "SchedulingPolicy", "SloPolicy",
           "TenantAccount", "arrival_order", "make_policy", "priority_order"]
