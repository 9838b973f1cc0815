"""Priority: lower value first (vLLM's convention), and a newcomer may preempt less important running requests."""

from __future__ import annotations

from collections.abc import Callable

from conveyor.core.request import Request
from conveyor.core.scheduler.policies.base import FreesEnough, SchedulingPolicy, priority_order


class PriorityPolicy(SchedulingPolicy):
    """Queues by priority, then arrival; preempts for a more important newcomer only when that seats it."""

    name = "priority"
    order: Callable[[Request], tuple] = staticmethod(priority_order)

    def victims_for(self, request: Request, running: list[Request], step_index: int,
                    frees_enough: FreesEnough) -> list[Request] | None:
        """The fewest running requests, least important first and each strictly less important than
        ``request``, whose preemption makes it fit; None when no such set exists (then nobody is preempted:
        a preemption that would not seat the newcomer only loses work).
        """
        victims: list[Request] = []
        for victim in reversed(running):  # least important (and most recent) first
            if victim.priority <= request.priority:
                return None  # the rest rank at least as high
            if victim.last_preempted_by == (request.request_id, step_index - 1):
                return None  # thrash guard: not twice in consecutive steps by the same request
            victims.append(victim)
            if frees_enough(victims):
                return victims
        return None
