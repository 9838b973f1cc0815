"""Multi-step scheduling (``num_scheduler_steps``): one decision, several model steps, the same tokens.

The scheduler allocates the window's KV slots ahead and hands each request
the number of steps it may run; the engine core feeds an executor that runs
one step per call the token it just drew. Whatever the window, every request
must end with exactly the output that single steps give it.
"""

from __future__ import annotations

import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conveyor import LLM, SamplingParams
from conveyor.engine_core import execute_step_by_step
from conveyor.kv import PagedKVCacheManager
from conveyor.scheduler import Scheduler, SchedulerConfig
from tests.test_scheduler import (
    FakeClock,
    FakeExecutor,
    Workload,
    hashed_token,
    reference_output,
    request_from_spec,
    workloads,
)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads(), st.integers(2, 6))
def test_windows_give_every_request_its_lone_run_output_and_free_every_block(workload: Workload, steps: int):
    kv = PagedKVCacheManager(workload.num_blocks, workload.block_size, workload.watermark)
    config = SchedulerConfig(workload.max_num_seqs, workload.max_num_batched_tokens, workload.max_model_len,
                             num_scheduler_steps=steps)
    scheduler = Scheduler(config, kv, clock=FakeClock())
    executor = FakeExecutor(lambda rid, pos: hashed_token(rid, pos, workload.vocab))
    pending = sorted(range(len(workload.requests)), key=lambda i: workload.requests[i].arrival_step)
    requests, step = {}, 0
    while pending or scheduler.has_unfinished_requests():
        while pending and workload.requests[pending[0]].arrival_step <= step:
            index = pending.pop(0)
            request = request_from_spec(workload.requests[index], f"r{index}", arrival=float(index))
            requests[request.request_id] = request
            executor.prompts[request.request_id] = request.prompt_token_ids
            scheduler.add_request(request)
        output = scheduler.schedule()
        for item in output.scheduled:
            assert 1 <= item.num_steps <= steps and (item.sample or item.num_steps == 1)
            assert item.context_len + item.num_steps - 1 <= len(item.block_ids) * workload.block_size
            assert item.context_len + item.num_steps - 1 < workload.max_model_len or item.num_steps == 1
        scheduler.update(output, execute_step_by_step(executor, output))
        step += 1
        assert step < 5000, "the scheduler did not drain the workload"
    for request in requests.values():
        tokens, reason, stop_reason = reference_output(request, workload.max_model_len, executor.token_fn)
        assert (request.output_token_ids, request.finish_reason, request.stop_reason) == (tokens, reason, stop_reason)
    assert kv.num_free_blocks == workload.num_blocks and not kv.block_tables


def _workload(seed: int):
    rng = random.Random(seed)
    prompts = [[rng.randrange(1000, 40000) for _ in range(rng.randrange(2, 50))] for _ in range(10)]
    params = [SamplingParams(temperature=0.0, max_tokens=rng.randrange(2, 30), ignore_eos=True) for _ in prompts]
    return prompts, params


def test_the_real_engine_gives_the_same_tokens_and_text_in_fewer_steps(tiny_model_dir):
    prompts, params = _workload(seed=5)
    reference = LLM(str(tiny_model_dir), num_kv_blocks=1024).generate(prompts, params, use_tqdm=False)
    # A stop token inside a window: the tokens drawn after it are dropped.
    cut = reference[0].token_ids[3]
    params[0] = SamplingParams(temperature=0.0, max_tokens=params[0].max_tokens, ignore_eos=True,
                               stop_token_ids=(cut,))
    expected_first = reference[0].token_ids[: reference[0].token_ids.index(cut) + 1]
    # 20 blocks of 4 cannot hold every growing request: windows meet preemption.
    llm = LLM(str(tiny_model_dir), num_kv_blocks=20, block_size=4, max_model_len=80, max_num_seqs=4,
              num_scheduler_steps=4)
    trace = llm.engine.start_trace()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert outputs[0].token_ids == expected_first and outputs[0].finish_reason == "stop"
    assert [o.token_ids for o in outputs[1:]] == [r.token_ids for r in reference[1:]]
    assert [o.text for o in outputs[1:]] == [r.text for r in reference[1:]]
    assert llm.engine.scheduler.num_preemptions > 0
    kv = llm.engine.kv_manager
    assert kv.num_free_blocks == kv.num_blocks
    single = LLM(str(tiny_model_dir), num_kv_blocks=20, block_size=4, max_model_len=80, max_num_seqs=4)
    single_trace = single.engine.start_trace()
    single.generate(prompts, params, use_tqdm=False)
    assert len(trace.steps) * 2 < len(single_trace.steps)
