"""Property tests over every scheduler x policy x preemption mode x KV layout.

Each combination is a different code path through the same ``schedule`` ->
executor -> ``update`` loop: request-level batching holds a batch together,
priority reorders the queues and preempts for newcomers, swap moves KV to a
second pool and falls back to recompute when that pool is full, and the
contiguous layout hands out whole slabs that fragment. A bug in any one of
them shows up as an invariant broken at some step of some workload, so the
workloads are random and the invariants are checked after every call:

* each device and CPU block has at most one owner, and free + owned == total
  on both pools; only running requests hold device blocks, only swapped ones
  hold CPU blocks;
* every scheduled chunk fits its block table, the step respects the token
  budget and ``max_num_seqs``, and swap pairs point into the right pools and
  come only with preemptions;
* contiguous tables are one slab of consecutive blocks; the memory report
  adds up; the static scheduler never runs a request outside its batch and
  delivers the batch's results together;
* at the end both pools are free and every request finished exactly once,
  with the output a lone run would give, within a step bound.

A second run of the same workload must make the same decisions: the
scheduler may not depend on anything but its inputs. The loop is
``tests/harness.py``'s ``StepDriver``; ``PolicyDriver`` checks in its hooks.
"""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from conveyor.core.kv import ContiguousKVCacheManager
from conveyor.core.request import FinishReason, Request, RequestStatus
from conveyor.core.scheduler import Scheduler, SchedulerOutput, StaticScheduler
from conveyor.core.scheduler.continuous import POLICIES, PREEMPTION_MODES
from tests.harness import Abort, KVShadow, RequestSpec, StepDriver, Workload, check_pool, make_scheduler, workloads

SCHEDULER_CLASSES: dict[str, type[Scheduler]] = {"continuous": Scheduler, "static": StaticScheduler}
LAYOUTS = ("paged", "contiguous")
# No explain phase: on a failure it replays hundreds of variations and would triple the file's runtime.
PHASES = (Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink)

# What one step decided, comparable across runs: scheduled (id, start, n), victims, swap pairs.
Pairs = tuple[tuple[int, int], ...]
StepRecord = tuple[tuple[tuple[str, int, int], ...], tuple[str, ...], Pairs, Pairs]


@dataclass(frozen=True)
class Combo:
    scheduler: str
    policy: str
    preemption_mode: str
    layout: str

    @property
    def id(self) -> str:
        return f"{self.scheduler}-{self.policy}-{self.preemption_mode}-{self.layout}"


# lpm orders by cached prefix; without prefix caching (these schedulers have none) it is fcfs, so it is tested
# with the cache, in test_prefix_cache_properties.py.
COMBOS = [Combo(*values) for values in itertools.product(
    SCHEDULER_CLASSES, [p for p in POLICIES if p != "lpm"], PREEMPTION_MODES, LAYOUTS)]


@dataclass(frozen=True)
class TargetedAbort:
    """Abort whoever is last in a queue the ``nth`` time it is seen non-empty.

    Aborts by request index and step rarely catch a request in the short-lived swapped state.
    """

    nth: int
    queue: str  # "waiting", "running" or "swapped"
    mid_step: bool


@dataclass(frozen=True)
class PolicyWorkload:
    """The scheduler tests' workload plus what only these policies read: priorities and swap space."""

    base: Workload
    priorities: tuple[int, ...]  # one per request; fcfs ignores them, which is part of what is tested
    num_cpu_blocks: int  # 0 means no swap pool at all, so every swap falls back to recompute
    targeted_aborts: tuple[TargetedAbort, ...] = ()


@st.composite
def crowded_workloads(draw: st.DrawFn) -> Workload:
    """A pool a few requests overflow as they grow: preemption (and with it swap) in most examples."""
    block_size = draw(st.integers(1, 4))
    num_blocks = draw(st.integers(2, 6))
    capacity = num_blocks * block_size
    max_model_len = draw(st.integers(max(2, capacity // 2), capacity))
    specs = st.builds(
        RequestSpec,
        prompt_len=st.integers(1, min(max_model_len - 1, 6)),
        max_tokens=st.integers(4, 24),
        arrival_step=st.integers(0, 3),
        use_eos=st.just(False),
        ignore_eos=st.just(False),
        stop_token_ids=st.just(()),
    )
    requests = draw(st.lists(specs, min_size=2, max_size=8))
    aborts = st.builds(Abort, step=st.integers(0, 30), index=st.integers(0, len(requests) - 1), mid_step=st.booleans())
    return Workload(
        num_blocks=num_blocks,
        block_size=block_size,
        watermark=0.0,
        max_num_seqs=draw(st.integers(2, 8)),
        max_num_batched_tokens=draw(st.integers(2, 32)),
        max_model_len=max_model_len,
        vocab=1000,
        requests=tuple(requests),
        aborts=tuple(draw(st.lists(aborts, max_size=2))),
    )


@st.composite
def policy_workloads(draw: st.DrawFn) -> PolicyWorkload:
    """Roomy, tight and crowded pools: the scheduler tests' workloads plus one that preempts most of the time."""
    roomy = workloads(max_requests=8)
    tight = workloads(max_block_size=4, max_blocks=8, max_requests=8, max_arrival_step=3, max_prompt_len=6)
    base = draw(st.one_of(roomy, tight, crowded_workloads()))
    n = len(base.requests)
    priorities = draw(st.lists(st.integers(-2, 2), min_size=n, max_size=n).map(tuple))
    # Small values most often: a CPU pool smaller than one victim's table forces the recompute fallback.
    num_cpu_blocks = draw(st.one_of(st.integers(0, 3), st.integers(0, 2 * base.num_blocks)))
    targeted = st.builds(
        TargetedAbort,
        nth=st.integers(0, 3),
        queue=st.sampled_from(["waiting", "running", "swapped", "swapped"]),
        mid_step=st.booleans(),
    )
    return PolicyWorkload(base, priorities, num_cpu_blocks, tuple(draw(st.lists(targeted, max_size=2))))


def build_scheduler(combo: Combo, workload: PolicyWorkload) -> Scheduler:
    w = workload.base
    return make_scheduler(
        w.num_blocks,
        w.block_size,
        max_num_seqs=w.max_num_seqs,
        max_num_batched_tokens=w.max_num_batched_tokens,
        max_model_len=w.max_model_len,
        watermark=w.watermark,
        num_cpu_blocks=workload.num_cpu_blocks,
        layout=combo.layout,
        scheduler_class=SCHEDULER_CLASSES[combo.scheduler],
        policy=combo.policy,
        preemption_mode=combo.preemption_mode,
    )


def step_limit(workload: Workload) -> int:
    """Ten steps per token of work plus the arrival window: random workloads drain in under four."""
    tokens = sum(spec.prompt_len + spec.max_tokens for spec in workload.requests)
    return 100 + 10 * tokens


def is_slab(table: list[int], slab_blocks: int) -> bool:
    return len(table) == slab_blocks and table == list(range(table[0], table[0] + slab_blocks))


# ----- the driver -------------------------------------------------------------


@dataclass(frozen=True)
class BeforeStep:
    """What the checks of a step need to know of the state before ``schedule``."""

    had_work: bool
    waiting: set[str]
    running: set[str]
    cpu_tables: dict[str, list[int]]  # the swapped requests' CPU block tables
    device_free: set[int]  # free device block ids


class PolicyDriver(StepDriver):
    """Runs one workload through one combination, checking the contract around every call.

    With ``checked=False`` it only drives the loop and records the decisions, for the determinism check.
    """

    def __init__(self, combo: Combo, workload: PolicyWorkload, checked: bool = True) -> None:
        super().__init__(
            workload.base, build_scheduler(combo, workload), max_steps=step_limit(workload.base), swap_aware=True
        )
        self.combo = combo
        self.policy_workload = workload
        self.checked = checked
        self.kv = self.scheduler.kv_manager
        self.delivered: Counter[str] = Counter()  # finished requests handed back by update()
        self.batch: set[str] | None = None  # the static scheduler's current batch, as seen from outside
        self.records: list[StepRecord] = []
        self.shadow = KVShadow(self.kv.block_size)
        self.sightings = [0] * len(workload.targeted_aborts)  # times each targeted abort found its queue non-empty

    @property
    def is_static(self) -> bool:
        return isinstance(self.scheduler, StaticScheduler)

    # ----- hooks ------------------------------------------------------------

    def new_request(self, index: int) -> Request:
        request = super().new_request(index)
        request.priority = self.policy_workload.priorities[index]
        return request

    def after_aborts(self, mid_step: bool) -> None:
        """The targeted aborts, then the static batch closes if they ended it."""
        for index, targeted in enumerate(self.policy_workload.targeted_aborts):
            queue: list[Request] = getattr(self.scheduler, targeted.queue)
            if targeted.mid_step != mid_step or not queue:
                continue
            if self.sightings[index] == targeted.nth:
                self.abort(queue[-1].request_id)
            self.sightings[index] += 1
        self.close_finished_batch()

    def after_abort(self, request_id: str) -> None:
        if self.checked:
            self.check_state()

    def after_execute(self, output: SchedulerOutput) -> None:
        if self.checked:
            self.shadow.run_step(output)

    def at_end(self) -> None:
        if self.checked:
            self.collect_last_finishes()
            self.check_end()

    def decisions(self) -> list[StepRecord]:
        """Run the workload; what each step decided."""
        self.run()
        return self.records

    # ----- one step ---------------------------------------------------------

    def before_schedule(self) -> BeforeStep:
        sched = self.scheduler
        return BeforeStep(
            had_work=sched.has_unfinished_requests(),
            waiting={r.request_id for r in sched.waiting},
            running={r.request_id for r in sched.running},
            cpu_tables={rid: list(table) for rid, table in self.kv.cpu_block_tables.items()},
            device_free=set(self.kv.pool.free_block_ids()),
        )

    def after_schedule(self, output: SchedulerOutput, before: BeforeStep) -> None:
        self.records.append(
            (
                tuple((s.request_id, s.start_position, s.num_scheduled_tokens) for s in output.scheduled),
                tuple(output.preempted_request_ids),
                tuple(output.blocks_to_swap_in),
                tuple(output.blocks_to_swap_out),
            )
        )
        if not self.checked:
            return
        self.finished_reported.update(output.finished_request_ids)
        self.check_scheduled(output, before.running)
        self.check_state()
        self.check_swaps(output, before.cpu_tables, before.device_free)
        assert output.memory == self.kv.memory_report()
        if self.is_static:
            self.check_static_batch(output, before.waiting)
        if before.had_work and not output.scheduled:
            # Legitimate only for request-level batching, in the step that hands back a batch whose
            # last unfinished member was aborted: everything that still holds a slot is finished.
            assert self.is_static, "a step with unfinished requests scheduled nothing"
            holders = self.scheduler.slot_holders()
            assert all(self.all_requests[rid].is_finished for rid in holders), (
                f"stalled: nothing scheduled, yet {holders} hold slots and waiting is "
                f"{[r.request_id for r in self.scheduler.waiting]}"
            )

    def check_scheduled(self, output: SchedulerOutput, running_before: set[str]) -> None:
        sched, kv, config = self.scheduler, self.kv, self.scheduler.config
        ids = [s.request_id for s in output.scheduled]
        assert len(ids) == len(set(ids)), "a request scheduled twice in one step"
        if config.policy == "fcfs" and output.preempted_request_ids:
            # Only priority preempts *for* a newcomer; fcfs preempts for running requests and admits nobody then.
            assert set(ids) <= running_before, "admitted or resumed in a step that preempted for memory"
        assert output.num_batched_tokens <= config.max_num_batched_tokens, "token budget exceeded"
        assert len(sched.running) <= config.max_num_seqs, "max_num_seqs exceeded"
        for item in output.scheduled:
            request = self.all_requests[item.request_id]
            assert request.status is RequestStatus.RUNNING, f"{item.request_id} scheduled but {request.status}"
            assert item.num_scheduled_tokens >= 1
            assert item.start_position == request.num_computed_tokens
            assert item.context_len <= request.num_tokens <= config.max_model_len
            assert item.samples_token == (item.context_len == request.num_tokens)
            assert item.block_ids == kv.block_ids(item.request_id), "handed a stale block table"
            assert len(item.block_ids) * kv.block_size >= item.context_len, "block table too short"

    def check_swaps(
        self, output: SchedulerOutput, cpu_before: dict[str, list[int]], device_free_before: set[int]
    ) -> None:
        """Swap-ins read CPU blocks the swapped held into free device blocks; swap-outs are the victims' tables."""
        num_blocks = self.kv.num_blocks
        num_cpu = self.kv.num_cpu_blocks
        swap_in, swap_out = output.blocks_to_swap_in, output.blocks_to_swap_out
        if self.combo.preemption_mode == "recompute":
            assert not swap_in and not swap_out, "recompute mode swapped"
        for cpu, device in swap_in:
            assert 0 <= cpu < num_cpu and 0 <= device < num_blocks, f"swap-in pair ({cpu}, {device}) out of range"
        for device, cpu in swap_out:
            assert 0 <= device < num_blocks and 0 <= cpu < num_cpu, f"swap-out pair ({device}, {cpu}) out of range"
        in_cpu, in_device = [c for c, _ in swap_in], [d for _, d in swap_in]
        assert len(set(in_cpu)) == len(in_cpu) and len(set(in_device)) == len(in_device)
        held_before = {block for table in cpu_before.values() for block in table}
        assert set(in_cpu) <= held_before, "swap-in from a CPU block no swapped request held"
        assert set(in_device) <= device_free_before, "swap-in into a device block that was not free"
        for request_id, table in cpu_before.items():
            if self.all_requests[request_id].status is RequestStatus.RUNNING:
                assert set(table) <= set(in_cpu), f"{request_id} resumed without copying its KV back"
        if swap_out:
            assert output.preempted_request_ids, "swap-out without a preemption"
        newly_swapped = [
            rid for rid in output.preempted_request_ids if self.all_requests[rid].status is RequestStatus.SWAPPED
        ]
        expected_cpu = sorted(block for rid in newly_swapped for block in self.kv.cpu_block_tables[rid])
        assert sorted(cpu for _, cpu in swap_out) == expected_cpu, "swap-outs do not match the victims' CPU tables"
        out_device = [d for d, _ in swap_out]
        assert len(set(out_device)) == len(out_device), "a device block swapped out twice"

    def check_static_batch(self, output: SchedulerOutput, waiting_before: set[str]) -> None:
        """Nobody joins a batch in progress, and nobody outside the batch runs."""
        holders = set(self.scheduler.slot_holders())
        if self.batch is None:
            if holders:
                assert holders <= waiting_before, "a new batch took requests that were not waiting"
                assert len(holders) <= self.scheduler.config.max_num_seqs
                self.batch = holders
        else:
            assert holders <= self.batch, f"{holders - self.batch} joined a batch in progress"
        scheduled = {s.request_id for s in output.scheduled}
        outside = scheduled - (self.batch or set())
        assert not outside, f"{outside} scheduled outside the current batch {self.batch}"

    def after_update(self, output: SchedulerOutput, returned: list[Request]) -> None:
        finished = [r for r in returned if r.is_finished]
        for request in finished:
            self.delivered[request.request_id] += 1
            assert request.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
        if self.checked:
            self.check_state()
            if self.is_static and finished:
                expected = (self.batch or set()) - self.aborted
                assert {r.request_id for r in finished} == expected, "a static batch is delivered in one piece"
                assert len({r.finish_time for r in finished}) == 1
        self.close_finished_batch()

    def close_finished_batch(self) -> None:
        """The batch is over once every member finished and every unaborted one was handed back."""
        if self.batch is None:
            return
        members = [self.all_requests[rid] for rid in self.batch]
        if all(r.is_finished for r in members) and all(self.delivered[rid] for rid in self.batch - self.aborted):
            self.batch = None

    # ----- state checks -----------------------------------------------------

    def policy_key(self, request: Request) -> tuple[float, ...]:
        """The order the policy promises, written independently: arrival, or priority then arrival."""
        arrival = (request.arrival_time, request.arrival_order)
        return (request.priority, *arrival) if self.combo.policy == "priority" else arrival

    def check_state(self) -> None:
        """KV ownership follows request status exactly, on both pools."""
        sched, kv = self.scheduler, self.kv
        check_pool(kv.pool, kv.block_tables, "device")
        check_pool(kv.cpu_pool, kv.cpu_block_tables, "cpu")
        running = {r.request_id for r in sched.running}
        swapped = {r.request_id for r in sched.swapped}
        waiting = {r.request_id for r in sched.waiting}
        assert len(running) + len(swapped) + len(waiting) == len(sched.requests), "a request is in two queues"
        assert running | swapped | waiting == set(sched.requests), "a live request is in no queue"
        assert set(kv.block_tables) == running, "device blocks held by a request that is not running"
        assert set(kv.cpu_block_tables) == swapped, "CPU blocks held by a request that is not swapped"
        assert len(running) <= sched.config.max_num_seqs
        for request in sched.running:
            assert request.status is RequestStatus.RUNNING
            assert len(kv.block_ids(request.request_id)) * kv.block_size >= request.num_computed_tokens
        for request in sched.swapped:
            assert request.status is RequestStatus.SWAPPED
            assert len(kv.cpu_block_tables[request.request_id]) * kv.block_size >= request.num_computed_tokens
        for request in sched.waiting:
            assert request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
            assert request.num_computed_tokens == 0, "a waiting request claims KV it does not hold"
        for queue in (sched.waiting, sched.running, sched.swapped):
            keys = [self.policy_key(r) for r in queue]
            assert keys == sorted(keys), f"a queue is out of {self.combo.policy} order"
        if isinstance(kv, ContiguousKVCacheManager):
            for request_id, table in kv.block_tables.items():
                assert is_slab(table, kv.slab_blocks), f"{request_id}: {table} is not one slab"
        self.check_memory_report()

    def check_memory_report(self) -> None:
        kv = self.kv
        report = kv.memory_report()
        owned = sum(len(table) for table in kv.block_tables.values())
        assert report.capacity_slots == kv.num_blocks * kv.block_size
        assert report.reserved_slots == owned * kv.block_size
        assert 0 <= report.used_slots <= report.reserved_slots <= report.capacity_slots
        assert 0 <= report.unusable_free_slots <= kv.num_free_blocks * kv.block_size
        assert report.num_requests == len(kv.block_tables)
        if isinstance(kv, ContiguousKVCacheManager):
            assert report.reserved_slots == len(kv.block_tables) * kv.slab_blocks * kv.block_size

    def check_end(self) -> None:
        sched, kv = self.scheduler, self.kv
        assert not sched.has_unfinished_requests() and sched.requests == {}
        assert not sched.running and not sched.waiting and not sched.swapped
        assert kv.block_tables == {} and kv.cpu_block_tables == {}
        assert kv.num_free_blocks == kv.num_blocks, "device blocks leaked"
        assert kv.num_free_cpu_blocks == kv.num_cpu_blocks, "CPU blocks leaked"
        self.check_reported_once()
        for request_id, request in self.all_requests.items():
            ends = self.delivered[request_id] + (request_id in self.aborted)
            assert ends == 1, f"{request_id} ended {ends} times (delivered or aborted)"
            self.check_output(request)


# ----- the tests ----------------------------------------------------------------


@pytest.mark.parametrize("combo", COMBOS, ids=[c.id for c in COMBOS])
@settings(max_examples=60, deadline=None, phases=PHASES, suppress_health_check=[HealthCheck.too_slow])
@given(workload=policy_workloads())
def test_every_policy_keeps_the_contract_and_is_deterministic(combo: Combo, workload: PolicyWorkload) -> None:
    records = PolicyDriver(combo, workload).decisions()
    assert PolicyDriver(combo, workload, checked=False).decisions() == records, "same workload, other decisions"


def one_token_request(arrival_step: int) -> RequestSpec:
    return RequestSpec(
        prompt_len=1, max_tokens=1, arrival_step=arrival_step, use_eos=False, ignore_eos=False, stop_token_ids=()
    )


STATIC_PRIORITY = [c for c in COMBOS if c.scheduler == "static" and c.policy == "priority"]


@pytest.mark.parametrize("combo", STATIC_PRIORITY, ids=[c.id for c in STATIC_PRIORITY])
def test_static_batch_member_is_not_starved_by_a_more_important_newcomer(combo: Combo) -> None:
    """A member the token budget left waiting still runs when a more important request arrives mid-batch.

    Found by the property test above: with a budget of one token, only r0 of the batch {r0, r1} runs in
    step 1; r2 (priority -1) then arrives ahead of r1 in the waiting queue. Admission used to look at the
    queue head only, refuse r2 as a non-member and stop, so r1 never ran and the engine stalled forever.
    """
    workload = Workload(
        num_blocks=4,
        block_size=4,
        watermark=0.0,
        max_num_seqs=2,
        max_num_batched_tokens=1,
        max_model_len=8,
        vocab=1000,
        requests=(one_token_request(0), one_token_request(0), one_token_request(1)),
        aborts=(),
    )
    records = PolicyDriver(combo, PolicyWorkload(workload, priorities=(0, 0, -1), num_cpu_blocks=0)).decisions()
    assert [scheduled for scheduled, *_ in records] == [(("r0", 0, 1),), (("r1", 0, 1),), (("r2", 0, 1),)]
