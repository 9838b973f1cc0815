"""Property tests of the grouped KV manager (conveyor/core/kv/grouped.py) under the continuous scheduler.

Random workloads (``tests/harness.py``) run on random layer patterns (Mistral's one windowed group, Gemma's
windowed and full groups, two windows side by side), block sizes and windows, with preemption by recompute
and by swap. Around every step the driver checks what the manager promises:

- no block a windowed layer still needs is given back: each scheduled request's every group holds, at the
  step's start ``s``, live blocks from ``(s - window + 1) // block_size`` on, and a shadow of what each block
  holds (request, group, logical block), moved with the swap pairs, finds each one still holding that
  request's K/V;
- every block given back is really behind the window: the NULL entries are exactly the blocks wholly before
  position ``s - window + 1``, and a full group has none;
- usage is bounded: a windowed group holds at most ``ceil((window - 1 + C) / block_size) + 1`` blocks of a
  request computing ``C`` tokens in the step, and ``ceil((window - 1) / block_size) + 1`` after it;
- the pools stay whole (one owner per block, none lost), and every request ends with a lone run's output.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conveyor.core.config import EngineConfig
from conveyor.core.engine_core import plan_kv_cache
from conveyor.core.kv import (
    NULL_BLOCK,
    GroupedKVCacheManager,
    KVGroup,
    KVLayout,
    blocks_for_tokens,
    kv_layout,
)
from conveyor.core.model_config import ModelConfig
from conveyor.core.request import Request, RequestStatus
from conveyor.core.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from conveyor.sim.cost import CostModel
from conveyor.sim.hardware import load_hardware
from conveyor.sim.simulator import Simulation
from conveyor.sim.workload import WorkloadRequest
from tests.harness import FakeClock, FakeExecutor, StepDriver, Workload, check_pool, copy_block, make_request, workloads

# Layer patterns, by the window of each layer ("w", "v": two windows; None: full attention).
PATTERNS = (("w", "w"), ("w", None, "w"), ("w",) * 5 + (None,), ("w", None), ("w", "v", None, "v"))


class WindowDriver(StepDriver):
    """Runs a workload through the scheduler over a grouped manager, checking the windows around each step."""

    def __init__(self, workload: Workload, windows: list[int | None], swap: bool) -> None:
        max_model_len = workload.max_model_len
        self.layout = kv_layout(windows, len(windows), max_model_len + 1)
        groups = self.layout.num_groups
        kv = GroupedKVCacheManager(workload.num_blocks * groups, workload.block_size, self.layout,
                                   workload.watermark, num_cpu_blocks=(workload.num_blocks * groups) if swap else 0)
        config = SchedulerConfig(workload.max_num_seqs, workload.max_num_batched_tokens, max_model_len,
                                 preemption_mode="swap" if swap else "recompute")
        super().__init__(workload, Scheduler(config, kv, clock=FakeClock()), max_steps=20_000, swap_aware=swap)
        self.kv = kv
        self.device: dict[int, tuple[str, int, int]] = {}  # block -> (request, group, logical block) it holds
        self.cpu: dict[int, tuple[str, int, int]] = {}

    def after_schedule(self, output: SchedulerOutput, before: object) -> None:
        self.finished_reported.update(output.finished_request_ids)
        for cpu, device in output.blocks_to_swap_in:  # the executor's order: swap-ins first
            copy_block(self.cpu, cpu, self.device, device)
        for device, cpu in output.blocks_to_swap_out:
            copy_block(self.device, device, self.cpu, cpu)
        for item in output.scheduled:
            tables = item.group_block_ids or (item.block_ids,)
            assert len(tables) == self.layout.num_groups
            for group, (table, window) in enumerate(zip(tables, self.layout.windows)):
                self.check_table(item.request_id, group, table, window, item.start_position, item.context_len)
        self.check_pools()

    def check_table(self, request_id: str, group: int, table: list[int], window: int | None, start: int,
                    end: int) -> None:
        bs = self.workload.block_size
        behind = 0 if window is None else max(0, (start - window + 1) // bs)  # blocks wholly before the window
        assert len(table) == blocks_for_tokens(end, bs), f"{request_id}/{group}: table of {len(table)} blocks"
        assert table[:behind] == [NULL_BLOCK] * behind, f"{request_id}/{group}: a block behind the window kept"
        assert NULL_BLOCK not in table[behind:], f"{request_id}/{group}: a block the window needs given back"
        if window is not None:
            assert len(table) - behind <= blocks_for_tokens(window - 1 + end - start, bs) + 1, "over the bound"
        for index in range(behind, blocks_for_tokens(start, bs)):  # read by this step: still this request's
            held = self.device.get(table[index])
            assert held == (request_id, group, index), f"{request_id}/{group} block {index} holds {held}"
        for index in range(start // bs, len(table)):  # written by this step
            self.device[table[index]] = (request_id, group, index)

    def after_update(self, output: SchedulerOutput, returned: list[Request]) -> None:
        """Between steps every running request's windowed groups hold no more than a window's blocks."""
        bs = self.workload.block_size
        for request in self.scheduler.running:
            tables = self.kv.group_block_ids(request.request_id)
            for table, window in zip(tables, self.layout.windows):
                live = sum(block != NULL_BLOCK for block in table)
                if window is not None:
                    assert live <= blocks_for_tokens(window - 1, bs) + 1, f"{request.request_id}: {live} blocks"
        self.check_pools()

    def after_abort(self, request_id: str) -> None:
        assert request_id not in self.kv.group_tables and request_id not in self.kv.cpu_group_tables
        self.check_pools()

    def check_pools(self) -> None:
        kv = self.kv
        live = {f"{rid}/{g}": [b for b in t if b != NULL_BLOCK] for rid, ts in kv.group_tables.items()
                for g, t in enumerate(ts)}
        check_pool(kv.pool, live, "device")
        cpu = {f"{rid}/{g}": [b for b in t if b != NULL_BLOCK] for rid, ts in kv.cpu_group_tables.items()
               for g, t in enumerate(ts)}
        check_pool(kv.cpu_pool, cpu, "cpu")
        on_device = {r.request_id for r in self.scheduler.running}
        assert set(kv.group_tables) == on_device, "only running requests hold device blocks"
        swapped = {r.request_id for r in self.scheduler.swapped}
        assert set(kv.cpu_group_tables) == swapped, "only swapped requests hold CPU blocks"

    def at_end(self) -> None:
        self.collect_last_finishes()
        self.check_reported_once()
        for request in self.all_requests.values():
            assert request.status is RequestStatus.FINISHED
            self.check_output(request)
        assert self.kv.pool.num_free == self.kv.pool.num_blocks, "blocks left held after the last request"


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads(max_blocks=16, max_prompt_len=80), st.sampled_from(PATTERNS), st.integers(1, 24),
       st.integers(1, 40), st.booleans())
def test_windowed_groups_keep_what_the_window_needs_and_free_the_rest(workload, pattern, window, other, swap):
    windows = [{"w": window, "v": other}.get(kind) for kind in pattern]
    WindowDriver(workload, windows, swap).run()


def test_a_long_request_gives_back_what_its_window_has_passed():
    """A request far past a window of 8 holds its whole context in the full group, 3 blocks in the windowed one,
    and the pool counts both (the case the property test's bound is about)."""
    layout = KVLayout((KVGroup(None, (1,)), KVGroup(8, (0,))))
    kv = GroupedKVCacheManager(64, 4, layout, watermark=0.0)
    scheduler = Scheduler(SchedulerConfig(4, 64, 120), kv, clock=FakeClock())
    request = make_request("r", 40, arrival=0.0, max_tokens=40)
    executor = FakeExecutor()
    executor.prompts["r"] = request.prompt_token_ids
    scheduler.add_request(request)
    for _ in range(30):
        output = scheduler.schedule()
        scheduler.update(output, executor.execute(output))
    full, windowed = kv.group_block_ids("r")
    assert request.num_computed_tokens == 69
    assert NULL_BLOCK not in full and len(full) == blocks_for_tokens(69, 4)
    assert windowed[:15] == [NULL_BLOCK] * 15 and NULL_BLOCK not in windowed[15:]  # (69 - 8 + 1) // 4 = 15
    assert kv.pool.num_free == 64 - len(full) - (len(windowed) - 15)
    report = kv.memory_report()
    assert report.used_slots == 69 + (69 - 15 * 4)


GEMMA3_270M_WINDOWS = tuple(None if (layer + 1) % 6 == 0 else 512 for layer in range(18))


def test_gemma3_270m_layers_make_six_groups_of_three():
    layout = kv_layout(GEMMA3_270M_WINDOWS, 18, 4064)
    assert (layout.num_groups, layout.layers_per_group) == (6, 3)
    assert layout.groups[0] == KVGroup(None, (5, 11, 17))
    assert layout.windows[1:] == (512,) * 5
    assert sorted(layer for group in layout.groups for layer in group.layers) == list(range(18))
    assert layout.layer_slots()[11] == (0, 1) and layout.layer_slots()[4] == (2, 1)
    assert kv_layout(GEMMA3_270M_WINDOWS, 18, 512) == KVLayout.single(18), "a window no sequence passes"


def test_the_plan_keeps_the_pool_bytes_in_blocks_of_one_group():
    grouped = plan_kv_cache(EngineConfig(num_kv_blocks=100, enable_prefix_caching=False, max_model_len=1024),
                            36864, 32768, GEMMA3_270M_WINDOWS)
    one = plan_kv_cache(EngineConfig(num_kv_blocks=100, max_model_len=1024), 36864, 32768, GEMMA3_270M_WINDOWS)
    assert one.layout is None, "prefix caching on: every layer keeps every block"
    assert grouped.layout is not None and grouped.num_blocks == 600
    assert grouped.num_blocks * grouped.block_bytes == one.num_blocks * one.block_bytes
    assert grouped.max_model_len == one.max_model_len == 1024


def test_the_simulator_predicts_the_capacity_gain():
    """The simulator runs the grouped manager: a pool that holds 4 long requests with every layer's blocks holds
    over three times as many once the windowed groups give back what their window passed."""
    model = ModelConfig.from_hf_dict(dict(
        model_type="gemma3_text", vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=18,
        num_attention_heads=4, num_key_value_heads=1, head_dim=64, sliding_window=512, max_position_embeddings=8192))
    cost = CostModel(model, load_hardware("A100-80GB"), "float32")
    pool = 4 * blocks_for_tokens(4064, 16) * 16 * cost.kv_bytes_per_token
    workload = [WorkloadRequest(0.0, 4000, 64) for _ in range(24)]
    peaks = {}
    for caching in (False, True):
        config = EngineConfig(kv_cache_memory=pool, max_model_len=4064, enable_prefix_caching=caching)
        peaks[caching] = Simulation(config, cost, workload).run()["peak_running"]
    # A request at 4064 tokens: 254 blocks in the full group, at most 33 in each of the 5 windowed ones.
    assert peaks[True] == 4 and peaks[False] >= 3 * peaks[True], peaks
