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
