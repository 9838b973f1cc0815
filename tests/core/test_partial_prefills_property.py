"""Several partial prefills per step, long ones capped, with an aging bound: property tests.

The workloads are the scheduler tests' own (``tests/harness.py``), with long and short prompts mixed and
partial-prefill limits drawn; ``StepDriver`` runs them, and the driver here checks around every step:

* no request takes more than its share of the step's budget, ``max_num_batched_tokens`` over
  ``max_num_partial_prefills``, even alone (so a step holding a long prompt stays short);
* at most ``max_num_partial_prefills`` prompts are under way (computed in part) after a step, and at most
  ``max_long_partial_prefills`` of them long (more than the threshold still to compute when they started);
* aging: no waiting request is overtaken (a later arrival admitted while it waits) in more than
  ``PREFILL_AGING_STEPS`` steps; and the KV pool, the drain and every output are as without the caps.

A mutant without aging must fail on a stream of short prompts behind two long ones.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conveyor.core.kv import PagedKVCacheManager
from conveyor.core.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from conveyor.core.scheduler.prefill import PREFILL_AGING_STEPS
from tests.harness import FakeClock, Harness, RequestSpec, StepDriver, Workload, check_pool, workloads


@dataclass(frozen=True)
class Limits:
    max_num_partial_prefills: int
    max_long_partial_prefills: int
    long_prefill_token_threshold: int
    preemption_mode: str


@st.composite
def limits(draw: st.DrawFn) -> Limits:
    n = draw(st.integers(2, 4))
    threshold = draw(st.sampled_from([0, 4, 12, 24, 48]))
    return Limits(n, draw(st.integers(1, n)), threshold, draw(st.sampled_from(["recompute", "swap"])))


def build(workload: Workload, lim: Limits) -> Scheduler:
    num_cpu = workload.num_blocks if lim.preemption_mode == "swap" else 0
    kv = PagedKVCacheManager(workload.num_blocks, workload.block_size, workload.watermark, num_cpu)
    config = SchedulerConfig(workload.max_num_seqs, workload.max_num_batched_tokens, workload.max_model_len, "fcfs",
                             lim.preemption_mode, max_num_partial_prefills=lim.max_num_partial_prefills,
                             max_long_partial_prefills=lim.max_long_partial_prefills,
                             long_prefill_token_threshold=lim.long_prefill_token_threshold)
    return Scheduler(config, kv, clock=FakeClock())


@dataclass(frozen=True)
class BeforeStep:
    lacking: dict[str, int]  # waiting and swapped requests: tokens they lack
    waiting: list[str]  # in queue order (arrival, under fcfs)
    share: int  # the most tokens one request may take in the step


class PrefillDriver(StepDriver):
    def __init__(self, workload: Workload, lim: Limits) -> None:
        super().__init__(workload, build(workload, lim), max_steps=20_000, swap_aware=True)
        self.limits = lim
        prefills = self.scheduler.prefills
        assert prefills is not None
        self.threshold = prefills.long_prefill_token_threshold
        self.long: set[str] = set()  # prefills under way that started long
        self.overtaken: Counter[str] = Counter()

    def before_schedule(self) -> BeforeStep:
        sched = self.scheduler
        queued = [*sched.waiting, *sched.swapped]
        share = max(1, sched.config.max_num_batched_tokens // self.limits.max_num_partial_prefills)
        return BeforeStep({r.request_id: r.num_tokens - r.num_computed_tokens for r in queued},
                          [r.request_id for r in sched.waiting], share)

    def after_schedule(self, output: SchedulerOutput, before: BeforeStep) -> None:
        self.finished_reported.update(output.finished_request_ids)
        sched = self.scheduler
        assert output.num_batched_tokens <= sched.config.max_num_batched_tokens
        assert all(s.num_scheduled_tokens <= before.share for s in output.scheduled), "a chunk over its share"
        under_way = self.under_way(output)
        started = {s.request_id for s in output.scheduled if s.request_id in before.lacking}
        self.long |= {rid for rid in started & under_way if before.lacking[rid] > self.threshold}
        self.long &= under_way
        assert len(under_way) <= self.limits.max_num_partial_prefills, f"{len(under_way)} prefills under way"
        assert len(self.long) <= self.limits.max_long_partial_prefills, f"{sorted(self.long)}: too many long ones"
        self.check_aging(before.waiting, started)
        check_pool(sched.kv_manager.pool, sched.kv_manager.block_tables, "device")

    def under_way(self, output: SchedulerOutput) -> set[str]:
        """Running requests still short of their prompt after this step (an unscheduled decode lacks one token)."""
        scheduled = {s.request_id: s for s in output.scheduled}
        partial = set()
        for request in self.scheduler.running:
            item = scheduled.get(request.request_id)
            lacking = request.num_tokens - request.num_computed_tokens
            if (item is not None and not item.samples_token) or (item is None and lacking > 1):
                partial.add(request.request_id)
        return partial

    def check_aging(self, waiting_before: list[str], started: set[str]) -> None:
        for index, request_id in enumerate(waiting_before):
            if request_id in started:
                continue
            if any(later in started for later in waiting_before[index + 1:]):
                self.overtaken[request_id] += 1
                assert self.overtaken[request_id] <= PREFILL_AGING_STEPS, f"{request_id} overtaken past the bound"

    def at_end(self) -> None:
        self.collect_last_finishes()
        self.check_reported_once()
        assert self.scheduler.kv_manager.num_free_blocks == self.scheduler.kv_manager.num_blocks
        for request in self.all_requests.values():
            self.check_output(request)


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads(max_requests=10, max_prompt_len=96), limits())
def test_partial_prefills_keep_their_caps_and_the_aging_bound(workload: Workload, lim: Limits) -> None:
    PrefillDriver(workload, lim).run()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads(max_block_size=4, max_blocks=8, max_requests=8, max_arrival_step=3, max_prompt_len=6), limits())
def test_tight_pools_preempt_and_the_caps_still_hold(workload: Workload, lim: Limits) -> None:
    PrefillDriver(workload, lim).run()


@st.composite
def crowds(draw: st.DrawFn) -> Workload:
    """Many prompts at once into a roomy pool and a small budget: the prefill caps, not memory, decide."""
    prompt = st.integers(2, 40)
    requests = draw(st.lists(st.builds(spec, prompt, st.integers(0, 2), st.integers(1, 4)), min_size=4, max_size=10))
    return Workload(num_blocks=draw(st.integers(64, 96)), block_size=draw(st.integers(1, 4)), watermark=0.0,
                    max_num_seqs=draw(st.integers(4, 8)), max_num_batched_tokens=draw(st.integers(4, 24)),
                    max_model_len=64, vocab=1000, requests=tuple(requests), aborts=())


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(crowds(), limits())
def test_crowds_of_prompts_keep_the_caps(workload: Workload, lim: Limits) -> None:
    PrefillDriver(workload, lim).run()


def spec(prompt_len: int, arrival_step: int, max_tokens: int = 2) -> RequestSpec:
    return RequestSpec(prompt_len, max_tokens, arrival_step, use_eos=False, ignore_eos=False, stop_token_ids=())


def long_then_shorts() -> Workload:
    """Two long prompts, then a short one arriving every step."""
    requests = (spec(90, 0), spec(90, 0), *(spec(2, step) for step in range(40)))
    return Workload(num_blocks=64, block_size=4, watermark=0.0, max_num_seqs=8, max_num_batched_tokens=8,
                    max_model_len=128, vocab=1000, requests=requests, aborts=())


def test_the_aging_bound_fails_without_aging(monkeypatch: pytest.MonkeyPatch) -> None:
    """The second long prompt waits for the first's place; without aging, the stream of short ones keeps
    overtaking it for as long as the first takes (90 tokens at 4 a step)."""
    lim = Limits(2, 1, 16, "recompute")
    PrefillDriver(long_then_shorts(), lim).run()
    monkeypatch.setattr("conveyor.core.scheduler.prefill.PREFILL_AGING_STEPS", 10**9)
    with pytest.raises(AssertionError, match="overtaken past the bound"):
        PrefillDriver(long_then_shorts(), lim).run()


def first_token_steps(scheduler: Scheduler, prompts: dict[str, int]) -> dict[str, int]:
    h = Harness(scheduler)
    for name, length in prompts.items():
        h.add(name, length, max_tokens=2, ignore_eos=True)
    firsts: dict[str, int] = {}
    for index, output in enumerate(h.run_to_end()):
        for item in output.scheduled:
            if item.samples_token:
                firsts.setdefault(item.request_id, index)
    return firsts


def test_short_prompts_behind_a_long_one_get_their_first_token_at_once() -> None:
    """One 400-token prompt ahead of five short ones, a budget of 64: computed one prompt at a time, the short
    ones wait for the long one's seven steps; with four partial prefills, they are done in the first step,
    and the long prompt takes its share (16 tokens) every step, alone too: 25 steps, each a quarter as long."""
    prompts = {"long": 400, **{f"short-{i}": 8 for i in range(5)}}

    def scheduler(**limits: int) -> Scheduler:
        kv = PagedKVCacheManager(256, 4)
        return Scheduler(SchedulerConfig(8, 64, 512, **limits), kv, clock=FakeClock())

    one_at_a_time = first_token_steps(scheduler(), prompts)
    side_by_side = first_token_steps(scheduler(max_num_partial_prefills=4, long_prefill_token_threshold=100),
                                     prompts)
    assert min(one_at_a_time[f"short-{i}"] for i in range(5)) >= 6
    assert max(side_by_side[f"short-{i}"] for i in range(5)) == 0
    assert side_by_side["long"] == 400 // 16 - 1, "16 tokens a step, never the whole budget"

