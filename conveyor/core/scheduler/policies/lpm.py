"""Longest prefix match: the waiting request with the most tokens in the prefix cache first (SGLang's ``lpm``)."""

from __future__ import annotations

from collections.abc import Callable

from conveyor.core.request import Request, RequestStatus
from conveyor.core.scheduler.policies.base import SchedulingPolicy, priority_order

LPM_QUEUE_LIMIT = 128  # past this many waiting requests, lpm falls back to the queue's order (SGLang's threshold)
_WAITING = (RequestStatus.WAITING, RequestStatus.PREEMPTED)


class LongestPrefixMatch(SchedulingPolicy):
    """Admits by cached prefix, longest first, so requests that share a prefix run while it is still cached.

    The queues themselves are kept in priority order (then arrival), which breaks ties between equal
    prefixes and is the order once the queue is too long to look up; with every priority equal, as when
    none is given, that is arrival order. lpm never preempts for a newcomer.
    """

    name = "lpm"
    order: Callable[[Request], tuple] = staticmethod(priority_order)

    def __init__(self, kv_manager) -> None:
        super().__init__(kv_manager)
        self._step_order: list[Request] | None = None  # this step's admission order, computed on first use

    def start_admission(self) -> None:
        self._step_order = None

    def next_to_admit(self, waiting: list[Request], passed_over: set[str]) -> Request | None:
        if not waiting:
            return None
        if self._step_order is None:
            self._step_order = self._longest_prefix_first(waiting)
        queue = self._step_order or waiting  # this step's order holds requests admitted earlier in the step too
        return next((r for r in queue if r.status in _WAITING and r.request_id not in passed_over), None)

    def _longest_prefix_first(self, waiting: list[Request]) -> list[Request]:
        """The waiting queue by cached prefix, longest first (the queue's order breaks ties).

        Looking up every waiting request costs a lookup per block each step, and a request with nothing
        cached could wait behind others indefinitely, so past ``LPM_QUEUE_LIMIT`` waiting requests this is
        empty and the queue's own order is used.
        """
        if len(waiting) > LPM_QUEUE_LIMIT:
            return []
        cached = {id(r): self.kv_manager.cached_prefix(r).num_tokens for r in waiting}
        return sorted(waiting, key=lambda r: (-cached[id(r)], *self.order(r)))
