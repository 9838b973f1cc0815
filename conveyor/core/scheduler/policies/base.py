"""The policy interface, and first come, first served: the default every other policy departs from."""

from __future__ import annotations

from collections.abc import Callable

from conveyor.core.kv import PagedKVCacheManager
from conveyor.core.request import Request

# Does preempting these running requests make the newcomer fit (memory and max_num_seqs)? The scheduler
# answers; the policy only proposes.
FreesEnough = Callable[[list[Request]], bool]


def arrival_order(request: Request) -> tuple[float, int]:
    return (request.arrival_time, request.arrival_order)


def priority_order(request: Request) -> tuple[int, float, int]:
    """Lower value first, as in vLLM; arrival breaks ties."""
    return (request.priority, request.arrival_time, request.arrival_order)


class SchedulingPolicy:
    """First come, first served; the base of every policy, whose methods are the hooks the scheduler calls.

    ``order`` is a plain function, not a method, since it is the sort key of every queue insertion: a
    subclass sets it to another plain function.
    """

    name = "fcfs"
    order: Callable[[Request], tuple] = staticmethod(arrival_order)
    uses_step_times = False  # whether it reads the measured step times (the scheduler times steps only then)

    def __init__(self, kv_manager: PagedKVCacheManager) -> None:
        self.kv_manager = kv_manager

    def start_admission(self) -> None:
        """A step's admissions begin: forget whatever was worked out for the previous step's."""

    def next_to_admit(self, waiting: list[Request], passed_over: set[str]) -> Request | None:
        """The waiting request admission considers next; ``waiting`` is sorted by ``order``, and requests
        in ``passed_over`` wait this step out (their prefix is in flight)."""
        if not passed_over:
            return waiting[0] if waiting else None
        return next((r for r in waiting if r.request_id not in passed_over), None)

    def next_to_resume(self, swapped: list[Request]) -> Request:
        """The swapped request resuming considers next; ``swapped`` is sorted by ``order`` and not empty."""
        return swapped[0]

    def resumes_before(self, swapped: Request, waiting: Request | None) -> bool:
        """Whether ``swapped`` (``next_to_resume``'s choice) goes on before ``waiting``, the request admission
        would take."""
        return waiting is None or self.order(swapped) < self.order(waiting)

    def victims_for(self, request: Request, running: list[Request], step_index: int,
                    frees_enough: FreesEnough) -> list[Request] | None:
        """Running requests to preempt so that the waiting ``request`` fits, or None to let it wait.

        ``running`` is sorted by ``order``. First come, first served never preempts for a newcomer: the
        head of the queue waits for memory, and nobody overtakes it.
        """
        return None

    def memory_victim(self, running: list[Request], needing: Request) -> Request:
        """Whom to preempt when ``needing`` (a running request) lacks a block and the pool is empty: the back of
        the running queue, the request the policy's order cares least about (it may be ``needing`` itself).
        A policy that picks another must be ready for the scheduler to take back that victim's tokens of
        this step."""
        return running[-1]

    def admission_tokens(self, budget: int, num_scheduled: int, running: list[Request]) -> int:
        """Of the step's ``budget`` left after the running requests took ``num_scheduled`` tokens, how many
        admissions and resumes may use (all of it: only a policy that protects the running holds some back)."""
        return budget

    def admission_key(self, request: Request, line: tuple[float, float] | None) -> float | None:
        """Where a newcomer would join the policy's queue, for admission control to count the work ahead of it;
        None: everything queued is ahead (first come, first served and its kin)."""
        return None

    def queue_keys(self) -> tuple[tuple[float, ...], tuple[int, ...]] | None:
        """The policy's waiting queue as admission control reads it (keys ascending, running sums of tokens);
        None with ``admission_key`` None."""
        return None

    def has_backlog(self, waiting: list[Request]) -> bool:
        """Whether requests still wait that the engine would admit first: what makes a step count toward the
        drain rate (its admissions were limited, not the queue)."""
        return bool(waiting)

    # ----- what happens to requests, for policies that keep accounts (fair); the others ignore it ------

    def on_arrival(self, request: Request) -> None:
        """A new request joined the waiting queue."""

    def on_queued(self, request: Request, swapped: bool) -> None:
        """A preempted request went back to the waiting queue, or (``swapped``) to the swapped queue."""

    def on_dequeued(self, request: Request, swapped: bool, first_admission: bool) -> None:
        """A request left the waiting (or ``swapped``) queue: admitted, resumed or aborted there;
        ``first_admission``: admitted for the first time."""

    def on_tokens(self, requests: list[Request]) -> None:
        """Once per step: the requests that drew a token in it."""

    def on_finished(self, request: Request) -> None:
        """The request ended (finished, aborted or failed), wherever it was."""

    def tenant_report(self) -> dict[str, dict[str, float]]:
        """Per-tenant figures for the metrics; empty for policies that do not count tenants."""
        return {}
