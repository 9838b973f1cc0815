"""The fair policy (VTC) keeps the share it claims: property tests over random multi-tenant workloads.

Each workload is a few tenants, each with a weight and bursts of requests (so a tenant is backlogged
for a while, goes idle, and comes back). The driver runs it through the scheduler with the fake
executor and measures each tenant's service from outside the policy: the prompt of a request when it
is first scheduled (``PROMPT_TOKEN_WEIGHT`` per token) and every token handed back by ``update``
(``OUTPUT_TOKEN_WEIGHT``), divided by the tenant's weight. The claims:

* while two tenants are both backlogged (a request waiting or swapped), the difference of their
  services over any stretch stays within ``2 * U / w_min`` (fair.py's bound);
* no tenant starves: over a joint backlog in which the others are served more than that bound, it
  is served too; and every request finishes with the output a lone run gives;
* the mechanics' contract holds (KV ownership, budget, max_num_seqs).

Three mutants, each a line or two from the policy (no lift on return from idle; the most-served tenant
first; swap-in and memory preemption in arrival order, as fcfs has them), must fail these checks on a
workload built to show it.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, Phase, find, given, settings
from hypothesis import strategies as st

from conveyor.core.kv import PagedKVCacheManager
from conveyor.core.request import Request
from conveyor.core.scheduler import Scheduler, SchedulerConfig
from conveyor.core.scheduler.policies import FairPolicy, SchedulingPolicy, TenantAccount
from conveyor.core.scheduler.policies.fair import OUTPUT_TOKEN_WEIGHT, PROMPT_TOKEN_WEIGHT
from tests.harness import FakeClock, SwapAwareExecutor, check_pool, make_request, reference_output


@dataclass(frozen=True)
class Burst:
    """``count`` requests of one tenant arriving together at ``step``."""

    step: int
    count: int
    prompt_len: int
    max_tokens: int


@dataclass(frozen=True)
class TenantLoad:
    name: str
    weight: int
    bursts: tuple[Burst, ...]


@dataclass(frozen=True)
class FairWorkload:
    num_blocks: int
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    preemption_mode: str
    tenants: tuple[TenantLoad, ...]

    @property
    def max_prompt_len(self) -> int:
        return max(b.prompt_len for t in self.tenants for b in t.bursts)

    @property
    def gap_bound(self) -> float:
        """fair.py's claim: 2 U / w_min, U = one prompt plus all the output the KV cache can hold."""
        capacity = self.num_blocks * self.block_size
        largest_charge = PROMPT_TOKEN_WEIGHT * self.max_prompt_len + OUTPUT_TOKEN_WEIGHT * capacity
        return 2 * largest_charge / min(t.weight for t in self.tenants)


MAX_PROMPT = 12


@st.composite
def fair_workloads(draw: st.DrawFn) -> FairWorkload:
    block_size = draw(st.integers(1, 4))
    num_blocks = draw(st.integers(MAX_PROMPT // block_size + 2, 16))
    burst = st.builds(Burst, step=st.integers(0, 40), count=st.integers(1, 8), prompt_len=st.integers(1, MAX_PROMPT),
                      max_tokens=st.integers(1, 10))
    num_tenants = draw(st.integers(2, 3))
    tenants = tuple(
        TenantLoad(f"t{i}", draw(st.integers(1, 3)), tuple(draw(st.lists(burst, min_size=1, max_size=4))))
        for i in range(num_tenants)
    )
    return FairWorkload(num_blocks, block_size, draw(st.integers(1, 6)), draw(st.integers(4, 32)),
                        draw(st.sampled_from(["recompute", "swap"])), tenants)


class FairDriver:
    """Runs a workload step by step, measuring service and backlog per tenant from outside the policy."""

    def __init__(self, workload: FairWorkload, policy_class: type[FairPolicy] = FairPolicy) -> None:
        self.workload = workload
        capacity = workload.num_blocks * workload.block_size
        num_cpu = workload.num_blocks if workload.preemption_mode == "swap" else 0
        kv = PagedKVCacheManager(workload.num_blocks, workload.block_size, num_cpu_blocks=num_cpu)
        weights = {t.name: float(t.weight) for t in workload.tenants}
        config = SchedulerConfig(workload.max_num_seqs, workload.max_num_batched_tokens, capacity,
                                 "fair", workload.preemption_mode)
        self.scheduler = Scheduler(config, kv, clock=FakeClock(), policy=policy_class(kv, weights))
        self.executor = SwapAwareExecutor(self.scheduler)
        self.weights = weights
        self.service: dict[str, float] = defaultdict(float)
        self.seen: set[str] = set()
        self.requests: dict[str, Request] = {}
        self.samples: list[tuple[set[str], dict[str, float]]] = []  # before each step: backlogged, service

    def arrivals(self) -> dict[int, list[Request]]:
        due: dict[int, list[Request]] = defaultdict(list)
        for tenant in self.workload.tenants:
            for b, burst in enumerate(tenant.bursts):
                for i in range(burst.count):
                    request_id = f"{tenant.name}-{b}-{i}"
                    request = make_request(request_id, burst.prompt_len, arrival=float(burst.step),
                                           max_tokens=burst.max_tokens, ignore_eos=True)
                    request.tenant = tenant.name
                    due[burst.step].append(request)
        return due

    def backlogged(self) -> set[str]:
        return {r.tenant for r in [*self.scheduler.waiting, *self.scheduler.swapped]}

    def run(self, max_steps: int = 20_000) -> FairDriver:
        due = self.arrivals()
        last_arrival = max(due)
        step = 0
        while step <= last_arrival or self.scheduler.has_unfinished_requests():
            for request in due.get(step, []):
                self.requests[request.request_id] = request
                self.executor.prompts[request.request_id] = request.prompt_token_ids
                self.scheduler.add_request(request)
            self.samples.append((self.backlogged(), dict(self.service)))
            self.step()
            step += 1
            assert step < max_steps, "the scheduler livelocks"
        return self

    def step(self) -> None:
        sched = self.scheduler
        output = sched.schedule()
        assert output.num_batched_tokens <= sched.config.max_num_batched_tokens
        assert len(sched.running) <= sched.config.max_num_seqs
        for item in output.scheduled:
            if item.request_id not in self.seen:
                self.seen.add(item.request_id)
                request = self.requests[item.request_id]
                self.service[request.tenant] += PROMPT_TOKEN_WEIGHT * request.num_prompt_tokens / \
                    self.weights[request.tenant]
        returned = sched.update(output, self.executor.execute(output))
        for request in returned:
            self.service[request.tenant] += OUTPUT_TOKEN_WEIGHT / self.weights[request.tenant]
        check_pool(sched.kv_manager.pool, sched.kv_manager.block_tables, "device")

    # ----- the claims ---------------------------------------------------------

    def joint_backlogs(self, a: str, b: str) -> list[list[float]]:
        """Each maximal run of samples in which both were backlogged: the service difference at each."""
        runs: list[list[float]] = []
        current: list[float] = []
        for backlogged, service in self.samples:
            if a in backlogged and b in backlogged:
                current.append(service.get(a, 0.0) - service.get(b, 0.0))
            elif current:
                runs.append(current)
                current = []
        return [*runs, current] if current else runs

    def check_gap(self) -> None:
        """Over any stretch of a joint backlog, |service(a) - service(b)| <= the bound."""
        names = [t.name for t in self.workload.tenants]
        bound = self.workload.gap_bound
        for i, a in enumerate(names):
            for b in names[i + 1:]:
                for run in self.joint_backlogs(a, b):
                    gap = max(run) - min(run)
                    assert gap <= bound, f"{a} vs {b}: service gap {gap:.1f} over a joint backlog, bound {bound:.1f}"

    def check_no_starvation(self) -> None:
        """A tenant backlogged beside one served over the bound since the stretch began is served too."""
        names = [t.name for t in self.workload.tenants]
        bound = self.workload.gap_bound
        for a in names:
            for b in names:
                for run in self.joint_backlogs(a, b) if a != b else []:
                    # run holds service(a) - service(b); b's own gain must follow a's within the bound.
                    assert run[-1] - run[0] <= bound, f"{b} starves beside {a}"

    def check_outputs(self) -> None:
        assert not self.scheduler.requests and self.scheduler.kv_manager.num_free_blocks == self.workload.num_blocks
        capacity = self.workload.num_blocks * self.workload.block_size
        for request in self.requests.values():
            expected, _, _ = reference_output(request, capacity, self.executor.token_fn)
            assert request.output_token_ids == expected


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fair_workloads())
def test_backlogged_tenants_share_within_the_bound_and_none_starves(workload: FairWorkload) -> None:
    driver = FairDriver(workload).run()
    driver.check_gap()
    driver.check_no_starvation()
    driver.check_outputs()


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fair_workloads())
def test_counters_stay_level_and_account_for_every_token(workload: FairWorkload) -> None:
    """The counters themselves: backlogged tenants within U of each other whenever admission chooses, and a
    tenant's prompt and output totals the tokens it was served."""
    driver = FairDriver(workload).run()
    accounts: dict[str, TenantAccount] = driver.scheduler.policy.accounts
    for tenant in workload.tenants:
        mine = [r for r in driver.requests.values() if r.tenant == tenant.name]
        assert accounts[tenant.name].prompt_tokens == sum(r.num_prompt_tokens for r in mine)
        assert accounts[tenant.name].output_tokens == sum(r.num_output_tokens for r in mine)
        assert accounts[tenant.name].num_waiting == accounts[tenant.name].num_swapped == 0


# ----- mutants: each must fail the checks above -------------------------------


class NoLift(FairPolicy):
    """A tenant back from idle keeps its old, low counter."""

    def lift(self, account: TenantAccount) -> None:
        pass


class MostServedFirst(FairPolicy):
    """The order swapped: the backlogged tenant with the largest counter is admitted first."""

    def next_to_admit(self, waiting: list[Request], passed_over: set[str]) -> Request | None:
        firsts: dict[str, Request] = {}
        for request in waiting:
            if request.request_id not in passed_over:
                firsts.setdefault(request.tenant, request)
        return max(firsts.values(), key=lambda r: self.accounts[r.tenant].counter, default=None)

    def resumes_before(self, swapped: Request, waiting: Request | None) -> bool:
        return waiting is None


class ArrivalOrderPreemption(FairPolicy):
    """Swapped requests resume, and memory is taken back, in arrival order: the less-served tenant's later
    requests are the victims, and wait behind the more-served tenant's earlier ones to swap back in."""

    next_to_resume = SchedulingPolicy.next_to_resume
    memory_victim = SchedulingPolicy.memory_victim


def idle_return_workload() -> FairWorkload:
    """t0 is served alone for a long while, then both are backlogged together, with equal weights."""
    t0 = TenantLoad("t0", 1, (Burst(0, 40, 4, 6), Burst(200, 30, 4, 6)))
    t1 = TenantLoad("t1", 1, (Burst(0, 1, 4, 6), Burst(200, 30, 4, 6)))
    return FairWorkload(num_blocks=8, block_size=4, max_num_seqs=2, max_num_batched_tokens=16,
                        preemption_mode="recompute", tenants=(t0, t1))


def equal_backlog_workload() -> FairWorkload:
    """Both tenants backlogged from the start with long queues."""
    tenants = tuple(TenantLoad(f"t{i}", 1, (Burst(0, 40, 4, 6),)) for i in range(2))
    return FairWorkload(num_blocks=8, block_size=4, max_num_seqs=2, max_num_batched_tokens=16,
                        preemption_mode="recompute", tenants=tenants)


def swap_pressure_workload() -> FairWorkload:
    """t1 fills the batch and the pool, with swap; t0 (weight 2) and t2 arrive a step later. The random
    workloads found this one: the base choices let t1 gain 64 on t0, over the bound of 58."""
    tenants = (TenantLoad("t0", 2, (Burst(1, 2, 1, 3),)), TenantLoad("t1", 1, (Burst(0, 7, 1, 7),)),
               TenantLoad("t2", 1, (Burst(1, 1, 1, 1),)))
    return FairWorkload(num_blocks=14, block_size=1, max_num_seqs=6, max_num_batched_tokens=6,
                        preemption_mode="swap", tenants=tenants)


def test_fair_policy_passes_the_mutants_workloads() -> None:
    for workload in (idle_return_workload(), equal_backlog_workload(), swap_pressure_workload()):
        driver = FairDriver(workload).run()
        driver.check_gap()
        driver.check_no_starvation()


@pytest.mark.parametrize(("mutant", "workload"), [(NoLift, idle_return_workload()),
                                                  (MostServedFirst, equal_backlog_workload()),
                                                  (ArrivalOrderPreemption, swap_pressure_workload())],
                         ids=["no-lift", "most-served-first", "arrival-order-preemption"])
def test_mutants_fail_the_checks(mutant: type[FairPolicy], workload: FairWorkload) -> None:
    driver = FairDriver(workload, mutant).run()
    with pytest.raises(AssertionError):
        driver.check_gap()
    with pytest.raises(AssertionError):
        driver.check_no_starvation()


@pytest.mark.parametrize("mutant", [NoLift, MostServedFirst], ids=["no-lift", "most-served-first"])
def test_the_random_workloads_find_each_mutant(mutant: type[FairPolicy]) -> None:
    """Not only the hand-built workloads: the property's own generator finds a workload each mutant fails.
    Generation only: the claim is that one is found, not the smallest one; shrinking it reran the driver
    hundreds of times more (15-25 s a mutant, where finding one takes 0.1-2 s)."""

    def breaks_the_bound(workload: FairWorkload) -> bool:
        try:
            FairDriver(workload, mutant).run().check_gap()
        except AssertionError:
            return True
        return False

    find(fair_workloads(), breaks_the_bound,
         settings=settings(max_examples=1000, deadline=None, database=None, phases=[Phase.generate],
                           suppress_health_check=list(HealthCheck)))


def test_tenants_past_the_cap_are_forgotten_when_their_last_request_ends(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tenants are the client's to name, so the accounts stay bounded: past the cap, an idle tenant is dropped."""
    monkeypatch.setattr("conveyor.core.scheduler.policies.fair.MAX_TENANT_ACCOUNTS", 2)
    tenants = tuple(TenantLoad(f"t{i}", 1, (Burst(3 * i, 1, 4, 2),)) for i in range(6))
    workload = FairWorkload(num_blocks=16, block_size=4, max_num_seqs=2, max_num_batched_tokens=16,
                            preemption_mode="recompute", tenants=tenants)
    driver = FairDriver(workload).run()
    assert len(driver.scheduler.policy.accounts) <= 2
    driver.check_outputs()
