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
scheduler may not depend on anything but its inputs.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from conveyor.core.kv import BlockPool, ContiguousBlockPool, ContiguousKVCacheManager, PagedKVCacheManager
from conveyor.core.request import FinishReason, Request, RequestStatus
from conveyor.core.scheduler import Scheduler, SchedulerConfig, SchedulerOutput, StaticScheduler
from conveyor.core.scheduler.continuous import POLICIES, PREEMPTION_MODES
from tests.test_scheduler import (
    Abort,
    FakeClock,
    RequestSpec,
    TokenFn,
    Workload,
    hashed_token,
    reference_output,
    request_from_spec,
    workloads,
)
from tests.test_swap import SwapAwareExecutor

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


COMBOS = [Combo(*values) for values in itertools.product(SCHEDULER_CLASSES, POLICIES, PREEMPTION_MODES, LAYOUTS)]


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
    kv: PagedKVCacheManager
    if combo.layout == "paged":
        kv = PagedKVCacheManager(w.num_blocks, w.block_size, w.watermark, workload.num_cpu_blocks)
    else:
        kv = ContiguousKVCacheManager(w.num_blocks, w.block_size, w.max_model_len, workload.num_cpu_blocks)
    config = SchedulerConfig(
        w.max_num_seqs,
        w.max_num_batched_tokens,
        w.max_model_len,
        policy=combo.policy,
        preemption_mode=combo.preemption_mode,
    )
    return SCHEDULER_CLASSES[combo.scheduler](config, kv, clock=FakeClock())


def step_limit(workload: Workload) -> int:
    """Ten steps per token of work plus the arrival window: random workloads drain in under four."""
    tokens = sum(spec.prompt_len + spec.max_tokens for spec in workload.requests)
    return 100 + 10 * tokens


# ----- pool and table checks -------------------------------------------------


def free_block_ids(pool: BlockPool | ContiguousBlockPool) -> list[int]:
    """The pool's free list as ids, whatever its representation (deque or bitmap)."""
    if isinstance(pool, ContiguousBlockPool):
        return [block for block, free in enumerate(pool._free) if free]
    return list(pool._free)


def check_pool(pool: BlockPool | ContiguousBlockPool | None, tables: Mapping[str, list[int]], name: str) -> None:
    """One owner per block, no block both free and owned, none lost or invented."""
    if pool is None:
        assert not tables, f"{name} blocks held without a {name} pool"
        return
    owned = [block for table in tables.values() for block in table]
    free = free_block_ids(pool)
    assert len(owned) == len(set(owned)), f"a {name} block is owned twice: {dict(tables)}"
    assert len(free) == len(set(free)) == pool.num_free, f"{name} free list is inconsistent"
    assert set(owned).isdisjoint(free), f"a {name} block is both free and owned"
    assert sorted(owned + free) == list(range(pool.num_blocks)), f"{name}: free + owned != total"


def is_slab(table: list[int], slab_blocks: int) -> bool:
    return len(table) == slab_blocks and table == list(range(table[0], table[0] + slab_blocks))


def copy_block(source: dict[int, tuple[str, int]], src: int, dest: dict[int, tuple[str, int]], dst: int) -> None:
    """Copy one block's label; a block nobody wrote (a slab's tail, a fresh victim's) copies as garbage."""
    if src in source:
        dest[dst] = source[src]
    else:
        dest.pop(dst, None)


class KVShadow:
    """What each device and CPU block holds, as (request, logical block) labels, moved as the executor moves KV.

    The fake executor trusts the block tables; this catches swap pairs that copy the right number of
    blocks to the wrong places (a swapped request that comes back with another block's KV).
    """

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.device: dict[int, tuple[str, int]] = {}
        self.cpu: dict[int, tuple[str, int]] = {}

    def run_step(self, output: SchedulerOutput) -> None:
        # The order the executor copies in: swap-ins first, then swap-outs.
        for cpu, device in output.blocks_to_swap_in:
            copy_block(self.cpu, cpu, self.device, device)
        for device, cpu in output.blocks_to_swap_out:
            copy_block(self.device, device, self.cpu, cpu)
        for item in output.scheduled:
            cached_blocks = -(-item.start_position // self.block_size)
            for index in range(cached_blocks):
                held = self.device.get(item.block_ids[index])
                assert held == (item.request_id, index), f"{item.request_id} block {index} holds {held}'s KV"
            for index in range(item.start_position // self.block_size, -(-item.context_len // self.block_size)):
                self.device[item.block_ids[index]] = (item.request_id, index)


# ----- the driver -------------------------------------------------------------


class PolicySimulation:
    """Runs one workload through one combination, checking the contract around every call.

    With ``checked=False`` it only drives the loop and records the decisions, for the determinism check.
    """

    def __init__(self, combo: Combo, workload: PolicyWorkload, checked: bool = True) -> None:
        self.combo = combo
        self.workload = workload
        self.w = workload.base
        self.checked = checked
        self.scheduler = build_scheduler(combo, workload)
        self.kv = self.scheduler.kv_manager
        self.token_fn: TokenFn = lambda rid, pos: hashed_token(rid, pos, self.w.vocab)
        # Also right for recompute: it forgets every victim that is not SWAPPED, i.e. all of them.
        self.executor = SwapAwareExecutor(self.scheduler)
        self.executor.token_fn = self.token_fn
        self.all_requests: dict[str, Request] = {}
        self.aborted: set[str] = set()
        self.delivered: Counter[str] = Counter()  # finished requests handed back by update()
        self.finished_reported: Counter[str] = Counter()  # finished_request_ids of the step outputs
        self.batch: set[str] | None = None  # the static scheduler's current batch, as seen from outside
        self.records: list[StepRecord] = []
        self.shadow = KVShadow(self.kv.block_size)
        self.sightings = [0] * len(workload.targeted_aborts)  # times each targeted abort found its queue non-empty

    @property
    def is_static(self) -> bool:
        return isinstance(self.scheduler, StaticScheduler)

    def run(self) -> list[StepRecord]:
        step = 0
        limit = step_limit(self.w)
        pending = sorted(range(len(self.w.requests)), key=lambda i: self.w.requests[i].arrival_step)
        while pending or self.scheduler.has_unfinished_requests():
            while pending and self.w.requests[pending[0]].arrival_step <= step:
                self.add(pending.pop(0))
            self.abort_at(step, mid_step=False)
            output = self.schedule_and_check()
            sampled = self.executor.execute(output)
            if self.checked:
                self.shadow.run_step(output)
            self.abort_at(step, mid_step=True)
            self.update_and_check(output, sampled)
            step += 1
            assert step <= limit, f"not drained after {limit} steps: the scheduler livelocks"
        if self.checked:
            self.finished_reported.update(self.scheduler.schedule().finished_request_ids)
            self.check_end()
        return self.records

    def add(self, index: int) -> None:
        spec = self.w.requests[index]
        request_id = f"r{index}"
        request = request_from_spec(spec, request_id, arrival=float(len(self.all_requests)))
        request.priority = self.workload.priorities[index]
        self.all_requests[request_id] = request
        self.executor.prompts[request_id] = request.prompt_token_ids
        self.scheduler.add_request(request)

    def abort_at(self, step: int, mid_step: bool) -> None:
        for abort in self.w.aborts:
            if abort.step == step and abort.mid_step == mid_step:
                self.abort(f"r{abort.index}")
        for index, targeted in enumerate(self.workload.targeted_aborts):
            queue: list[Request] = getattr(self.scheduler, targeted.queue)
            if targeted.mid_step != mid_step or not queue:
                continue
            if self.sightings[index] == targeted.nth:
                self.abort(queue[-1].request_id)
            self.sightings[index] += 1
        self.close_finished_batch()

    def abort(self, request_id: str) -> None:
        live = request_id in self.scheduler.requests
        result = self.scheduler.abort_request(request_id)
        assert (result is not None) == live, "abort must find exactly the live requests"
        if result is not None:
            self.aborted.add(request_id)
            assert result.finish_reason is FinishReason.ABORT and result.is_finished
            assert request_id not in self.kv.block_tables and request_id not in self.kv.cpu_block_tables
        if self.checked:
            self.check_state()

    # ----- one step ---------------------------------------------------------

    def schedule_and_check(self) -> SchedulerOutput:
        sched = self.scheduler
        had_work = sched.has_unfinished_requests()
        waiting_before = {r.request_id for r in sched.waiting}
        running_before = {r.request_id for r in sched.running}
        cpu_before = {rid: list(table) for rid, table in self.kv.cpu_block_tables.items()}
        device_free_before = set(free_block_ids(self.kv.pool))

        output = sched.schedule()

        self.records.append(
            (
                tuple((s.request_id, s.start_position, s.num_scheduled_tokens) for s in output.scheduled),
                tuple(output.preempted_request_ids),
                tuple(output.blocks_to_swap_in),
                tuple(output.blocks_to_swap_out),
            )
        )
        if not self.checked:
            return output
        self.finished_reported.update(output.finished_request_ids)
        self.check_scheduled(output, running_before)
        self.check_state()
        self.check_swaps(output, cpu_before, device_free_before)
        assert output.memory == self.kv.memory_report()
        if self.is_static:
            self.check_static_batch(output, waiting_before)
        if had_work and not output.scheduled:
            # Legitimate only for request-level batching, in the step that hands back a batch whose
            # last unfinished member was aborted: everything that still holds a slot is finished.
            assert self.is_static, "a step with unfinished requests scheduled nothing"
            holders = sched.slot_holders()
            assert all(self.all_requests[rid].is_finished for rid in holders), (
                f"stalled: nothing scheduled, yet {holders} hold slots and waiting is "
                f"{[r.request_id for r in sched.waiting]}"
            )
        return output

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
        num_cpu = self.kv.cpu_pool.num_blocks if self.kv.cpu_pool else 0
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

    def update_and_check(self, output: SchedulerOutput, sampled: dict[str, int]) -> None:
        returned = self.scheduler.update(output, sampled)
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
        if kv.cpu_pool is not None:
            assert kv.num_free_cpu_blocks == kv.cpu_pool.num_blocks, "CPU blocks leaked"
        assert dict(self.finished_reported) == dict.fromkeys(self.all_requests, 1), "not reported finished once"
        for request_id, request in self.all_requests.items():
            ends = self.delivered[request_id] + (request_id in self.aborted)
            assert ends == 1, f"{request_id} ended {ends} times (delivered or aborted)"
            self.check_output(request)

    def check_output(self, request: Request) -> None:
        """The output a lone run gives: batching, preemption and swap must not change a token."""
        max_model_len = self.scheduler.config.max_model_len
        assert request.status is RequestStatus.FINISHED and request.finish_reason is not None
        assert request.num_output_tokens <= request.sampling_params.max_tokens
        assert request.num_tokens <= max_model_len
        expected, reason, stop_reason = reference_output(request, max_model_len, self.token_fn)
        if request.request_id in self.aborted:
            assert request.finish_reason is FinishReason.ABORT
            assert request.output_token_ids == expected[: request.num_output_tokens]
        else:
            assert request.output_token_ids == expected
            assert (request.finish_reason, request.stop_reason) == (reason, stop_reason)


# ----- the tests ----------------------------------------------------------------


@pytest.mark.parametrize("combo", COMBOS, ids=[c.id for c in COMBOS])
@settings(max_examples=60, deadline=None, phases=PHASES, suppress_health_check=[HealthCheck.too_slow])
@given(workload=policy_workloads())
def test_every_policy_keeps_the_contract_and_is_deterministic(combo: Combo, workload: PolicyWorkload) -> None:
    records = PolicySimulation(combo, workload).run()
    assert PolicySimulation(combo, workload, checked=False).run() == records, "same workload, other decisions"


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
    records = PolicySimulation(combo, PolicyWorkload(workload, priorities=(0, 0, -1), num_cpu_blocks=0)).run()
    assert [scheduled for scheduled, *_ in records] == [(("r0", 0, 1),), (("r1", 0, 1),), (("r2", 0, 1),)]
