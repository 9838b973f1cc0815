"""Load shedding: whether a new request may join the waiting queue, decided before it costs anything.

A server under overload that queues without bound makes every request miss its deadline; refusing some early
lets the rest meet theirs, and tells the refused client at once (a 429 with ``Retry-After``) rather than after
its timeout. Two rules, each off unless configured:

* queue caps (vLLM's ``--max-num-queued-requests``, ``--max-num-queued-tokens``): the waiting queue's requests
  and their tokens (prompt, and output so far for one preempted by recompute) may not pass the cap with the
  newcomer counted;
* deadlines (``--admission-control``): a request whose time-to-first-token target the wait ahead of it already
  misses, predicted from the measured step times (:mod:`conveyor.core.scheduler.step_times`), is refused. The
  wait is the work queued ahead of it (all of it; under slo, the on-time requests with less slack) at the
  measured drain rate, plus its own prompt priced by the step-time line.

Only arrivals are judged: a request once queued is never dropped by either rule (a preempted one goes back to
the queue whatever its length), and the other sequences of an n > 1 request join with their first. The
decision reads an :class:`AdmissionView`, a frozen copy of what it needs, so the server can decide on its own
thread within microseconds, without waiting for a step to end.
"""

from __future__ import annotations

import bisect
import json
import math
from dataclasses import dataclass

from conveyor.core.errors import FieldError, RequestRefused
from conveyor.core.request import Request

MAX_RETRY_AFTER_S = 60


@dataclass(frozen=True, slots=True)
class AdmissionView:
    """What admission reads of the engine, as of one moment: the waiting queue, the running batch's size and
    the measured step times (``step_line``: seconds per step and per token; ``drain_rate``: queued tokens taken
    in per second during a backlog, ``request_drain_rate`` the same in requests). ``keys``/``sums``: a policy's
    queue by key (see ``tokens_ahead``)."""

    num_queued_requests: int
    num_queued_tokens: int
    num_running: int
    step_line: tuple[float, float] | None
    drain_rate: float | None
    request_drain_rate: float | None = None  # queued requests taken in per second during a backlog
    keys: tuple[float, ...] | None = None  # ascending; None: every queued token is ahead of a newcomer
    sums: tuple[int, ...] = (0,)  # sums[i]: tokens of the first i keys' requests
    # margins[i]: the least time to spare among the requests from the i-th key on that are predicted to make their
    # deadline (inf: none), so a newcomer that would push one of them past it can be refused (see ``margins``)
    margins: tuple[float, ...] = (math.inf,)

    def margin_behind(self, key: float | None) -> float:
        """The least time to spare of the queued requests a newcomer of ``key`` would go ahead of."""
        if self.keys is None or key is None:
            return math.inf
        return self.margins[bisect.bisect_right(self.keys, key)]

    def tokens_ahead(self, key: float | None, now: float) -> int:
        """Queued tokens served before a newcomer of ``key``: with keys (slo's latest starts), those of the
        requests still on time (key >= now) whose key is not after its own; without, all of them."""
        if self.keys is None or key is None:
            return self.num_queued_tokens
        low, high = bisect.bisect_left(self.keys, now), bisect.bisect_right(self.keys, key)
        return self.sums[high] - self.sums[low] if high > low else 0

    def requests_ahead(self, key: float | None, now: float) -> int:
        """The same in requests."""
        if self.keys is None or key is None:
            return self.num_queued_requests
        low, high = bisect.bisect_left(self.keys, now), bisect.bisect_right(self.keys, key)
        return max(0, high - low)

    def drain_seconds(self, tokens: int, requests: int) -> float | None:
        """How long ``tokens`` queued tokens in ``requests`` requests take to drain: the longer of the two rates'
        answers (tokens where the budget limits admission, requests where seats do); None with no rate yet."""
        if self.drain_rate is None:
            return None
        by_tokens = tokens / self.drain_rate if self.drain_rate > 0 else (math.inf if tokens else 0.0)
        rate = self.request_drain_rate
        by_requests = requests / rate if rate else (math.inf if requests and rate == 0 else 0.0)
        return max(by_tokens, by_requests)


@dataclass(frozen=True, slots=True)
class AdmissionControl:
    """The rules and defaults of admission, from the engine's config; immutable, so any thread may use it."""

    max_num_queued_requests: int | None = None
    max_num_queued_tokens: int | None = None
    check_deadlines: bool = False  # --admission-control
    ttft_slo: float | None = None  # defaults for a request that names none (seconds)
    tpot_slo: float | None = None
    tenant_cache_salt: bool = False  # salt each tenant's prefix cache apart
    max_num_batched_tokens: int = 2048

    @property
    def active(self) -> bool:
        """Whether arrivals are judged at all (otherwise every request is queued, as before)."""
        return self.check_deadlines or self.max_num_queued_requests is not None or \
            self.max_num_queued_tokens is not None

    def apply_targets(self, request: Request) -> None:
        """Give the request the default targets it lacks (again and again: the same)."""
        if request.ttft_slo is None:
            request.ttft_slo = self.ttft_slo
        if request.tpot_slo is None:
            request.tpot_slo = self.tpot_slo

    def prepare(self, request: Request) -> None:
        """The default targets, and the tenant's cache salt: once, as the request joins the queue."""
        self.apply_targets(request)
        if self.tenant_cache_salt:
            request.cache_salt = tenant_salt(request.tenant, request.cache_salt)

    def refusal(self, request: Request, view: AdmissionView, now: float, key: float | None = None,
                pending: tuple[int, int] = (0, 0)) -> RequestRefused | None:
        """Why ``request`` may not join the queue now, or None if it may. ``key``: its place in the policy's
        queue (``SchedulingPolicy.admission_key``); ``pending``: requests and tokens handed over but not yet
        in ``view``, counted as queued ahead of it."""
        count = request.sampling_params.n
        tokens = request.num_tokens * count
        queued, queued_tokens = view.num_queued_requests + pending[0], view.num_queued_tokens + pending[1]
        requests_cap, tokens_cap = self.max_num_queued_requests, self.max_num_queued_tokens
        if tokens_cap is not None and tokens > tokens_cap:
            raise FieldError("prompt", f"prompt: {tokens} tokens (x n) is more than the server queues in all "
                                       f"(--max-num-queued-tokens {tokens_cap}); it could never be taken")
        if requests_cap is not None and queued + count > requests_cap:
            over = (queued + count - requests_cap) * queued_tokens // max(queued, 1)  # tokens of the excess
            return RequestRefused("queue_full", f"{queued} requests are queued, the cap is {requests_cap} "
                                  "(--max-num-queued-requests)", _drain_time(view, over))
        if tokens_cap is not None and queued_tokens + tokens > tokens_cap:
            excess = queued_tokens + tokens - tokens_cap
            return RequestRefused("queue_full", f"{queued_tokens} tokens are queued, and {tokens} more would pass "
                                  f"the cap of {tokens_cap} (--max-num-queued-tokens)",
                                  _drain_time(view, excess))
        if self.check_deadlines:
            return self._deadline_refusal(request, view, now, key, pending)
        return None

    def _deadline_refusal(self, request: Request, view: AdmissionView, now: float, key: float | None,
                          pending: tuple[int, int]) -> RequestRefused | None:
        pending_requests, pending_tokens = pending
        target = request.ttft_slo if request.ttft_slo is not None else self.ttft_slo
        if target is None:
            return None
        ahead = (view.tokens_ahead(key, now) + pending_tokens, view.requests_ahead(key, now) + pending_requests)
        wait = self.predicted_wait(request, view, *ahead)
        if wait is None:
            return None  # too few steps timed to predict: admit
        first_token = now - request.arrival_time + wait
        if first_token > target:
            return RequestRefused("deadline_unattainable", f"its first token is predicted in {first_token:.3f} s, "
                                  f"past its time-to-first-token target of {target:.3f} s (--admission-control)",
                                  _retry_after(first_token - target))
        delay = view.drain_seconds(request.num_tokens, 1) or 0.0  # what it would cost those it goes ahead of
        if delay > view.margin_behind(key):
            return RequestRefused("deadline_unattainable", f"it would go ahead of a queued request with less than "
                                  f"the {delay:.3f} s it would cost it to spare, making that one miss its target "
                                  "(--admission-control)", _retry_after(delay))
        return None

    def predicted_wait(self, request: Request, view: AdmissionView, tokens_ahead: int,
                       requests_ahead: int = 0) -> float | None:
        """Seconds from now to the request's first token: the work ahead at the drain rates (or, before one was
        measured, in full steps of the step-time line), then its own prompt in steps shared with the running
        requests' decodes. None before enough steps were timed."""
        line = view.step_line
        if line is None:
            return None
        budget = self.max_num_batched_tokens
        decodes = min(view.num_running, budget - 1)
        room = budget - decodes  # prompt tokens a step can take beside the running decodes
        queue_wait = 0.0
        if tokens_ahead:
            drained = view.drain_seconds(tokens_ahead, requests_ahead)
            queue_wait = -(-tokens_ahead // room) * (line[0] + line[1] * budget) if drained is None else drained
        own = request.num_tokens
        steps = -(-own // room)
        return queue_wait + steps * line[0] + line[1] * (own + steps * decodes)


def margins(keys: tuple[float, ...], sums: tuple[int, ...], now: float, rate: float | None,
            request_rate: float | None = None) -> tuple[float, ...]:
    """For a queue by latest start (``keys``, ``sums`` as in AdmissionView), the least time to spare from each
    place on among the requests predicted to start in time: request i starts once the on-time work ahead of it
    drains at ``rate`` (tokens; and ``request_rate``, requests), and has ``keys[i]`` less that to spare. A
    request predicted late is no one to protect (what a newcomer does cannot save it). All inf without a rate."""
    spare = [math.inf] * (len(keys) + 1)
    if not rate:
        return tuple(spare)
    low = bisect.bisect_left(keys, now)
    least = math.inf
    for i in range(len(keys) - 1, low - 1, -1):
        start = (sums[i] - sums[low]) / rate
        if request_rate:
            start = max(start, (i - low) / request_rate)
        margin = keys[i] - now - start
        if 0 <= margin < least:
            least = margin
        spare[i] = least
    return tuple(spare)


def _drain_time(view: AdmissionView, tokens: int) -> float:
    """Seconds until ``tokens`` queued tokens have been taken in, at the measured drain rate (1 s unknown)."""
    rate = view.drain_rate
    return _retry_after(tokens / rate) if rate else 1.0


def _retry_after(seconds: float) -> float:
    """Whole seconds, at least 1 and at most MAX_RETRY_AFTER_S, as an HTTP Retry-After says them."""
    if not math.isfinite(seconds):
        return float(MAX_RETRY_AFTER_S)
    return float(min(MAX_RETRY_AFTER_S, max(1, math.ceil(seconds))))


def tenant_salt(tenant: str, salt: str | None) -> str:
    """The cache salt of a request of ``tenant`` that asked for ``salt``: unambiguous for any pair, so no two
    tenants (and no tenant and client salt) can name the same one."""
    return json.dumps(["tenant", tenant, salt])
