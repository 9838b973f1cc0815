"""Priority scheduling: lower value first; a more important arrival preempts less important running requests."""

from __future__ import annotations

from tests.harness import Harness, make_scheduler


def priority_harness(num_blocks: int, block_size: int, max_num_seqs: int = 8) -> Harness:
    return Harness(make_scheduler(num_blocks, block_size, max_num_seqs=max_num_seqs, policy="priority"))


def add(h: Harness, request_id: str, prompt_len: int, priority: int, max_tokens: int = 8):
    return h.add(request_id, prompt_len, max_tokens=max_tokens, ignore_eos=True, priority=priority)


def test_waiting_requests_are_admitted_in_priority_order():
    h = priority_harness(num_blocks=64, block_size=4, max_num_seqs=1)
    for name, priority in [("low", 5), ("mid", 1), ("high", 0)]:
        add(h, name, 4, priority, max_tokens=2)
    first_seen = []
    for output in h.run_to_end():
        first_seen += [s.request_id for s in output.scheduled if s.request_id not in first_seen]
    assert first_seen == ["high", "mid", "low"]


def test_important_arrival_preempts_the_least_important_running_request():
    """Memory full of low-priority work: the urgent request gets its first token before the waiting low ones."""
    h = priority_harness(num_blocks=8, block_size=4)
    # 6 prompt + 3 output tokens need 8 KV slots (the last token is never fed back): 2 blocks each, pool full.
    low = [add(h, f"low-{i}", 6, priority=5, max_tokens=3) for i in range(4)]
    h.step()
    assert {r.request_id for r in h.scheduler.running} == {"low-0", "low-1", "low-2", "low-3"}
    add(h, "extra-low", 4, priority=5)
    urgent = add(h, "urgent", 6, priority=0, max_tokens=3)
    outputs = h.run_to_end()
    assert urgent.num_output_tokens == 3
    preempted = [i for o in outputs for i in o.preempted_request_ids]
    assert preempted and all(i.startswith("low") for i in preempted)
    assert preempted[0] == "low-3", "the least important, most recent running request goes first"
    first_token = {}
    for index, output in enumerate(outputs):
        for s in output.scheduled:
            if s.samples_token:
                first_token.setdefault(s.request_id, index)
    assert first_token["urgent"] < first_token["extra-low"]
    assert all(r.num_output_tokens == 3 for r in low), "low-priority requests still all finish"
    assert sum(r.num_preemptions for r in low) == len(preempted)


def test_equal_priority_never_preempts():
    h = priority_harness(num_blocks=8, block_size=4)
    for i in range(4):
        add(h, f"a-{i}", 6, priority=1, max_tokens=3)
    h.step()
    add(h, "same", 6, priority=1, max_tokens=3)
    output = h.step()
    assert output.preempted_request_ids == []
    assert "same" not in {s.request_id for s in output.scheduled}


def test_a_request_preempted_in_the_same_step_it_was_scheduled_gives_back_its_tokens():
    """The victim had been given tokens earlier in the step; they leave the step's output with it."""
    h = priority_harness(num_blocks=4, block_size=4)
    add(h, "low", 12, priority=3, max_tokens=8)
    h.step()
    add(h, "urgent", 12, priority=0, max_tokens=2)
    output = h.step()
    assert output.preempted_request_ids == ["low"]
    assert [s.request_id for s in output.scheduled] == ["urgent"]
    assert output.num_batched_tokens <= 64
    h.run_to_end()


def test_thrash_guard_spares_a_victim_the_same_request_preempted_last_step():
    h = priority_harness(num_blocks=8, block_size=4)
    victims = [add(h, f"low-{i}", 6, priority=5, max_tokens=3) for i in range(4)]
    h.step()
    add(h, "urgent", 6, priority=0, max_tokens=3)
    # As if "urgent" had preempted low-3 in the previous step and it had come straight back.
    victims[-1].last_preempted_by = ("urgent", h.scheduler.step_index - 1)
    output = h.step()
    assert output.preempted_request_ids == []
    output = h.step()  # a step later the guard no longer applies
    assert output.preempted_request_ids == ["low-3"]


def test_no_preemption_that_would_not_seat_the_newcomer():
    """Preempting every less important request would still leave the newcomer short: nobody is preempted.

    The pool is full: "high" (priority 0) holds 6 blocks, "low" (priority 5) 2. "urgent" (priority 1) needs 4;
    preempting "low" frees only 2, and "high" ranks above it, so preempting "low" would be for nothing.
    """
    h = priority_harness(num_blocks=8, block_size=4)
    high = add(h, "high", 22, priority=0, max_tokens=2)
    low = add(h, "low", 6, priority=5, max_tokens=6)
    h.step()
    assert h.scheduler.kv_manager.num_free_blocks == 0
    add(h, "urgent", 14, priority=1, max_tokens=2)
    output = h.step()
    assert output.preempted_request_ids == [] and low.num_preemptions == 0
    assert "urgent" not in {s.request_id for s in output.scheduled}
    outputs = h.run_to_end()
    assert all(not o.preempted_request_ids for o in outputs)
    assert high.num_output_tokens == 2 and low.num_output_tokens == 6


def test_the_fewest_victims_that_seat_the_newcomer_are_preempted_in_one_step():
    h = priority_harness(num_blocks=8, block_size=4)
    lows = [add(h, f"low-{i}", 6, priority=5 - i, max_tokens=2) for i in range(4)]  # 2 blocks each, pool full
    h.step()
    add(h, "urgent", 14, priority=0, max_tokens=2)  # needs 4 blocks: two victims
    output = h.step()
    assert output.preempted_request_ids == ["low-0", "low-1"], "least important first, and no more than needed"
    assert "urgent" in {s.request_id for s in output.scheduled}
    h.run_to_end()
    assert all(r.num_output_tokens == 2 for r in lows)


def test_a_more_important_waiting_request_goes_before_a_swapped_one():
    """Swap mode: "low" is swapped out; "mid" (more important) then waits beside it. When room comes back,
    "mid" is admitted first; "low" resumes only after."""
    from tests.harness import SwapAwareExecutor

    scheduler = make_scheduler(4, 4, max_num_seqs=8, policy="priority", preemption_mode="swap", num_cpu_blocks=8)
    h = Harness(scheduler, SwapAwareExecutor(scheduler))
    add(h, "first", 6, priority=0, max_tokens=6)
    low = add(h, "low", 6, priority=5, max_tokens=6)
    while not (output := h.step()).preempted_request_ids:
        pass
    assert output.preempted_request_ids == ["low"] and low.status.value == "swapped"
    add(h, "mid", 6, priority=1, max_tokens=6)
    outputs = h.run_to_end()
    mid_admitted = next(i for i, o in enumerate(outputs) if "mid" in {s.request_id for s in o.scheduled})
    low_resumed = next(i for i, o in enumerate(outputs) if o.blocks_to_swap_in)
    assert mid_admitted < low_resumed
    assert low.num_output_tokens == 6
