"""Preemption by swap: a victim's KV goes to a CPU pool and comes back intact."""

from __future__ import annotations

import random

import pytest
import torch

from conveyor import LLM, SamplingParams
from conveyor.core.request import RequestStatus
from conveyor.core.scheduler.output import SchedulerOutput
from tests.harness import Harness, SwapAwareExecutor, make_scheduler


def swap_harness(num_blocks: int, block_size: int, num_cpu_blocks: int) -> Harness:
    scheduler = make_scheduler(num_blocks, block_size, num_cpu_blocks=num_cpu_blocks, preemption_mode="swap")
    return Harness(scheduler, SwapAwareExecutor(scheduler))


def test_swapped_request_keeps_its_progress_and_resumes_before_new_admissions():
    h = swap_harness(num_blocks=4, block_size=4, num_cpu_blocks=8)
    first = h.add("first", 6, max_tokens=6, ignore_eos=True)
    second = h.add("second", 6, max_tokens=6, ignore_eos=True)
    # Both fill 2 blocks each; when first needs a third, second (the later arrival) is swapped out.
    while not (output := h.step()).preempted_request_ids:
        pass
    assert output.preempted_request_ids == ["second"]
    assert len(output.blocks_to_swap_out) == 2 and second.status is RequestStatus.SWAPPED
    progress = second.num_computed_tokens
    assert progress == 8, "a swapped request keeps its computed tokens"
    h.add("late", 2, max_tokens=2, ignore_eos=True)
    outputs = h.run_to_end()
    resumed = next(i for i, o in enumerate(outputs) if o.blocks_to_swap_in)
    late_admitted = next(i for i, o in enumerate(outputs) if "late" in {s.request_id for s in o.scheduled})
    assert resumed <= late_admitted, "the swapped request comes back before a new one is admitted"
    # No recompute: after the swap-in, the request continues from where it stopped.
    [again] = [s for s in outputs[resumed].scheduled if s.request_id == "second"]
    assert again.start_position == progress and again.num_scheduled_tokens == 1
    assert first.num_output_tokens == second.num_output_tokens == 6
    assert h.scheduler.kv_manager.num_free_blocks == 4 and h.scheduler.kv_manager.num_free_cpu_blocks == 8


def test_full_swap_space_falls_back_to_recompute():
    h = swap_harness(num_blocks=4, block_size=4, num_cpu_blocks=1)
    h.add("first", 6, max_tokens=6, ignore_eos=True)
    second = h.add("second", 6, max_tokens=6, ignore_eos=True)
    while not (output := h.step()).preempted_request_ids:
        pass
    assert output.preempted_request_ids == ["second"] and output.blocks_to_swap_out == []
    assert second.status is RequestStatus.PREEMPTED and second.num_computed_tokens == 0
    assert h.scheduler.num_swap_fallbacks == 1
    h.run_to_end()
    assert second.num_output_tokens == 6


def test_swap_copies_are_bit_identical(tiny_model_dir):
    """KV copied out to CPU and back lands unchanged in the new device blocks."""
    llm = LLM(str(tiny_model_dir), num_kv_blocks=16, block_size=4, preemption_mode="swap", swap_space=10**6)
    executor = llm.engine.executor
    executor.kv_cache.normal_()
    original = executor.kv_cache[:, :, [3, 5, 7]].clone()
    executor.execute(SchedulerOutput(step=1, scheduled=[], blocks_to_swap_out=[(3, 0), (5, 1), (7, 2)]))
    executor.kv_cache[:, :, [3, 5, 7]] = 0.0  # the freed blocks get reused
    executor.execute(SchedulerOutput(step=2, scheduled=[], blocks_to_swap_in=[(0, 9), (1, 10), (2, 11)]))
    assert torch.equal(executor.kv_cache[:, :, [9, 10, 11]], original)


def _workload(seed: int):
    rng = random.Random(seed)
    prompts = [[rng.randrange(1000, 40000) for _ in range(rng.randrange(4, 60))] for _ in range(12)]
    params = [SamplingParams(temperature=0.0, max_tokens=rng.randrange(4, 40), ignore_eos=True) for _ in prompts]
    return prompts, params


@pytest.mark.parametrize("swap_space", [10**7, 30_000], ids=["roomy-swap", "swap-runs-out"])
def test_swap_gives_the_same_tokens_as_recompute(tiny_model_dir, swap_space):
    prompts, params = _workload(seed=21)
    reference = LLM(str(tiny_model_dir), num_kv_blocks=1024).generate(prompts, params, use_tqdm=False)
    llm = LLM(str(tiny_model_dir), num_kv_blocks=24, block_size=4, max_model_len=96,
              preemption_mode="swap", swap_space=swap_space)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in reference]
    stats = llm.engine.stats()
    assert stats.num_swaps_out > 0
    if swap_space == 30_000:
        assert stats.num_swap_fallbacks > 0
    assert stats.num_free_kv_blocks == stats.num_kv_blocks and stats.num_free_cpu_blocks == stats.num_cpu_blocks


def _swap_events(policy: str, seed: int) -> tuple[int, int]:
    """A random crowded workload in swap mode; (swap-ins followed by a swap-out of the same request within a
    step with no new arrival in between, preemptions)."""
    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 4])
    scheduler = make_scheduler(rng.randint(3, 12), block_size, num_cpu_blocks=64, preemption_mode="swap",
                               policy=policy, max_num_seqs=rng.randint(2, 6),
                               max_num_batched_tokens=rng.choice([4, 16, 64]))
    h = Harness(scheduler, SwapAwareExecutor(scheduler))
    arrivals = sorted(rng.randint(0, 10) for _ in range(rng.randint(2, 8)))
    pending = [(f"r{i}", rng.randint(1, 2 * block_size), rng.randint(2, 24), rng.randint(0, 3), step)
               for i, step in enumerate(arrivals)]
    step, last_arrival, resumed_at, ping_pongs = 0, -1, {}, 0
    while pending or scheduler.has_unfinished_requests():
        while pending and pending[0][4] <= step:
            request_id, prompt_len, max_tokens, priority, _ = pending.pop(0)
            h.add(request_id, prompt_len, max_tokens=max_tokens, ignore_eos=True, priority=priority)
            last_arrival = step
        swapped = {r.request_id for r in scheduler.swapped}
        output = h.step()
        step += 1
        for request_id in output.preempted_request_ids:
            since = resumed_at.get(request_id)
            ping_pongs += since is not None and step - since <= 1 and last_arrival < since
        for item in output.scheduled:
            if item.request_id in swapped:
                resumed_at[item.request_id] = step
        assert step < 5000
    return ping_pongs, scheduler.num_preemptions


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_no_swap_ping_pong(policy):
    """A request swapped back in is not swapped out again at the next step unless a new request arrived.

    It resumes only when it and the running batch have room to go on (their prompts and one more token each):
    before, a request could come back and be the next step's victim, over and over (on these 400 workloads:
    77 such round trips with fcfs, 130 with priority).
    """
    results = [_swap_events(policy, seed) for seed in range(400)]
    assert sum(ping_pongs for ping_pongs, _ in results) == 0
    assert sum(preemptions for _, preemptions in results) > 100, "the workloads do preempt"
