"""Property tests of the continuous-batching scheduler (fcfs, recompute, paged) over random workloads.

The workloads (``tests/harness.py``) draw engine settings, requests with every
kind of stop rule, and aborts before and in the middle of steps; ``StepDriver``
runs each through ``schedule`` -> fake executor -> ``update``, and the driver
here checks the contract around every call: KV ownership, the token budget and
``max_num_seqs``, which requests run and in what order (running first, victims
from the newest, FCFS admission that stops only for a reason), and at the end
that every request finished exactly once with the output a lone run gives.
The other policies, preemption modes and layouts are in test_policy_properties.py.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conveyor.core.request import Request, RequestStatus
from conveyor.core.scheduler import SchedulerOutput
from tests.harness import RequestSpec, StepDriver, Workload, check_pool, make_scheduler, workloads

MAX_STEPS = 20_000


@dataclass(frozen=True)
class BeforeStep:
    """What the checks of a step need to know of the state before ``schedule``."""

    running: list[str]
    waiting: list[str]
    had_work: bool
    progress: dict[str, tuple[int, int]]  # request id -> (num_computed_tokens, num_tokens)


class ContractDriver(StepDriver):
    """Runs one workload through the fcfs scheduler and checks the contract before and after every step."""

    def __init__(self, workload: Workload) -> None:
        scheduler = make_scheduler(
            workload.num_blocks,
            workload.block_size,
            max_num_seqs=workload.max_num_seqs,
            max_num_batched_tokens=workload.max_num_batched_tokens,
            max_model_len=workload.max_model_len,
            watermark=workload.watermark,
        )
        super().__init__(workload, scheduler, max_steps=MAX_STEPS)
        self.first_seen: list[str] = []
        self.preempted_reported: Counter[str] = Counter()

    # ----- hooks ----------------------------------------------------------------

    def before_schedule(self) -> BeforeStep:
        sched = self.scheduler
        return BeforeStep(
            running=[r.request_id for r in sched.running],
            waiting=[r.request_id for r in sched.waiting],
            had_work=sched.has_unfinished_requests(),
            progress={rid: (r.num_computed_tokens, r.num_tokens) for rid, r in sched.requests.items()},
        )

    def after_schedule(self, output: SchedulerOutput, before: BeforeStep) -> None:
        self.finished_reported.update(output.finished_request_ids)
        self.preempted_reported.update(output.preempted_request_ids)
        self.check_step(output, before)
        self.check_order(output, before.running, before.waiting)

    def after_update(self, output: SchedulerOutput, returned: list[Request]) -> None:
        self.check_state()

    def after_abort(self, request_id: str) -> None:
        self.check_kv()

    def at_end(self) -> None:
        self.collect_last_finishes()
        self.check_end()

    # ----- checks -----------------------------------------------------------------

    def check_kv(self) -> None:
        """No block has two owners, none is lost, and only running requests hold any."""
        kv = self.scheduler.kv_manager
        check_pool(kv.pool, kv.block_tables, "device")
        assert set(kv.block_tables) == {r.request_id for r in self.scheduler.running}

    def check_step(self, output: SchedulerOutput, before: BeforeStep) -> None:
        sched, kv, config = self.scheduler, self.scheduler.kv_manager, self.scheduler.config
        ids = [s.request_id for s in output.scheduled]
        assert len(ids) == len(set(ids)), "a request scheduled twice in one step"
        assert output.num_batched_tokens <= config.max_num_batched_tokens
        assert len(sched.running) <= config.max_num_seqs
        assert output.num_running == len(sched.running) and output.num_waiting == len(sched.waiting)
        assert output.kv_usage == kv.usage
        if before.had_work:
            assert output.scheduled, "a step with unfinished requests did nothing"
        self.check_kv()

        for item in output.scheduled:
            computed, total = before.progress[item.request_id]
            assert item.num_scheduled_tokens >= 1
            assert item.start_position == computed
            assert item.context_len <= total
            assert item.samples_token == (item.context_len == total)
            assert item.block_ids == kv.block_ids(item.request_id)
            assert len(item.block_ids) * kv.block_size >= item.context_len, "block table too short"
            if item.request_id not in self.first_seen:
                self.first_seen.append(item.request_id)

    def check_order(self, output: SchedulerOutput, running_before: list[str], waiting_before: list[str]) -> None:
        """Running requests first, oldest first; victims from the newest; admissions FCFS from the queue head."""
        sched = self.scheduler
        served = [s.request_id for s in output.scheduled if s.request_id in running_before]
        admitted = [s.request_id for s in output.scheduled if s.request_id not in running_before]
        victims = output.preempted_request_ids
        assert [s.request_id for s in output.scheduled] == served + admitted
        assert served == running_before[: len(served)]
        assert victims == running_before[::-1][: len(victims)]
        assert len(served) + len(victims) <= len(running_before)
        if len(served) + len(victims) < len(running_before):
            assert output.num_batched_tokens == sched.config.max_num_batched_tokens, "running request skipped"
        assert admitted == waiting_before[: len(admitted)], "admission is not FCFS"
        waiting_after = [r.request_id for r in sched.waiting]
        if victims:
            assert not admitted, "admitted in a step that preempted"
            assert waiting_after == victims[::-1] + waiting_before
        else:
            assert waiting_after == waiting_before[len(admitted) :]
            self.check_admission_stopped_for_a_reason(output)
        for request_id in victims:
            victim = sched.requests[request_id]
            assert victim.status is RequestStatus.PREEMPTED
            assert victim.num_computed_tokens == 0
        self.check_arrival_order()

    def check_arrival_order(self) -> None:
        """Waiting in arrival order, and nobody first scheduled before an earlier arrival."""
        sched = self.scheduler
        order = [self.arrival_index[r.request_id] for r in sched.waiting]
        assert order == sorted(order), "waiting queue out of arrival order"
        firsts = [self.arrival_index[rid] for rid in self.first_seen]
        assert firsts == sorted(firsts), "a request was first scheduled before an earlier arrival"
        never_scheduled = [self.arrival_index[r.request_id] for r in sched.waiting if r.first_scheduled_time is None]
        if never_scheduled and firsts:
            assert min(never_scheduled) > max(firsts), "a later arrival overtook a waiting request"

    def check_admission_stopped_for_a_reason(self, output: SchedulerOutput) -> None:
        """If the queue head was left waiting, the budget, max_num_seqs or the KV pool must have forbidden it."""
        sched = self.scheduler
        if not sched.waiting:
            return
        budget = sched.config.max_num_batched_tokens - output.num_batched_tokens
        if budget == 0 or len(sched.running) >= sched.config.max_num_seqs:
            return
        head = sched.waiting[0]
        num_new = min(head.num_tokens - head.num_computed_tokens, budget)
        assert not sched.kv_manager.can_admit(head.request_id, head.num_computed_tokens + num_new, bool(sched.running))

    def check_state(self) -> None:
        """After update: every running request has KV slots for what it computed and still has work."""
        sched = self.scheduler
        self.check_kv()
        assert set(sched.requests) == {r.request_id for r in [*sched.running, *sched.waiting]}
        order = [self.arrival_index[r.request_id] for r in sched.running]
        assert order == sorted(order), "running list out of arrival order"
        for request in sched.running:
            assert request.status is RequestStatus.RUNNING
            kv = sched.kv_manager
            assert len(kv.block_ids(request.request_id)) * kv.block_size >= request.num_computed_tokens
            assert request.num_computed_tokens < request.num_tokens <= sched.config.max_model_len
        for request in sched.waiting:
            assert request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
            assert request.num_computed_tokens == 0

    def check_end(self) -> None:
        sched = self.scheduler
        assert sched.requests == {}
        assert not sched.running and not sched.waiting
        assert sched.kv_manager.num_free_blocks == sched.kv_manager.num_blocks
        assert sched.kv_manager.block_tables == {}
        self.check_reported_once()
        assert sched.num_preemptions == sum(self.preempted_reported.values())
        for request_id, request in self.all_requests.items():
            self.check_output(request)
            assert request.num_preemptions == self.preempted_reported[request_id]
        scheduled_first = sorted(
            (r for r in self.all_requests.values() if r.first_scheduled_time is not None),
            key=lambda r: r.first_scheduled_time or 0.0,
        )
        assert [r.request_id for r in scheduled_first] == self.first_seen


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_random_workloads_keep_the_contract(workload: Workload) -> None:
    ContractDriver(workload).run()


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads(max_block_size=4, max_blocks=8, max_requests=8, max_arrival_step=3, max_prompt_len=6, vocabs=(1000,)))
def test_tight_pools_preempt_and_still_finish(workload: Workload) -> None:
    """Few blocks make preemption (and self-preemption) the common case rather than the rare one."""
    ContractDriver(workload).run()


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_requests_arriving_every_step_are_admitted_in_order(data: st.DataObject) -> None:
    """One arrival per step, sizes drawn with st.data(): with no aborts, first admissions follow arrivals exactly."""
    block_size = data.draw(st.integers(1, 16), label="block_size")
    num_blocks = data.draw(st.integers(2, 16), label="num_blocks")
    max_model_len = min(num_blocks * block_size, 48)
    workload = Workload(
        num_blocks=num_blocks,
        block_size=block_size,
        watermark=0.0,
        max_num_seqs=data.draw(st.integers(1, 4), label="max_num_seqs"),
        max_num_batched_tokens=data.draw(st.integers(1, 16), label="budget"),
        max_model_len=max_model_len,
        vocab=1000,
        requests=tuple(
            RequestSpec(
                prompt_len=data.draw(st.integers(1, max_model_len - 1)),
                max_tokens=data.draw(st.integers(1, 8)),
                arrival_step=step,
                use_eos=False,
                ignore_eos=False,
                stop_token_ids=(),
            )
            for step in range(data.draw(st.integers(1, 12), label="num_requests"))
        ),
        aborts=(),
    )
    driver = ContractDriver(workload)
    driver.run()
    assert driver.first_seen == [f"r{i}" for i in range(len(workload.requests))]
