"""The live dashboard's data: block-table changes in step records, the recorder's deltas, rate limiting, merging."""

from __future__ import annotations

import random

import pytest

from conveyor.core.config import EngineConfig
from conveyor.core.engine_core import EngineCore, KVCachePlan
from conveyor.observe.live import MAX_PENDING_STEPS, delta_as_json_ready, merge_deltas, start_live
from conveyor.observe.trace import start_trace
from tests.harness import FakeClock, make_request


def make_core(num_blocks: int = 24, block_size: int = 4, num_cpu_blocks: int = 0, **options) -> EngineCore:
    config = EngineConfig(num_kv_blocks=num_blocks, block_size=block_size, **options)
    plan = KVCachePlan(num_blocks, num_cpu_blocks, block_bytes=1, max_model_len=num_blocks * block_size)
    return EngineCore(config, plan, TokenExecutor(), clock=FakeClock())


class TokenExecutor:
    """Plays the model: one fixed token per sampling chunk (these tests look at bookkeeping, not at tokens)."""

    def execute(self, output):
        return {item.request_id: 7 for item in output.scheduled if item.samples_token}


def add(core: EngineCore, request_id: str, prompt_len: int, max_tokens: int, text: str | None = None,
        prompt: list[int] | None = None):
    request = make_request(request_id, prompt_len, arrival=float(len(core.scheduler.requests)), max_tokens=max_tokens,
                           ignore_eos=True)
    request.prompt_text = text
    if prompt is not None:  # the same prompt as another request: prefix caching shares its blocks
        request.prompt_token_ids = list(prompt)
    core.add_request(request)
    return request


def apply_table_changes(tables: dict[str, list[int]], changes: dict[str, list[int]]) -> None:
    """What a reader does with ``StepRecord.kv_blocks``: cut each table at the index given, append the rest."""
    for request_id, (start, *blocks) in changes.items():
        table = tables.get(request_id, [])[:start] + blocks
        if table:
            tables[request_id] = table
        else:
            tables.pop(request_id, None)


@pytest.mark.parametrize("options", [
    dict(enable_prefix_caching=False),
    dict(enable_prefix_caching=True),
    dict(enable_prefix_caching=False, preemption_mode="swap"),
    dict(kv_layout="contiguous", max_model_len=24),
])
def test_replaying_kv_blocks_rebuilds_every_table_at_every_step(options) -> None:
    """Under preemption (recompute and swap), prefix sharing, aborts and contiguous slabs."""
    num_cpu = 64 if options.get("preemption_mode") == "swap" else 0
    core = make_core(num_blocks=12, num_cpu_blocks=num_cpu, **options)
    trace = start_trace(core)
    rng = random.Random(3)
    tables: dict[str, list[int]] = {}
    shared = list(range(3000, 3010))
    for i in range(60):
        if i < 40 and rng.random() < 0.6:
            prompt = shared if rng.random() < 0.3 else None
            add(core, f"r{i}", rng.randrange(1, 14), rng.randrange(1, 12), prompt=prompt)
        if i % 7 == 3 and core.scheduler.running:
            core.abort_request(core.scheduler.running[0].request_id)
        if core.has_unfinished_requests():
            core.step()
            apply_table_changes(tables, trace.steps[-1].kv_blocks)
            assert tables == {r: t for r, t in core.scheduler.kv_manager.block_tables.items() if t}
    assert any(step.preempted for step in trace.steps) or options.get("kv_layout") == "contiguous"
    if options.get("enable_prefix_caching"):
        assert any(step.kv_shared_slots for step in trace.steps)


def test_a_delta_holds_only_what_changed_and_finished_requests_leave() -> None:
    core = make_core(num_blocks=64, enable_prefix_caching=False, max_num_seqs=2)
    live = start_live(core)
    for i in range(5):
        add(core, f"r{i}", 4, max_tokens=3 if i == 0 else 50)
    first = live.flush()
    assert set(first["requests"]) == {f"r{i}" for i in range(5)}  # all were added
    core.step()  # admits r0 and r1; r2..r4 wait, unchanged
    delta = live.flush()
    assert set(delta["requests"]) == {"r0", "r1"} and [s.step for s in delta["steps"]] == [1]
    assert delta["requests"]["r0"]["status"] == "running" and delta["requests"]["r0"]["computed"] == 4
    core.step(), core.step(), core.step()
    delta = live.flush()
    assert "r0" in delta["removed"] and [s.step for s in delta["steps"]] == [2, 3, 4]  # coalesced
    assert [s.kv_blocks["r0"] for s in delta["steps"] if "r0" in s.kv_blocks][-1] == [0]  # its blocks returned
    assert set(delta["requests"]) <= {"r1", "r2"}  # r2 joined when r0 left; r3 and r4 untouched
    assert delta["stats"]["num_running"] == 2 and delta["window"]["finished"] == 1


def test_keyframe_plus_deltas_equals_a_later_keyframe() -> None:
    """A watcher that joined mid-run, and one whose unread deltas were merged, both end where the engine is."""
    core = make_core(num_blocks=32, enable_prefix_caching=True, max_num_seqs=4)
    live = start_live(core)
    rng = random.Random(1)
    for i in range(6):
        add(core, f"a{i}", rng.randrange(2, 10), rng.randrange(2, 20))
    for _ in range(3):
        core.step()
    view = live.keyframe()
    merged = live.flush()
    for i in range(30):
        if i < 10:
            add(core, f"b{i}", rng.randrange(2, 10), rng.randrange(2, 20))
        core.step()
        assert merge_deltas(merged, live.flush())
    assert_view_matches(view, merged, live.keyframe())


def assert_view_matches(keyframe: dict, delta: dict, later: dict) -> None:
    tables = {r: t[1:] for r, t in keyframe["tables"].items()}
    for step in delta["steps"]:
        if step.step > keyframe["tables_step"]:
            apply_table_changes(tables, step.kv_blocks)
    rows = {r: row for r, row in keyframe["requests"].items() if r not in delta["removed"]} | delta["requests"]
    assert rows == later["requests"]
    assert tables == {r: t[1:] for r, t in later["tables"].items()}


def test_an_abort_between_steps_releases_its_table_in_the_next_delta() -> None:
    core = make_core(num_blocks=32, enable_prefix_caching=False)
    live = start_live(core)
    add(core, "a", 6, 20)
    add(core, "b", 6, 20)
    core.step()
    live.flush()
    core.abort_request("a")  # the engine goes idle for "a": no step records its release
    delta = live.flush()
    assert delta["removed"] == ["a"] and delta["kv_released"] == ["a"]
    assert set(live.keyframe()["tables"]) == {"b"}
    core.abort_request("b")
    add(core, "c", 6, 20)
    core.step()  # this step's record releases "b" itself (it ended since the previous step)
    delta = live.flush()
    assert delta["steps"][-1].kv_blocks["b"] == [0] and delta["kv_released"] == []


def test_rate_limit_allows_one_delta_per_interval() -> None:
    core = make_core()
    now = [0.0]
    core.clock = core.scheduler.clock = lambda: now[0]
    live = start_live(core, min_interval=0.1)
    assert not live.due()  # nothing to send
    add(core, "r", 4, 30)
    assert live.due()
    live.flush()
    for _ in range(5):
        now[0] += 0.01
        core.step()
        assert not live.due() and live.has_pending()  # within the interval: held back, coalesced
    now[0] += 0.06
    assert live.due()
    assert len(live.flush()["steps"]) == 5


def test_a_finished_requests_full_blocks_stay_cached_and_evictable() -> None:
    core = make_core(num_blocks=16, block_size=4, enable_prefix_caching=True)
    live = start_live(core)
    add(core, "r", 9, max_tokens=2)  # 10 tokens computed: two full blocks get indexed
    while core.has_unfinished_requests():
        core.step()
    delta = live.flush()
    assert len(delta["evictable"]) == 2
    assert sorted(live.keyframe()["evictable"]) == sorted(delta["evictable"])


def test_rows_carry_no_prompt_text_unless_asked() -> None:
    for show_text, expected in ((False, None), (True, "hello")):
        core = make_core()
        live = start_live(core, show_text=show_text)
        add(core, "r", 4, 4, text="hello")
        assert live.flush()["requests"]["r"].get("text") == expected


def test_remaining_counts_to_the_models_length_where_that_comes_first() -> None:
    """The row's "remaining" is the scheduler's own stop rule: 10 tokens of 16 leave 6, not max_tokens' 50."""
    core = make_core(num_blocks=4)  # 4 blocks of 4: max_model_len 16
    live = start_live(core)
    add(core, "r", 10, 50)
    assert live.flush()["requests"]["r"]["remaining"] == 6
    steps = 0
    while core.scheduler.requests:
        core.step()
        steps += 1
    assert steps == 6  # the request ran exactly as many steps as the row said were left


def test_merging_stops_when_a_watcher_falls_too_far_behind() -> None:
    core = make_core(num_blocks=64)
    live = start_live(core)
    add(core, "r", 4, 50)
    core.step()
    pending = dict(live.flush())
    big = {**live.flush(), "steps": [object()] * MAX_PENDING_STEPS}
    assert not merge_deltas(pending, big)


def test_a_delta_is_json_ready() -> None:
    import json

    core = make_core()
    live = start_live(core)
    add(core, "r", 4, 4)
    core.step()
    encoded = json.loads(json.dumps(delta_as_json_ready(live.flush())))
    assert encoded["steps"][0]["scheduled"] == {"r": 4} and encoded["requests"]["r"]["prompt"] == 4


class DraftAcceptingExecutor(TokenExecutor):
    """Accepts the first of every request's drafts (speculative decoding's executor reports how many)."""

    def __init__(self) -> None:
        self.accepted_drafts: dict[str, int] = {}

    def execute(self, output):
        self.accepted_drafts = {s.request_id: 1 for s in output.scheduled if s.num_draft_tokens}
        return super().execute(output)


def test_steps_and_rows_show_the_drafts_a_request_carried_and_how_many_were_accepted() -> None:
    """With speculative decoding, a step's record names the drafts each request carried and how many were
    accepted (the timeline darkens those cells), and a request's row counts them (the table's drafts column)."""
    config = EngineConfig(num_kv_blocks=24, block_size=4,
                          speculative_config='{"method": "ngram", "prompt_lookup_min": 1, "draft_length": "fixed"}')
    plan = KVCachePlan(24, 0, block_bytes=1, max_model_len=96)
    core = EngineCore(config, plan, DraftAcceptingExecutor(), clock=FakeClock())
    live = start_live(core)
    add(core, "r", 6, 12, prompt=[7, 7, 7, 7, 7, 7])  # the executor's token repeats the prompt: drafts at once
    steps = []
    for _ in range(4):
        core.step()
        steps += live.flush()["steps"]
    drafted = [step for step in steps if step.drafts]
    assert drafted and all(step.accepted == dict.fromkeys(step.drafts, 1) for step in drafted)
    row = live.keyframe()["requests"]["r"]
    assert (row["drafted"], row["accepted"]) == (sum(s.drafts["r"] for s in drafted), len(drafted))
