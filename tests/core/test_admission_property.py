"""Load shedding as properties of random arrivals: queue caps and admission control (fake executor, a clock the
driver moves by a known step cost).

* queue caps hold: a request joins only if the waiting queue, it counted, stays within both caps; one is
  refused for a full queue only if it would not (no refusal under the caps); a prompt no queue could hold is a
  bad field, not a 429; the queue's token count is always the sum of what waits;
* admission control never drops an admitted request: every request ``add_request`` took finishes, with the
  output a lone run gives (none aborted, none failed), whatever was refused around it; a refused one leaves no
  trace (not among the requests, no blocks, the queues as they were);
* a deadline refusal names a request with a target, under ``admission_control``, and a Retry-After of whole
  seconds; the server's path (a frozen view, requests handed over but not yet queued counted) agrees with the
  scheduler's own.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conveyor.core.errors import FieldError, RequestRefused
from conveyor.core.kv import PagedKVCacheManager
from conveyor.core.request import FinishReason, Request, RequestStatus
from conveyor.core.scheduler import Scheduler, SchedulerConfig
from tests.core.test_slo_property import BASE_S, SteppedClock, step_cost, warmed_step_times
from tests.harness import SwapAwareExecutor, check_pool, make_request, reference_output


@dataclass(frozen=True)
class Arrival:
    step: int
    prompt_len: int
    max_tokens: int
    ttft_slo: float | None


@dataclass(frozen=True)
class ShedWorkload:
    num_blocks: int
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    policy: str
    preemption_mode: str
    max_num_queued_requests: int | None
    max_num_queued_tokens: int | None
    admission_control: bool
    arrivals: tuple[Arrival, ...]


@st.composite
def shed_workloads(draw: st.DrawFn) -> ShedWorkload:
    block_size = draw(st.integers(1, 4))
    num_blocks = draw(st.integers(16 // block_size + 2, 16 // block_size + 8))
    arrival = st.builds(Arrival, step=st.integers(0, 15), prompt_len=st.integers(1, 16),
                        max_tokens=st.integers(1, 10), ttft_slo=st.one_of(st.none(), st.floats(0.01, 0.5)))
    return ShedWorkload(
        num_blocks, block_size, draw(st.integers(1, 4)), draw(st.integers(4, 32)),
        draw(st.sampled_from(["fcfs", "slo", "priority"])), draw(st.sampled_from(["recompute", "swap"])),
        draw(st.one_of(st.none(), st.integers(1, 6))), draw(st.one_of(st.none(), st.integers(8, 60))),
        draw(st.booleans()), tuple(draw(st.lists(arrival, min_size=1, max_size=24))))


class ShedDriver:
    def __init__(self, workload: ShedWorkload) -> None:
        w = self.workload = workload
        self.clock = SteppedClock()
        kv = PagedKVCacheManager(w.num_blocks, w.block_size, watermark=0.0,
                                 num_cpu_blocks=w.num_blocks if w.preemption_mode == "swap" else 0)
        config = SchedulerConfig(w.max_num_seqs, w.max_num_batched_tokens, w.num_blocks * w.block_size, w.policy,
                                 w.preemption_mode, max_num_queued_requests=w.max_num_queued_requests,
                                 max_num_queued_tokens=w.max_num_queued_tokens, admission_control=w.admission_control)
        self.scheduler = Scheduler(config, kv, clock=self.clock, step_times=warmed_step_times())
        self.executor = SwapAwareExecutor(self.scheduler)
        self.accepted: dict[str, Request] = {}
        self.refused: Counter[str] = Counter()
        self.added: set[int] = set()  # workload indices offered already
        self.num_offered = 0

    def run(self, max_steps: int = 5000) -> ShedDriver:
        by_step: dict[int, list[tuple[int, Arrival]]] = {}
        for index, arrival in enumerate(self.workload.arrivals):
            by_step.setdefault(arrival.step, []).append((index, arrival))
        step, last = 0, max(by_step)
        while step <= last or self.scheduler.has_unfinished_requests():
            for index, arrival in by_step.get(step, []):
                if index not in self.added:
                    self.add(index, arrival)
            self.step()
            step += 1
            assert step < max_steps, "the scheduler livelocks"
        return self

    def add(self, index: int, arrival: Arrival) -> None:
        self.added.add(index)
        request = make_request(f"r{index}", arrival.prompt_len, arrival=self.clock.now,
                               max_tokens=arrival.max_tokens, ignore_eos=True)
        request.ttft_slo = arrival.ttft_slo
        self.offer(request)

    def offer(self, request: Request) -> None:
        """Hand a request to the scheduler and check what became of it, queued or refused."""
        sched, w = self.scheduler, self.workload
        self.num_offered += 1
        waiting_before, tokens_before = [r.request_id for r in sched.waiting], sched.num_queued_tokens
        try:
            sched.add_request(request)
        except (RequestRefused, FieldError) as refusal:
            assert request.request_id not in sched.requests
            assert request.request_id not in sched.kv_manager.block_tables
            assert [r.request_id for r in sched.waiting] == waiting_before, "a refusal changed the queue"
            assert sched.num_queued_tokens == tokens_before
            self.check_refusal(refusal, request, len(waiting_before), tokens_before)
            return
        assert w.max_num_queued_tokens is None or request.num_tokens <= w.max_num_queued_tokens
        assert w.max_num_queued_requests is None or len(sched.waiting) <= w.max_num_queued_requests
        assert w.max_num_queued_tokens is None or sched.num_queued_tokens <= w.max_num_queued_tokens
        self.accepted[request.request_id] = request
        self.executor.prompts[request.request_id] = request.prompt_token_ids

    def check_refusal(self, refusal: Exception, request: Request, queued: int, queued_tokens: int) -> None:
        w = self.workload
        if isinstance(refusal, FieldError):
            assert refusal.field == "prompt" and request.num_tokens > w.max_num_queued_tokens
            self.refused["too_long"] += 1
            return
        self.refused[refusal.reason] += 1
        assert refusal.retry_after >= 1 and refusal.retry_after == int(refusal.retry_after)
        if refusal.reason == "queue_full":
            over_requests = w.max_num_queued_requests is not None and queued + 1 > w.max_num_queued_requests
            over_tokens = w.max_num_queued_tokens is not None and \
                queued_tokens + request.num_tokens > w.max_num_queued_tokens
            assert over_requests or over_tokens, "refused for a full queue under both caps"
        else:
            assert refusal.reason == "deadline_unattainable"
            assert w.admission_control and request.ttft_slo is not None

    def step(self) -> None:
        sched = self.scheduler
        output = sched.schedule()
        sampled = self.executor.execute(output)
        start = self.clock.now
        self.clock.now += step_cost(output.num_batched_tokens) if output.scheduled else BASE_S
        for request in sched.update(output, sampled):
            if request.is_finished:
                assert request.request_id in self.accepted
        sched.record_step(output, self.clock.now - start)
        assert sched.num_queued_tokens == sum(r.num_tokens for r in sched.waiting)
        check_pool(sched.kv_manager.pool, sched.kv_manager.block_tables, "device")

    def check_end(self) -> None:
        w = self.workload
        assert len(self.accepted) + sum(self.refused.values()) == self.num_offered
        assert not self.scheduler.requests and self.scheduler.num_queued_tokens == 0
        for request in self.accepted.values():
            assert request.status is RequestStatus.FINISHED
            assert request.finish_reason is FinishReason.LENGTH, f"{request.request_id} ended {request.finish_reason}"
            expected, _, _ = reference_output(request, w.num_blocks * w.block_size, self.executor.token_fn)
            assert request.output_token_ids == expected


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(shed_workloads())
def test_caps_hold_and_no_admitted_request_is_dropped(workload: ShedWorkload) -> None:
    ShedDriver(workload).run().check_end()


def burst(caps: dict, count: int, prompt_len: int = 4, policy: str = "fcfs") -> ShedDriver:
    """``count`` requests at once on a pool of 16 blocks of 4 tokens, 2 seats, a budget of 16 tokens."""
    workload = ShedWorkload(16, 4, 2, 16, policy, "recompute", caps.get("requests"), caps.get("tokens"),
                            caps.get("admission_control", False),
                            tuple(Arrival(0, prompt_len, 4, caps.get("ttft")) for _ in range(count)))
    return ShedDriver(workload)


def offer_all(driver: ShedDriver) -> ShedDriver:
    for index, arrival in enumerate(driver.workload.arrivals):
        driver.add(index, arrival)
    return driver


def test_a_burst_past_the_request_cap_is_refused_at_the_cap() -> None:
    driver = offer_all(burst({"requests": 3}, 10))
    assert len(driver.accepted) == 3 and driver.refused == {"queue_full": 7}
    driver.run().check_end()


def test_the_token_cap_counts_tokens_and_refuses_an_impossible_prompt_as_a_bad_field() -> None:
    driver = offer_all(burst({"tokens": 10}, 4, prompt_len=4))
    assert len(driver.accepted) == 2 and driver.refused == {"queue_full": 2}
    with pytest.raises(FieldError, match="max-num-queued-tokens"):
        driver.scheduler.add_request(make_request("huge", 11, arrival=0.0))
    driver.run().check_end()


def test_a_deadline_the_queue_already_misses_is_refused_and_a_loose_one_taken() -> None:
    """With a backlog, a request whose target the wait ahead exceeds is refused; one with room is queued; the
    server's path (a frozen view, pending requests counted ahead) decides the same, and counts the pending."""
    driver = offer_all(burst({"admission_control": True, "ttft": 10.0}, 12, prompt_len=12, policy="slo"))
    assert len(driver.accepted) == 12
    for _ in range(3):
        driver.step()
    sched = driver.scheduler
    tight = make_request("tight", 8, arrival=driver.clock.now)
    tight.ttft_slo = 0.001  # less than its own prefill takes
    loose = make_request("loose", 8, arrival=driver.clock.now)
    loose.ttft_slo = 100.0
    view = sched.admission_view()
    refusal = sched.refusal(tight)
    assert refusal is not None and refusal.reason == "deadline_unattainable" and refusal.retry_after >= 1
    assert sched.refusal(tight, view) is not None and sched.refusal(loose, view) is None
    # 100 s is more than the queue ahead takes, but not more than a million more tokens handed over would.
    assert sched.refusal(loose, view, pending=(1, 10**6)) is not None
    driver.offer(loose)
    driver.offer(tight)
    assert "loose" in driver.accepted and driver.refused == {"deadline_unattainable": 1}
    driver.run().check_end()
