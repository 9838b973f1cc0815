"""Tests of the continuous-batching scheduler against its contract.

The scheduler is driven the way the engine drives it (``schedule`` -> executor
-> ``update``), with a fake executor that plays the model: it returns a token
that depends only on the request and the position, and it keeps its own idea
of each request's KV cache so that a chunk which does not continue where the
previous one stopped, or which carries the wrong token ids, is caught. Because
the tokens do not depend on batching, every finished request must end with the
output a lone run would give, however often it was chunked or preempted.
"""

from __future__ import annotations

import zlib
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conveyor.core.kv import PagedKVCacheManager
from conveyor.core.request import FinishReason, Request, RequestStatus
from conveyor.core.sampling import SamplingParams
from conveyor.core.scheduler import Scheduler, SchedulerConfig, SchedulerOutput

EOS = 0
TokenFn = Callable[[str, int], int]


def hashed_token(request_id: str, position: int, vocab: int) -> int:
    """A token in ``[0, vocab)`` fixed by request and position (crc32: stable across processes)."""
    return zlib.crc32(f"{request_id}@{position}".encode()) % vocab


def never_eos(request_id: str, position: int) -> int:
    """Tokens in 1..1000, so no request ends before max_tokens unless a test says so."""
    return 1 + hashed_token(request_id, position, 1000)


class FakeClock:
    """Strictly increasing time, so the order of clock reads (e.g. first_scheduled_time) is visible."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


class FakeExecutor:
    """Plays the model for the scheduler: checks what it is handed and samples deterministic tokens.

    It tracks how many positions of each request it holds KV for, as a real
    executor would, and drops that on preemption or finish; each chunk must
    start exactly there and carry the request's true token ids.
    """

    def __init__(self, token_fn: TokenFn = never_eos) -> None:
        self.token_fn = token_fn
        self.prompts: dict[str, list[int]] = {}
        self.cached: dict[str, int] = {}

    def expected_tokens(self, request_id: str, start: int, end: int) -> list[int]:
        prompt = self.prompts[request_id]
        return [prompt[p] if p < len(prompt) else self.token_fn(request_id, p) for p in range(start, end)]

    def execute(self, output: SchedulerOutput) -> dict[str, int]:
        for request_id in [*output.finished_request_ids, *output.preempted_request_ids]:
            self.cached.pop(request_id, None)
        sampled: dict[str, int] = {}
        for item in output.scheduled:
            assert item.start_position == self.cached.get(item.request_id, 0), f"{item.request_id}: KV gap"
            expected = self.expected_tokens(item.request_id, item.start_position, item.context_len)
            assert item.token_ids == expected, f"{item.request_id}: wrong token ids"
            self.cached[item.request_id] = item.context_len
            if item.samples_token:
                # The token drawn after ``context_len`` tokens sits at position ``context_len``.
                sampled[item.request_id] = self.token_fn(item.request_id, item.context_len)
        return sampled


def make_scheduler(
    num_blocks: int,
    block_size: int,
    *,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 64,
    max_model_len: int | None = None,
    watermark: float = 0.0,
) -> Scheduler:
    """A scheduler over a fresh pool; max_model_len defaults to the whole KV capacity."""
    kv = PagedKVCacheManager(num_blocks, block_size, watermark)
    config = SchedulerConfig(max_num_seqs, max_num_batched_tokens, max_model_len or kv.capacity_tokens)
    return Scheduler(config, kv, clock=FakeClock())


def make_request(
    request_id: str,
    prompt_len: int,
    *,
    arrival: float,
    max_tokens: int = 16,
    eos: int | None = None,
    stop_token_ids: tuple[int, ...] = (),
    ignore_eos: bool = False,
) -> Request:
    params = SamplingParams(max_tokens=max_tokens, stop_token_ids=stop_token_ids, ignore_eos=ignore_eos)
    prompt = [2000 + (zlib.crc32(f"{request_id}:{i}".encode()) % 1000) for i in range(prompt_len)]
    return Request(request_id, prompt, params, arrival_time=arrival, eos_token_id=eos)


def request_from_spec(spec: RequestSpec, request_id: str, arrival: float) -> Request:
    """The request a workload's spec describes, arriving at ``arrival``."""
    return make_request(
        request_id,
        spec.prompt_len,
        arrival=arrival,
        max_tokens=spec.max_tokens,
        eos=EOS if spec.use_eos else None,
        stop_token_ids=spec.stop_token_ids,
        ignore_eos=spec.ignore_eos,
    )


def chunks(output: SchedulerOutput) -> list[tuple[str, int, int, bool]]:
    """(request_id, start_position, num_tokens, sample) per scheduled request: what a step did, at a glance."""
    return [(s.request_id, s.start_position, s.num_scheduled_tokens, s.samples_token) for s in output.scheduled]


def owned_blocks(scheduler: Scheduler) -> list[int]:
    return [block for table in scheduler.kv_manager.block_tables.values() for block in table]


@dataclass
class Harness:
    """A scheduler, a fake executor and a monotonic arrival counter: the engine loop without the model."""

    scheduler: Scheduler
    executor: FakeExecutor = field(default_factory=FakeExecutor)
    arrivals: int = 0

    def add(
        self,
        request_id: str,
        prompt_len: int,
        *,
        arrival: float | None = None,
        max_tokens: int = 16,
        eos: int | None = None,
        stop_token_ids: tuple[int, ...] = (),
        ignore_eos: bool = False,
    ) -> Request:
        """Add a request; by default each arrives one time unit after the previous one."""
        arrival = float(self.arrivals) if arrival is None else arrival
        request = make_request(
            request_id,
            prompt_len,
            arrival=arrival,
            max_tokens=max_tokens,
            eos=eos,
            stop_token_ids=stop_token_ids,
            ignore_eos=ignore_eos,
        )
        self.arrivals += 1
        self.scheduler.add_request(request)
        self.executor.prompts[request_id] = request.prompt_token_ids
        return request

    def step(self) -> SchedulerOutput:
        output = self.scheduler.schedule()
        self.scheduler.update(output, self.executor.execute(output))
        return output

    def run_to_end(self, max_steps: int = 1000) -> list[SchedulerOutput]:
        outputs = []
        while self.scheduler.has_unfinished_requests():
            outputs.append(self.step())
            assert len(outputs) <= max_steps, "scheduler did not drain"
        return outputs


# ============================================================================
# Property tests over random workloads
# ============================================================================


@dataclass(frozen=True)
class RequestSpec:
    prompt_len: int
    max_tokens: int
    arrival_step: int
    use_eos: bool
    ignore_eos: bool
    stop_token_ids: tuple[int, ...]


@dataclass(frozen=True)
class Abort:
    step: int
    index: int  # into the workload's requests; it may not have arrived yet, or be finished already
    mid_step: bool  # between the executor and update(), as when a client hangs up during a step


@dataclass(frozen=True)
class Workload:
    num_blocks: int
    block_size: int
    watermark: float
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    vocab: int  # token 0 is EOS, so a small vocab makes EOS and stop-token finishes common
    requests: tuple[RequestSpec, ...]
    aborts: tuple[Abort, ...]


@st.composite
def workloads(
    draw: st.DrawFn,
    max_block_size: int = 16,
    max_blocks: int = 24,
    max_requests: int = 10,
    max_arrival_step: int = 12,
    max_prompt_len: int = 96,
    vocabs: tuple[int, ...] = (3, 16, 1000),
) -> Workload:
    """Random engine settings and requests; max_model_len always fits the pool, as the scheduler demands."""
    block_size = draw(st.integers(1, max_block_size))
    num_blocks = draw(st.integers(2 if block_size == 1 else 1, max_blocks))
    max_model_len = draw(st.integers(2, min(num_blocks * block_size, 96)))
    vocab = draw(st.sampled_from(vocabs))
    request_specs = draw(
        st.lists(
            st.builds(
                RequestSpec,
                prompt_len=st.integers(1, min(max_model_len - 1, max_prompt_len)),
                max_tokens=st.integers(1, 24),
                arrival_step=st.integers(0, max_arrival_step),
                use_eos=st.booleans(),
                ignore_eos=st.booleans(),
                stop_token_ids=st.lists(st.integers(0, vocab - 1), max_size=2).map(tuple),
            ),
            min_size=1,
            max_size=max_requests,
        )
    )
    aborts = draw(
        st.lists(
            st.builds(
                Abort,
                step=st.integers(0, 30),
                index=st.integers(0, len(request_specs) - 1),
                mid_step=st.booleans(),
            ),
            max_size=3,
        )
    )
    return Workload(
        num_blocks=num_blocks,
        block_size=block_size,
        watermark=draw(st.sampled_from([0.0, 0.01, 0.1, 0.3])),
        max_num_seqs=draw(st.integers(1, 8)),
        max_num_batched_tokens=draw(st.integers(1, 64)),
        max_model_len=max_model_len,
        vocab=vocab,
        requests=tuple(request_specs),
        aborts=tuple(aborts),
    )


def reference_output(
    request: Request, max_model_len: int, token_fn: TokenFn
) -> tuple[list[int], FinishReason, int | None]:
    """What the request yields run alone: the contract's stop rules, written independently of the scheduler."""
    params = request.sampling_params
    out: list[int] = []
    while True:
        token = token_fn(request.request_id, request.num_prompt_tokens + len(out))
        out.append(token)
        if token == request.eos_token_id and not params.ignore_eos:
            return out, FinishReason.STOP, None
        if token in params.stop_token_ids:
            return out, FinishReason.STOP, token
        if len(out) >= params.max_tokens or request.num_prompt_tokens + len(out) >= max_model_len:
            return out, FinishReason.LENGTH, None


MAX_STEPS = 20_000


class Simulation:
    """Runs one workload through the scheduler and checks the contract before and after every step."""

    def __init__(self, workload: Workload) -> None:
        self.w = workload
        self.scheduler = make_scheduler(
            workload.num_blocks,
            workload.block_size,
            max_num_seqs=workload.max_num_seqs,
            max_num_batched_tokens=workload.max_num_batched_tokens,
            max_model_len=workload.max_model_len,
            watermark=workload.watermark,
        )
        self.token_fn: TokenFn = lambda rid, pos: hashed_token(rid, pos, workload.vocab)
        self.executor = FakeExecutor(self.token_fn)
        self.arrival_index: dict[str, int] = {}
        self.all_requests: dict[str, Request] = {}
        self.aborted: set[str] = set()
        self.first_seen: list[str] = []
        self.finished_reported: Counter[str] = Counter()
        self.preempted_reported: Counter[str] = Counter()

    # ----- driving ----------------------------------------------------------

    def run(self) -> None:
        step = 0
        pending = sorted(range(len(self.w.requests)), key=lambda i: self.w.requests[i].arrival_step)
        while pending or self.scheduler.has_unfinished_requests():
            while pending and self.w.requests[pending[0]].arrival_step <= step:
                self.add(pending.pop(0))
            self.abort_at(step, mid_step=False)
            output = self.schedule_and_check()
            sampled = self.executor.execute(output)
            self.abort_at(step, mid_step=True)
            self.scheduler.update(output, sampled)
            self.check_state()
            step += 1
            assert step <= MAX_STEPS, "scheduler did not drain the workload"
        self.finished_reported.update(self.scheduler.schedule().finished_request_ids)
        self.check_end()

    def add(self, index: int) -> None:
        spec = self.w.requests[index]
        request_id = f"r{index}"
        request = request_from_spec(spec, request_id, arrival=float(len(self.arrival_index)))
        self.arrival_index[request_id] = len(self.arrival_index)
        self.all_requests[request_id] = request
        self.executor.prompts[request_id] = request.prompt_token_ids
        self.scheduler.add_request(request)

    def abort_at(self, step: int, mid_step: bool) -> None:
        for abort in self.w.aborts:
            if abort.step == step and abort.mid_step == mid_step:
                request_id = f"r{abort.index}"
                live = request_id in self.scheduler.requests
                result = self.scheduler.abort_request(request_id)
                assert (result is not None) == live
                if live:
                    self.aborted.add(request_id)
                    assert result.finish_reason is FinishReason.ABORT
                    assert request_id not in self.scheduler.kv_manager.block_tables
                self.check_kv()

    # ----- checks -----------------------------------------------------------

    def check_kv(self) -> None:
        """No block has two owners, none is lost, and only running requests hold any."""
        kv = self.scheduler.kv_manager
        owned = owned_blocks(self.scheduler)
        assert len(owned) == len(set(owned)), "a block is owned twice"
        assert kv.num_free_blocks + len(owned) == kv.num_blocks
        assert set(owned).isdisjoint(kv.pool._free), "a block is both free and owned"
        assert set(kv.block_tables) == {r.request_id for r in self.scheduler.running}

    def schedule_and_check(self) -> SchedulerOutput:
        sched, kv, config = self.scheduler, self.scheduler.kv_manager, self.scheduler.config
        running_before = [r.request_id for r in sched.running]
        waiting_before = [r.request_id for r in sched.waiting]
        had_work = sched.has_unfinished_requests()
        before = {rid: (r.num_computed_tokens, r.num_tokens) for rid, r in sched.requests.items()}

        output = sched.schedule()

        self.finished_reported.update(output.finished_request_ids)
        self.preempted_reported.update(output.preempted_request_ids)
        ids = [s.request_id for s in output.scheduled]
        assert len(ids) == len(set(ids)), "a request scheduled twice in one step"
        assert output.num_batched_tokens <= config.max_num_batched_tokens
        assert len(sched.running) <= config.max_num_seqs
        assert output.num_running == len(sched.running) and output.num_waiting == len(sched.waiting)
        assert output.kv_usage == kv.usage
        if had_work:
            assert output.scheduled, "a step with unfinished requests did nothing"
        self.check_kv()

        for item in output.scheduled:
            computed, total = before[item.request_id]
            assert item.num_scheduled_tokens >= 1
            assert item.start_position == computed
            assert item.context_len <= total
            assert item.samples_token == (item.context_len == total)
            assert item.block_ids == kv.block_ids(item.request_id)
            assert len(item.block_ids) * kv.block_size >= item.context_len, "block table too short"
            if item.request_id not in self.first_seen:
                self.first_seen.append(item.request_id)

        self.check_order(output, running_before, waiting_before)
        return output

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
        assert dict(self.finished_reported) == dict.fromkeys(self.all_requests, 1), "not finished exactly once"
        assert sched.num_preemptions == sum(self.preempted_reported.values())
        for request_id, request in self.all_requests.items():
            self.check_finished_request(request)
            assert request.num_preemptions == self.preempted_reported[request_id]
        scheduled_first = sorted(
            (r for r in self.all_requests.values() if r.first_scheduled_time is not None),
            key=lambda r: r.first_scheduled_time or 0.0,
        )
        assert [r.request_id for r in scheduled_first] == self.first_seen

    def check_finished_request(self, request: Request) -> None:
        assert request.status is RequestStatus.FINISHED
        assert request.num_output_tokens <= request.sampling_params.max_tokens
        assert request.num_tokens <= self.scheduler.config.max_model_len
        expected, reason, stop_reason = reference_output(request, self.scheduler.config.max_model_len, self.token_fn)
        if request.request_id in self.aborted:
            assert request.finish_reason is FinishReason.ABORT
            assert request.output_token_ids == expected[: request.num_output_tokens]
        else:
            assert request.output_token_ids == expected
            assert (request.finish_reason, request.stop_reason) == (reason, stop_reason)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_random_workloads_keep_the_contract(workload: Workload) -> None:
    Simulation(workload).run()


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads(max_block_size=4, max_blocks=8, max_requests=8, max_arrival_step=3, max_prompt_len=6, vocabs=(1000,)))
def test_tight_pools_preempt_and_still_finish(workload: Workload) -> None:
    """Few blocks make preemption (and self-preemption) the common case rather than the rare one."""
    Simulation(workload).run()


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
    simulation = Simulation(workload)
    simulation.run()
    assert simulation.first_seen == [f"r{i}" for i in range(len(workload.requests))]


# ============================================================================
# Deterministic examples
# ============================================================================


def test_long_prompt_is_chunked_by_the_token_budget_and_samples_last() -> None:
    h = Harness(make_scheduler(8, 4, max_num_batched_tokens=4, max_model_len=32))
    request = h.add("r0", 10, max_tokens=3)
    steps = [h.step() for _ in range(3)]
    assert [chunks(s) for s in steps] == [[("r0", 0, 4, False)], [("r0", 4, 4, False)], [("r0", 8, 2, True)]]
    assert [len(s.scheduled[0].block_ids) for s in steps] == [1, 2, 3]
    assert request.num_output_tokens == 1
    assert chunks(h.step()) == [("r0", 10, 1, True)]


def test_chunked_prefill_shares_the_budget_with_running_requests_first() -> None:
    """A newcomer gets only what the running requests leave of the budget, and samples only when caught up."""
    h = Harness(make_scheduler(8, 4, max_num_batched_tokens=4, max_model_len=32))
    h.add("r0", 10, max_tokens=5)
    h.add("r1", 3, max_tokens=5)
    outputs = [h.step() for _ in range(5)]
    assert [chunks(o) for o in outputs] == [
        [("r0", 0, 4, False)],
        [("r0", 4, 4, False)],
        [("r0", 8, 2, True), ("r1", 0, 2, False)],
        [("r0", 10, 1, True), ("r1", 2, 1, True)],
        [("r0", 11, 1, True), ("r1", 3, 1, True)],
    ]


def test_finished_request_frees_blocks_at_once_and_waiting_joins_next_step() -> None:
    h = Harness(make_scheduler(2, 4, max_model_len=8))
    first = h.add("r0", 7, max_tokens=1)
    h.add("r1", 3)
    step1 = h.step()
    assert chunks(step1) == [("r0", 0, 7, True)]  # r1 waits: r0 holds both blocks
    assert first.is_finished and first.finish_reason is FinishReason.LENGTH
    assert h.scheduler.kv_manager.num_free_blocks == 2
    assert "r0" not in h.scheduler.kv_manager.block_tables and "r0" not in h.scheduler.requests
    step2 = h.step()
    assert chunks(step2) == [("r1", 0, 3, True)]
    assert step2.finished_request_ids == ["r0"]


def preemption_setup() -> Harness:
    """r0 (1 block) and r1 (2 blocks) fill a 3-block pool; after one token each, r0 needs a block that is not there."""
    h = Harness(make_scheduler(3, 2, max_model_len=6))
    h.add("r0", 2, max_tokens=10)
    h.add("r1", 4, max_tokens=10)
    assert chunks(h.step()) == [("r0", 0, 2, True), ("r1", 0, 4, True)]
    assert h.scheduler.kv_manager.num_free_blocks == 0
    return h


def test_preemption_evicts_the_most_recent_arrival_to_the_front_of_waiting() -> None:
    h = preemption_setup()
    h.add("r2", 1)  # arrives after r1, waits behind it
    victim = h.scheduler.requests["r1"]
    step2 = h.step()
    assert chunks(step2) == [("r0", 2, 1, True)]
    assert step2.preempted_request_ids == ["r1"]
    assert [r.request_id for r in h.scheduler.waiting] == ["r1", "r2"]
    assert victim.status is RequestStatus.PREEMPTED
    assert victim.num_computed_tokens == 0
    assert victim.num_preemptions == 1 and h.scheduler.num_preemptions == 1
    assert victim.num_output_tokens == 1  # output survives; only its KV is recomputed
    assert "r1" not in h.scheduler.kv_manager.block_tables


def test_no_admission_in_a_step_that_preempted() -> None:
    """After evicting r1 a block is free and r2 would fit, but admitting it would just cause the next preemption."""
    h = preemption_setup()
    h.add("r2", 1)
    step2 = h.step()
    assert step2.preempted_request_ids == ["r1"]
    assert h.scheduler.kv_manager.num_free_blocks == 1
    assert h.scheduler.kv_manager.can_admit("r2", 1)
    assert [s.request_id for s in step2.scheduled] == ["r0"]


def test_preempted_request_is_recomputed_with_its_output_and_resumes() -> None:
    h = preemption_setup()
    victim = h.scheduler.requests["r1"]
    h.run_to_end()
    assert victim.finish_reason is FinishReason.LENGTH
    assert victim.num_tokens == 6
    assert victim.output_token_ids == [never_eos("r1", 4), never_eos("r1", 5)]


def test_victim_is_the_latest_arrival_not_the_request_that_needs_the_block() -> None:
    h = Harness(make_scheduler(4, 2, max_model_len=8))
    h.add("r0", 1)
    h.add("r1", 2)
    h.add("r2", 4)
    assert chunks(h.step()) == [("r0", 0, 1, True), ("r1", 0, 2, True), ("r2", 0, 4, True)]
    step2 = h.step()  # r1 now needs a second block; r2 is the newest
    assert chunks(step2) == [("r0", 1, 1, True), ("r1", 2, 1, True)]
    assert step2.preempted_request_ids == ["r2"]
    assert [r.request_id for r in h.scheduler.running] == ["r0", "r1"]


def test_equal_arrival_times_fall_back_to_the_order_requests_were_added() -> None:
    """Requests added with one arrival_time (as bench/throughput.py does) still arrive in add order.

    FCFS admission follows add order, so the running order and the choice of
    victim must too; comparing request ids as strings would rank "r10" before
    "r2" and evict the older request.
    """
    h = Harness(make_scheduler(3, 2, max_model_len=6))
    h.add("r2", 2, arrival=0.0, max_tokens=10)
    h.add("r10", 4, arrival=0.0, max_tokens=10)
    assert chunks(h.step()) == [("r2", 0, 2, True), ("r10", 0, 4, True)]
    step2 = h.step()  # both need a block, none is free: r10 came last, so r10 goes
    assert step2.preempted_request_ids == ["r10"]
    assert chunks(step2) == [("r2", 2, 1, True)]


def test_request_preempts_itself_when_it_is_the_latest() -> None:
    h = Harness(make_scheduler(3, 2, max_model_len=6))
    h.add("r0", 3)
    needing = h.add("r1", 2)
    h.step()
    step2 = h.step()  # r1 needs a second block; it is itself the newest running request
    assert chunks(step2) == [("r0", 3, 1, True)]
    assert step2.preempted_request_ids == ["r1"]
    assert needing.status is RequestStatus.PREEMPTED and needing.num_preemptions == 1
    assert [r.request_id for r in h.scheduler.waiting] == ["r1"]
    assert [r.request_id for r in h.scheduler.running] == ["r0"]


def test_several_victims_return_to_waiting_in_arrival_order_before_later_arrivals() -> None:
    h = Harness(make_scheduler(4, 1, max_model_len=4))
    for i in range(4):
        h.add(f"r{i}", 1)
    h.step()
    h.add("r4", 1)
    step2 = h.step()
    assert step2.preempted_request_ids == ["r3", "r2"]
    assert chunks(step2) == [("r0", 1, 1, True), ("r1", 1, 1, True)]
    assert [r.request_id for r in h.scheduler.waiting] == ["r2", "r3", "r4"]


def test_max_num_seqs_caps_admission() -> None:
    h = Harness(make_scheduler(16, 4, max_num_seqs=2))
    h.add("r0", 1, max_tokens=1)
    h.add("r1", 1, max_tokens=5)
    h.add("r2", 1, max_tokens=5)
    step1 = h.step()
    assert [s.request_id for s in step1.scheduled] == ["r0", "r1"]
    assert step1.num_running == 2 and step1.num_waiting == 1
    step2 = h.step()  # r0 finished in step 1: r2 takes its seat
    assert [s.request_id for s in step2.scheduled] == ["r1", "r2"]


@pytest.mark.parametrize("prompt_len", [8, 9, 20])
def test_prompt_that_fills_max_model_len_is_refused(prompt_len: int) -> None:
    scheduler = make_scheduler(4, 4, max_model_len=8)
    with pytest.raises(ValueError, match="prompt"):
        scheduler.add_request(make_request("r0", prompt_len, arrival=0.0))
    assert scheduler.requests == {} and not scheduler.waiting


def test_prompt_one_short_of_max_model_len_is_accepted_and_gets_one_token() -> None:
    h = Harness(make_scheduler(4, 4, max_model_len=8))
    request = h.add("r0", 7, max_tokens=100)
    h.run_to_end()
    assert request.num_output_tokens == 1 and request.finish_reason is FinishReason.LENGTH


def test_max_model_len_beyond_kv_capacity_is_refused() -> None:
    kv = PagedKVCacheManager(num_blocks=4, block_size=4)
    with pytest.raises(ValueError, match="max_model_len"):
        Scheduler(SchedulerConfig(max_model_len=17), kv)
    assert Scheduler(SchedulerConfig(max_model_len=16), kv).config.max_model_len == 16


@pytest.mark.parametrize("field_name", ["max_num_seqs", "max_num_batched_tokens", "max_model_len"])
def test_scheduler_config_rejects_zero(field_name: str) -> None:
    with pytest.raises(ValueError, match=field_name):
        SchedulerConfig(**{field_name: 0})


def test_duplicate_request_id_is_refused_while_waiting_or_running() -> None:
    h = Harness(make_scheduler(8, 4, max_num_seqs=1))
    h.add("r0", 2)
    h.add("r1", 2)
    h.step()  # r0 running, r1 waiting
    for request_id in ("r0", "r1"):
        with pytest.raises(ValueError, match=request_id):
            h.scheduler.add_request(make_request(request_id, 1, arrival=9.0))
    assert len(h.scheduler.waiting) == 1 and len(h.scheduler.running) == 1


def test_abort_of_waiting_request() -> None:
    h = Harness(make_scheduler(8, 4, max_num_seqs=1))
    h.add("r0", 2)
    waiting = h.add("r1", 2)
    h.step()
    free_before = h.scheduler.kv_manager.num_free_blocks
    assert h.scheduler.abort_request("r1") is waiting
    assert waiting.finish_reason is FinishReason.ABORT and waiting.is_finished
    assert not h.scheduler.waiting and "r1" not in h.scheduler.requests
    assert h.scheduler.kv_manager.num_free_blocks == free_before
    assert h.scheduler.abort_request("r1") is None
    assert h.step().finished_request_ids == ["r1"]


def test_abort_of_running_request_frees_its_blocks() -> None:
    h = Harness(make_scheduler(4, 2, max_num_seqs=1, max_model_len=8))
    running = h.add("r0", 5)
    h.add("r1", 3)
    h.step()
    assert len(h.scheduler.kv_manager.block_ids("r0")) == 3
    assert h.scheduler.abort_request("r0") is running
    assert h.scheduler.kv_manager.num_free_blocks == 4 and h.scheduler.kv_manager.block_tables == {}
    assert not h.scheduler.running
    step2 = h.step()
    assert step2.finished_request_ids == ["r0"]
    assert chunks(step2) == [("r1", 0, 3, True)]


def test_abort_of_preempted_request() -> None:
    h = preemption_setup()
    h.step()  # r1 preempted
    aborted = h.scheduler.abort_request("r1")
    assert aborted is not None and aborted.finish_reason is FinishReason.ABORT
    assert aborted.num_preemptions == 1
    h.run_to_end()
    assert h.scheduler.kv_manager.num_free_blocks == 3


def test_abort_while_the_step_runs_drops_the_sampled_token() -> None:
    h = Harness(make_scheduler(4, 4))
    request = h.add("r0", 3)
    output = h.scheduler.schedule()
    sampled = h.executor.execute(output)
    h.scheduler.abort_request("r0")
    assert h.scheduler.update(output, sampled) == []
    assert request.num_output_tokens == 0 and request.finish_reason is FinishReason.ABORT
    assert h.scheduler.kv_manager.num_free_blocks == 4


def test_request_id_reused_while_the_step_runs_does_not_take_the_old_result() -> None:
    """A client that aborts and resubmits under the same id mid-step gets a fresh request, untouched by update()."""
    h = Harness(make_scheduler(8, 4))
    h.add("r0", 3)
    output = h.scheduler.schedule()
    sampled = h.executor.execute(output)
    h.scheduler.abort_request("r0")
    fresh = h.add("r0", 5, max_tokens=2)
    assert h.scheduler.update(output, sampled) == []
    assert fresh.status is RequestStatus.WAITING
    assert fresh.num_computed_tokens == 0 and fresh.output_token_ids == []
    h.run_to_end()
    assert fresh.output_token_ids == [never_eos("r0", 5), never_eos("r0", 6)]


def test_finish_request_from_outside_frees_blocks() -> None:
    """The engine ends a request on a stop string through finish_request."""
    h = Harness(make_scheduler(4, 4))
    request = h.add("r0", 3)
    h.step()
    h.scheduler.finish_request("r0", FinishReason.STOP, "###")
    assert (request.finish_reason, request.stop_reason) == (FinishReason.STOP, "###")
    assert h.scheduler.kv_manager.num_free_blocks == 4 and not h.scheduler.running
    assert h.step().finished_request_ids == ["r0"]


def scripted(tokens: dict[int, int]) -> TokenFn:
    """Tokens fixed at some positions (any request), never_eos elsewhere."""
    return lambda request_id, position: tokens.get(position, never_eos(request_id, position))


def run_one(
    prompt_len: int,
    token_fn: TokenFn,
    *,
    max_tokens: int,
    max_model_len: int = 64,
    eos: int | None = None,
    stop_token_ids: tuple[int, ...] = (),
    ignore_eos: bool = False,
) -> Request:
    """Run a single request to its end and hand it back for its finish reason."""
    h = Harness(make_scheduler(16, 4, max_model_len=max_model_len), FakeExecutor(token_fn))
    request = h.add(
        "r0", prompt_len, max_tokens=max_tokens, eos=eos, stop_token_ids=stop_token_ids, ignore_eos=ignore_eos
    )
    h.run_to_end()
    return request


def test_eos_ends_request_with_stop() -> None:
    request = run_one(4, scripted({6: EOS}), eos=EOS, max_tokens=10)
    assert request.output_token_ids[-1] == EOS and request.num_output_tokens == 3
    assert (request.finish_reason, request.stop_reason) == (FinishReason.STOP, None)


def test_eos_with_ignore_eos_runs_to_max_tokens() -> None:
    request = run_one(4, scripted({6: EOS}), eos=EOS, ignore_eos=True, max_tokens=5)
    assert request.num_output_tokens == 5 and request.output_token_ids[2] == EOS
    assert request.finish_reason is FinishReason.LENGTH


def test_eos_token_without_eos_id_does_not_stop() -> None:
    request = run_one(4, scripted({5: EOS}), eos=None, max_tokens=4)
    assert request.num_output_tokens == 4 and request.finish_reason is FinishReason.LENGTH


def test_stop_token_id_ends_request_with_stop_and_names_the_token() -> None:
    request = run_one(4, scripted({5: 7}), stop_token_ids=(7, 9), max_tokens=10)
    assert request.output_token_ids[-1] == 7 and request.num_output_tokens == 2
    assert (request.finish_reason, request.stop_reason) == (FinishReason.STOP, 7)


def test_stop_token_id_ends_request_even_with_ignore_eos() -> None:
    request = run_one(4, scripted({4: 7}), stop_token_ids=(7,), ignore_eos=True, max_tokens=10)
    assert request.num_output_tokens == 1 and request.finish_reason is FinishReason.STOP


def test_max_tokens_ends_request_with_length() -> None:
    request = run_one(4, never_eos, max_tokens=3)
    assert request.num_output_tokens == 3
    assert (request.finish_reason, request.stop_reason) == (FinishReason.LENGTH, None)


def test_max_model_len_ends_request_with_length() -> None:
    request = run_one(6, never_eos, max_model_len=8, max_tokens=100)
    assert request.num_output_tokens == 2 and request.num_tokens == 8
    assert request.finish_reason is FinishReason.LENGTH
