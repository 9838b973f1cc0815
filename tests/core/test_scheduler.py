"""Step-by-step tests of the continuous-batching scheduler against its contract.

The scheduler is driven the way the engine drives it (``schedule`` -> executor
-> ``update``) through ``tests/harness.py``'s ``Harness``, with a fake executor
that plays the model: it returns a token that depends only on the request and
the position, and it keeps its own idea of each request's KV cache so that a
chunk which does not continue where the previous one stopped, or which carries
the wrong token ids, is caught. Each test here pins one rule with exact
numbers: chunked prefill, preemption and its victims, admission limits,
aborts, and the stop rules. The same contract over random workloads is in
test_scheduler_properties.py.
"""

from __future__ import annotations

import pytest

from conveyor.core.kv import PagedKVCacheManager
from conveyor.core.request import FinishReason, Request, RequestStatus
from conveyor.core.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from tests.harness import EOS, FakeExecutor, Harness, TokenFn, make_request, make_scheduler, never_eos


def chunks(output: SchedulerOutput) -> list[tuple[str, int, int, bool]]:
    """(request_id, start_position, num_tokens, sample) per scheduled request: what a step did, at a glance."""
    return [(s.request_id, s.start_position, s.num_scheduled_tokens, s.samples_token) for s in output.scheduled]


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
