"""Fair shares between tenants, after VTC (Sheng et al., "Fairness in Serving Large Language Models", OSDI 2024).

Each tenant has a virtual token counter: the service it received, in weighted tokens divided by its
weight. Admission takes the earliest waiting request of the backlogged tenant with the smallest
counter, so a tenant that floods the server only lengthens its own queue. A tenant returning from idle
has its counter lifted to the least counter among the backlogged (or, when none is, to the counter of
the last tenant that left the backlog): time spent idle is not saved up as credit to crowd the others
out later.

Service is charged once per token of work: the whole prompt at a request's first admission (VTC's
rule, so several admissions in one step see each other), and each output token as it is drawn. A
request preempted and later resumed or recomputed is not charged again, and does not get the lift:
preemption is the engine's doing, so it costs the tenant neither share nor place. Memory is taken back
from the most-served tenant, and swapped requests resume least-served first: otherwise a tenant that
holds the batch would keep it through preemption, its earlier arrivals outranking everyone's later ones.

The bound (VTC's theorem, checked by tests/core/test_fair_property.py): while two tenants are both backlogged,
the difference of their services, each divided by its weight, stays within ``2 * U / w_min``, where ``U``
is the largest single charge a tenant can take before the others catch up: one prompt
(``PROMPT_TOKEN_WEIGHT * longest prompt``) plus the output its running requests can still draw
(``OUTPUT_TOKEN_WEIGHT * tokens the KV cache holds``), and ``w_min`` the smallest tenant weight.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from conveyor.core.kv import PagedKVCacheManager
from conveyor.core.request import Request
from conveyor.core.scheduler.policies.base import FreesEnough, SchedulingPolicy

# Past this many tenants, one whose last request ends is forgotten: tenants come from a client's ``user``
# field, so their number is the client's to choose. A forgotten tenant that returns starts level with the
# least-served backlogged one, which is what the lift gives any returning tenant not ahead of the others.
MAX_TENANT_ACCOUNTS = 4096
PROMPT_TOKEN_WEIGHT = 1.0  # VTC's w_p
OUTPUT_TOKEN_WEIGHT = 2.0  # VTC's w_q: an output token costs a step of its own, a prompt token a share of one


@dataclass(slots=True)
class TenantAccount:
    """One tenant's counter and queue lengths, and what it was served (for per-tenant metrics)."""

    weight: float
    counter: float = 0.0  # weighted tokens served / weight, lifted on return from idle
    num_waiting: int = 0  # in the waiting queue (new, or preempted by recompute)
    num_swapped: int = 0
    num_in_engine: int = 0  # arrived and not finished
    prompt_tokens: int = 0  # charged at first admission
    output_tokens: int = 0

    @property
    def is_backlogged(self) -> bool:
        return self.num_waiting + self.num_swapped > 0


class FairPolicy(SchedulingPolicy):
    """Virtual token counters per tenant; the least-served backlogged tenant is admitted first.

    The queues stay in arrival order (a tenant's own requests are first come, first served); the choices
    between tenants look at the counters: whom to admit and whom to resume (the least served), and whom
    to preempt when memory runs out or a tenant with nothing running finds the batch full (the most served).
    """

    name = "fair"

    def __init__(self, kv_manager: PagedKVCacheManager, tenant_weights: Mapping[str, float] | None = None) -> None:
        super().__init__(kv_manager)
        self.tenant_weights = dict(tenant_weights or {})
        self.accounts: dict[str, TenantAccount] = {}
        self._num_tenants_waiting = 0  # tenants with a request in the waiting queue
        self._last_left_counter = 0.0  # the counter of the last tenant to leave the backlog

    def account(self, tenant: str) -> TenantAccount:
        account = self.accounts.get(tenant)
        if account is None:
            account = self.accounts[tenant] = TenantAccount(self.tenant_weights.get(tenant, 1.0))
        return account

    # ----- the choice ----------------------------------------------------------

    def next_to_admit(self, waiting: list[Request], passed_over: set[str]) -> Request | None:
        """The earliest waiting request of the tenant with the smallest counter (earlier arrival breaks ties)."""
        best: Request | None = None
        best_counter = 0.0
        seen: set[str] = set()
        for request in waiting:
            if request.tenant in seen or request.request_id in passed_over:
                continue
            seen.add(request.tenant)
            counter = self.accounts[request.tenant].counter
            if best is None or counter < best_counter:
                best, best_counter = request, counter
            if len(seen) == self._num_tenants_waiting:
                break  # every waiting tenant's first request has been seen
        return best

    def next_to_resume(self, swapped: list[Request]) -> Request:
        """The earliest swapped request of the least-served tenant: a tenant's swapped requests must not wait
        behind a more-served tenant's that happened to arrive first."""
        return min(swapped, key=lambda r: (self.accounts[r.tenant].counter, r.arrival_time, r.arrival_order))

    def memory_victim(self, running: list[Request], needing: Request) -> Request:
        """The latest running request of the most-served tenant: memory is taken back from the tenant ahead,
        never from one behind it (taking the latest arrival, as fcfs does, would preempt a tenant that has
        just been let in ahead of one that has held the batch all along)."""
        return max(running, key=lambda r: (self.accounts[r.tenant].counter, r.arrival_time, r.arrival_order))

    def victims_for(self, request: Request, running: list[Request], step_index: int,
                    frees_enough: FreesEnough) -> list[Request] | None:
        """A tenant with nothing running is seated at once when the batch is full (or memory short), by the
        latest-admitted requests of the tenants that hold more than their share of the running batch.

        Without it, a light tenant behind a heavy one that holds every place waits for the heavy tenant's next
        finish; requests of one length admitted together finish in waves, so that wait is a wave's length (the
        batch cap defeats priorities the same way: vLLM issue 40004). A victim's tenant must hold more places
        than its weight's share among the tenants in the engine (rounded up), keep that share, and be served at
        least as much as the newcomer's: so a tenant with a request running waits its turn at admission (two
        backlogged tenants never preempt each other, and a victim's tenant always keeps a request running, so it
        cannot preempt back), and many tenants of a request or two each preempt nobody. The latest admitted of a tenant
        goes first (the least work to compute again); the same newcomer never preempts in two steps running.
        """
        if any(r.tenant == request.tenant for r in running):
            return None
        accounts = self.accounts
        held: dict[str, int] = {}
        for r in running:
            held[r.tenant] = held.get(r.tenant, 0) + 1
        in_engine = sum(a.weight for a in accounts.values() if a.num_in_engine > 0)
        share = {tenant: math.ceil(len(running) * accounts[tenant].weight / in_engine) for tenant in held}
        floor = accounts[request.tenant].counter
        ahead = [r for r in running if accounts[r.tenant].counter >= floor]
        victims: list[Request] = []
        for victim in sorted(ahead, key=lambda r: (-accounts[r.tenant].counter, -(r.first_scheduled_time or 0.0))):
            if held[victim.tenant] <= share[victim.tenant]:
                continue  # at (or down to) its share: it keeps the rest
            if victim.last_preempted_by == (request.request_id, step_index - 1):
                return None  # thrash guard, as the priority policy's
            victims.append(victim)
            held[victim.tenant] -= 1
            if frees_enough(victims):
                return victims
        return None

    def resumes_before(self, swapped: Request, waiting: Request | None) -> bool:
        """Between tenants, the less served goes on first (a swapped request holds no device blocks, so it
        may wait like a queued one); within a tenant, the earlier arrival."""
        if waiting is None or waiting.tenant == swapped.tenant:
            return super().resumes_before(swapped, waiting)
        return self.accounts[swapped.tenant].counter <= self.accounts[waiting.tenant].counter

    def lift(self, account: TenantAccount) -> None:
        """A tenant back from idle starts level with the least-served backlogged tenant, not below it."""
        backlogged = [a.counter for a in self.accounts.values() if a.is_backlogged]
        floor = min(backlogged) if backlogged else self._last_left_counter
        account.counter = max(account.counter, floor)

    # ----- the hooks -----------------------------------------------------------

    def on_arrival(self, request: Request) -> None:
        account = self.account(request.tenant)
        if not account.is_backlogged:
            self.lift(account)
        account.num_in_engine += 1
        self._count_waiting(account, 1)

    def on_queued(self, request: Request, swapped: bool) -> None:
        account = self.account(request.tenant)
        if swapped:
            account.num_swapped += 1
        else:
            self._count_waiting(account, 1)

    def on_dequeued(self, request: Request, swapped: bool, first_admission: bool) -> None:
        account = self.accounts[request.tenant]
        if swapped:
            account.num_swapped -= 1
        else:
            self._count_waiting(account, -1)
        if first_admission:
            account.prompt_tokens += request.num_prompt_tokens
            account.counter += PROMPT_TOKEN_WEIGHT * request.num_prompt_tokens / account.weight
        if not account.is_backlogged:
            self._last_left_counter = account.counter

    def on_tokens(self, requests: list[Request]) -> None:
        accounts = self.accounts
        for request in requests:
            account = accounts.get(request.tenant)
            if account is None:
                continue  # its last request ended in this step, and it was forgotten (MAX_TENANT_ACCOUNTS)
            account.output_tokens += 1
            account.counter += OUTPUT_TOKEN_WEIGHT / account.weight

    def on_finished(self, request: Request) -> None:
        account = self.accounts[request.tenant]
        account.num_in_engine -= 1
        if account.num_in_engine == 0 and len(self.accounts) > MAX_TENANT_ACCOUNTS:
            del self.accounts[request.tenant]

    def _count_waiting(self, account: TenantAccount, change: int) -> None:
        before = account.num_waiting
        account.num_waiting = before + change
        if before == 0 or account.num_waiting == 0:
            self._num_tenants_waiting += 1 if before == 0 else -1

    def tenant_report(self) -> dict[str, dict[str, float]]:
        """Each tenant's counter, queues and service: the per-tenant metrics read this."""
        return {tenant: {"virtual_tokens": a.counter, "weight": a.weight, "num_waiting": a.num_waiting,
                         "num_swapped": a.num_swapped, "prompt_tokens": a.prompt_tokens,
                         "output_tokens": a.output_tokens} for tenant, a in self.accounts.items()}
