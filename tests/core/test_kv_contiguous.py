"""Contiguous max-length reservation vs paged blocks: same tokens, different memory bills."""

from __future__ import annotations

import random

from conveyor import LLM, SamplingParams
from conveyor.core.kv import ContiguousKVCacheManager, PagedKVCacheManager
from conveyor.entrypoints.cli import main


def test_a_request_is_admitted_only_when_a_whole_slab_is_free():
    kv = ContiguousKVCacheManager(num_blocks=10, block_size=4, max_model_len=16)  # slab: 4 blocks
    assert kv.allocate_slots("a", 5) and kv.block_ids("a") == [0, 1, 2, 3]
    assert kv.allocate_slots("b", 1) and kv.block_ids("b") == [4, 5, 6, 7]
    assert kv.num_free_blocks == 2
    assert not kv.can_admit("c", 1) and not kv.allocate_slots("c", 1)
    assert kv.allocate_slots("a", 16) and kv.block_ids("a") == [0, 1, 2, 3], "a slab never grows"
    kv.free("a")
    assert kv.allocate_slots("c", 3) and kv.block_ids("c") == [0, 1, 2, 3]


def test_waste_and_fragmentation_match_a_hand_computed_case():
    kv = ContiguousKVCacheManager(num_blocks=10, block_size=4, max_model_len=16)
    kv.allocate_slots("a", 5)
    kv.allocate_slots("b", 2)
    report = kv.memory_report()
    # Two slabs of 16 slots hold 5 and 2 tokens: 32 reserved, 7 used, 25 wasted inside.
    assert (report.reserved_slots, report.used_slots, report.internal_waste_slots) == (32, 7, 25)
    # The last 2 free blocks (8 slots) can never take a 4-block slab.
    assert report.unusable_free_slots == 8
    kv.free("a")  # a 4-block hole opens at the front: usable again
    assert kv.memory_report().unusable_free_slots == 8
    paged = PagedKVCacheManager(num_blocks=10, block_size=4, watermark=0.0)
    paged.allocate_slots("a", 5)
    paged.allocate_slots("b", 2)
    report = paged.memory_report()
    assert (report.reserved_slots, report.used_slots, report.unusable_free_slots) == (12, 7, 0)


def _workload():
    rng = random.Random(31)
    prompts = [[rng.randrange(1000, 40000) for _ in range(rng.randrange(3, 40))] for _ in range(16)]
    params = [SamplingParams(temperature=0.0, max_tokens=rng.randrange(2, 30), ignore_eos=True) for _ in prompts]
    return prompts, params


def test_same_tokens_and_paged_runs_more_requests_in_the_same_memory(tiny_model_dir, tmp_path, capsys):
    prompts, params = _workload()
    runs = {}
    for layout in ("paged", "contiguous"):
        llm = LLM(str(tiny_model_dir), kv_layout=layout, num_kv_blocks=64, block_size=4, max_model_len=64)
        trace = llm.engine.start_trace()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        runs[layout] = ([o.token_ids for o in outputs], max(s.num_running for s in trace.steps), trace)
    assert runs["paged"][0] == runs["contiguous"][0]
    # 64 blocks hold four 16-block slabs; paged fits every request's actual need.
    assert runs["contiguous"][1] == 4
    assert runs["paged"][1] >= 2 * runs["contiguous"][1]
    contiguous_trace = runs["contiguous"][2]
    assert all(s.kv_reserved_slots == 64 * s.num_running for s in contiguous_trace.steps if s.num_running)
    paths = []
    for layout in ("contiguous", "paged"):
        runs[layout][2].write(tmp_path / f"{layout}.jsonl")
        paths.append(str(tmp_path / f"{layout}.jsonl"))
    assert main(["plot", "memory", *paths, "-o", str(tmp_path / "memory.png")]) == 0
    assert (tmp_path / "memory.png").stat().st_size > 10_000
    printed = capsys.readouterr().out
    assert "peak 4 running" in printed and f"peak {runs['paged'][1]} running" in printed
