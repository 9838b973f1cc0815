"""Deadlines: least slack first, and the running requests' time per output token protected.

A request may carry two targets (``Request.ttft_slo``, ``Request.tpot_slo``, seconds; ``--ttft-slo-ms`` and
``--tpot-slo-ms`` give defaults). Its deadline is that of the token it waits for: its first token's,
``arrival + ttft_slo``, until it has one; then its next token's on the schedule its TPOT target sets,
``first_token_time + tpot_slo * num_output_tokens`` (TPOT is a mean, so a request ahead of that schedule has
time banked). Its slack is its deadline less the work it still needs (its prompt, or what a preemption made it
recompute, priced by the measured step times) less now. The policy then decides three things:

* whom to admit: the waiting request with the least slack that can still make its deadline; those that cannot
  any more (negative slack) wait until nobody on time does, since serving a lost request first makes the next
  one late too (the domino effect of earliest-deadline-first under overload);
* whom to preempt for memory: the running request that can best afford it (no target, or already late, first;
  then the most slack left after paying for its recompute), never one pushed past its deadline while another
  could have gone without;
* how many tokens admissions may add to a step: no more than keep the step within the time every on-time
  decoding request has before its next token is due. A request ahead of its schedule lets a long prefill
  through; one just on it holds the step to decodes. Nobody running is preempted for a newcomer.

Its queue of waiting requests (``_queue``) is kept sorted by latest start (deadline less the work), priced when
a request joins it, so choosing is a binary search rather than a scan; the scheduler's own queues stay in
arrival order.
"""

from __future__ import annotations

import bisect
import itertools
import math
import time
from collections.abc import Callable

from conveyor.core.kv import PagedKVCacheManager
from conveyor.core.request import Request
from conveyor.core.scheduler.policies.base import SchedulingPolicy
from conveyor.core.scheduler.step_times import StepTimes

PRICE_DIGITS = 9  # latest starts are compared to the nanosecond (see SloPolicy.latest_start)
Entry = tuple[float, int, Request]  # (latest start, arrival order, request): arrival order is unique, ties end there
Line = tuple[float, float] | None  # StepTimes.line(): (seconds per step, seconds per token)


def work_seconds(num_tokens: int, line: Line, max_num_batched_tokens: int) -> float:
    """Time to compute ``num_tokens`` tokens of one request, in steps of at most the token budget; 0 while the
    step times are unknown."""
    if line is None or num_tokens <= 0:
        return 0.0
    steps = -(-num_tokens // max_num_batched_tokens)
    return steps * line[0] + num_tokens * line[1]


def deadline(request: Request) -> float:
    """When the token the request waits for is due (inf without a target for it)."""
    if request.first_token_time is None:
        return math.inf if request.ttft_slo is None else request.arrival_time + request.ttft_slo
    if request.tpot_slo is None:
        return math.inf
    return request.first_token_time + request.tpot_slo * request.num_output_tokens


class SloPolicy(SchedulingPolicy):
    """Least slack first among the waiting, TPOT kept for the running (see the module's docstring)."""

    name = "slo"
    uses_step_times = True

    def __init__(self, kv_manager: PagedKVCacheManager, clock: Callable[[], float] = time.monotonic,
                 step_times: StepTimes | None = None, max_num_batched_tokens: int = 2048) -> None:
        super().__init__(kv_manager)
        self.clock = clock
        self.step_times = step_times if step_times is not None else StepTimes()
        self.max_num_batched_tokens = max_num_batched_tokens
        self._queue: list[Entry] = []  # the waiting requests by latest start
        self._entries: dict[str, Entry] = {}

    # ----- slack ---------------------------------------------------------------

    def latest_start(self, request: Request, line: Line = None) -> float:
        """The deadline less the work the request still lacks: it is late once the clock passes this. Rounded to
        the nanosecond: the step-time line is fitted again every step, so a request queued again after a
        preemption is priced by a line that differs in its last bits, and equal requests must still tie (their
        arrival order decides) rather than be ordered by that noise."""
        lacking = request.num_tokens - request.num_computed_tokens
        return round(deadline(request) - work_seconds(lacking, line, self.max_num_batched_tokens), PRICE_DIGITS)

    def admission_key(self, request: Request, line: Line) -> float | None:
        """Where a newcomer would join the queue; admission control counts the on-time work ahead of it."""
        return self.latest_start(request, line)

    def queue_keys(self) -> tuple[tuple[float, ...], tuple[int, ...]]:
        """The waiting queue's latest starts, ascending, and the running sums of their tokens (one longer)."""
        sums = [0]
        for _, _, request in self._queue:
            sums.append(sums[-1] + request.num_tokens)
        return tuple(entry[0] for entry in self._queue), tuple(sums)

    # ----- the choices -----------------------------------------------------------

    def next_to_admit(self, waiting: list[Request], passed_over: set[str]) -> Request | None:
        """The least slack among those still on time; when none is, the most overdue first."""
        queue = self._queue
        on_time = bisect.bisect_left(queue, (self.clock(),))
        for index in itertools.chain(range(on_time, len(queue)), range(on_time)):
            request = queue[index][2]
            if request.request_id not in passed_over:
                return request
        return None

    def resumes_before(self, swapped: Request, waiting: Request | None) -> bool:
        if waiting is None:
            return True
        entry = self._entries.get(waiting.request_id)
        return entry is None or self.latest_start(swapped, self.step_times.line()) <= entry[0]

    def memory_victim(self, running: list[Request], needing: Request) -> Request:
        """The running request that can best afford a preemption (see ``victim_rank``)."""
        now, line = self.clock(), self.step_times.line()
        return max(running, key=lambda r: self.victim_rank(r, now, line))

    def victim_rank(self, request: Request, now: float, line: Line) -> tuple[int, float, int]:
        """Higher is a better victim: first those with nothing to lose (no target, or already late: most recent
        arrival first), then the on-time by the slack a recompute would leave them."""
        due = deadline(request)
        slack = due - now
        if math.isinf(due) or slack < 0:
            return (1, 0.0, request.arrival_order)
        left = slack - work_seconds(request.num_tokens, line, self.max_num_batched_tokens)
        return (0, left, request.arrival_order)

    def admission_tokens(self, budget: int, num_scheduled: int, running: list[Request]) -> int:
        """Tokens admissions may add to a step of ``num_scheduled`` tokens: as many as keep it within the least
        time an on-time decoding request has before its next token is due (its slack)."""
        allowance = math.inf
        now = self.clock()
        for request in running:
            if request.first_token_time is None or request.tpot_slo is None:
                continue  # still computing its prompt, or no TPOT target
            slack = deadline(request) - now
            if 0 <= slack < allowance:
                allowance = slack
        if math.isinf(allowance):
            return budget
        fits = self.step_times.tokens_within(allowance)
        if fits is None:
            return budget
        return max(0, min(budget, fits - num_scheduled))

    def has_backlog(self, waiting: list[Request]) -> bool:
        """Only on-time requests count: the late ones wait until no one on time does, so their waiting says
        nothing of how fast on-time work drains (and would make the drain rate look as if it never stopped)."""
        return bool(self._queue) and self._queue[-1][0] >= self.clock()

    # ----- the queue ---------------------------------------------------------------

    def on_arrival(self, request: Request) -> None:
        self._enqueue(request)

    def on_queued(self, request: Request, swapped: bool) -> None:
        if not swapped:
            self._enqueue(request)

    def on_dequeued(self, request: Request, swapped: bool, first_admission: bool) -> None:
        if swapped:
            return
        entry = self._entries.pop(request.request_id)
        index = bisect.bisect_left(self._queue, entry[:2])
        assert self._queue[index][2] is request, "the slo queue lost its order"
        del self._queue[index]

    def _enqueue(self, request: Request) -> None:
        entry = (self.latest_start(request, self.step_times.line()), request.arrival_order, request)
        self._entries[request.request_id] = entry
        bisect.insort(self._queue, entry)
