"""Unit tests of the paged KV bookkeeping: BlockPool and PagedKVCacheManager.

The scheduler trusts these two classes for every memory decision, so each
rule they promise (whole-block growth, the admission watermark, frees that
return blocks at once) is pinned here with exact numbers.
"""

from __future__ import annotations

import pytest

from conveyor.core.kv import BlockPool, PagedKVCacheManager, blocks_for_tokens
from tests.harness import check_pool


def assert_conserved(kv: PagedKVCacheManager) -> None:
    """No block is lost or shared: free + owned is the whole pool, each id once."""
    check_pool(kv.pool, kv.block_tables, "device")
    assert kv.num_free_blocks + sum(len(table) for table in kv.block_tables.values()) == kv.num_blocks


# ----- blocks_for_tokens -----------------------------------------------------


@pytest.mark.parametrize(
    ("num_tokens", "block_size", "expected"),
    [(0, 4, 0), (1, 4, 1), (4, 4, 1), (5, 4, 2), (8, 4, 2), (9, 4, 3), (7, 1, 7), (16, 16, 1), (17, 16, 2)],
)
def test_blocks_for_tokens_rounds_up(num_tokens: int, block_size: int, expected: int) -> None:
    """A partly filled block is still a whole block of memory."""
    assert blocks_for_tokens(num_tokens, block_size) == expected


# ----- BlockPool -------------------------------------------------------------


@pytest.mark.parametrize("num_blocks", [0, -1])
def test_pool_rejects_fewer_than_one_block(num_blocks: int) -> None:
    with pytest.raises(ValueError, match="num_kv_blocks"):
        BlockPool(num_blocks)


def test_pool_take_and_give_back() -> None:
    """Blocks taken are distinct and leave the free list; given back, they are free again."""
    pool = BlockPool(5)
    assert pool.num_free == 5
    first = pool.take(2)
    second = pool.take(3)
    assert len(set(first) | set(second)) == 5
    assert pool.num_free == 0
    pool.give_back(first)
    assert pool.num_free == 2
    assert sorted(pool.take(2)) == sorted(first)


def test_pool_take_more_than_free_raises_and_keeps_state() -> None:
    """A failed take must not leak a partial allocation."""
    pool = BlockPool(3)
    pool.take(2)
    with pytest.raises(RuntimeError, match="asked for 2"):
        pool.take(2)
    assert pool.num_free == 1


# ----- PagedKVCacheManager ---------------------------------------------------


@pytest.mark.parametrize("block_size", [0, -3])
def test_manager_rejects_block_size_below_one(block_size: int) -> None:
    with pytest.raises(ValueError, match="block_size"):
        PagedKVCacheManager(num_blocks=4, block_size=block_size)


def test_manager_rejects_fewer_than_one_block() -> None:
    with pytest.raises(ValueError, match="num_kv_blocks"):
        PagedKVCacheManager(num_blocks=0, block_size=4)


def test_fresh_manager_is_empty() -> None:
    kv = PagedKVCacheManager(num_blocks=8, block_size=4)
    assert kv.num_blocks == 8
    assert kv.num_free_blocks == 8
    assert kv.usage == 0.0
    assert kv.capacity_tokens == 32
    assert kv.block_ids("nobody") == []


def test_allocation_grows_by_whole_blocks() -> None:
    """A request takes a new block only when its tokens spill into it."""
    kv = PagedKVCacheManager(num_blocks=10, block_size=4, watermark=0.0)
    expected_blocks = {1: 1, 4: 1, 5: 2, 8: 2, 9: 3, 12: 3, 13: 4}
    previous: list[int] = []
    for num_tokens, blocks in expected_blocks.items():
        assert kv.allocate_slots("a", num_tokens)
        table = kv.block_ids("a")
        assert len(table) == blocks
        assert table[: len(previous)] == previous  # growth appends; existing blocks stay put
        previous = list(table)
        assert kv.num_free_blocks == 10 - blocks
        assert_conserved(kv)


def test_allocation_never_shrinks() -> None:
    """Asking for fewer tokens than held keeps the table as it is (KV already written stays)."""
    kv = PagedKVCacheManager(num_blocks=4, block_size=2, watermark=0.0)
    assert kv.allocate_slots("a", 7)
    table = list(kv.block_ids("a"))
    assert kv.allocate_slots("a", 1)
    assert kv.block_ids("a") == table
    assert kv.num_free_blocks == 0


def test_allocation_fails_without_partial_grab() -> None:
    """allocate_slots is all or nothing: a short pool leaves both tables untouched."""
    kv = PagedKVCacheManager(num_blocks=5, block_size=4, watermark=0.0)
    assert kv.allocate_slots("a", 12)  # 3 blocks
    assert not kv.allocate_slots("b", 12)  # needs 3, 2 free
    assert kv.block_ids("b") == []
    assert kv.num_free_blocks == 2
    assert not kv.allocate_slots("a", 21)  # needs 3 more, 2 free
    assert len(kv.block_ids("a")) == 3
    assert kv.allocate_slots("a", 20)  # exactly the 2 free ones
    assert kv.num_free_blocks == 0
    assert_conserved(kv)


def test_two_requests_never_share_a_block() -> None:
    kv = PagedKVCacheManager(num_blocks=6, block_size=3, watermark=0.0)
    for tokens in range(1, 10):
        kv.allocate_slots("a", tokens)
        kv.allocate_slots("b", tokens)
        assert_conserved(kv)
    assert set(kv.block_ids("a")).isdisjoint(kv.block_ids("b"))


def test_free_returns_blocks_at_once() -> None:
    kv = PagedKVCacheManager(num_blocks=6, block_size=2, watermark=0.0)
    kv.allocate_slots("a", 5)
    kv.allocate_slots("b", 3)
    b_blocks = set(kv.block_ids("b"))
    assert kv.num_free_blocks == 1
    kv.free("b")
    assert "b" not in kv.block_tables
    assert kv.block_ids("b") == []
    assert kv.num_free_blocks == 3
    assert b_blocks <= set(kv.pool.free_block_ids())
    assert_conserved(kv)
    kv.free("a")
    assert kv.num_free_blocks == 6
    assert kv.block_tables == {}


def test_free_of_unknown_or_twice_is_harmless() -> None:
    """Aborts and finishes may both free a request; the second call must not double-return blocks."""
    kv = PagedKVCacheManager(num_blocks=3, block_size=2, watermark=0.0)
    kv.free("ghost")
    kv.allocate_slots("a", 4)
    kv.free("a")
    kv.free("a")
    assert kv.num_free_blocks == 3
    assert sorted(kv.pool.free_block_ids()) == [0, 1, 2]


def test_usage_is_fraction_of_blocks_held() -> None:
    kv = PagedKVCacheManager(num_blocks=8, block_size=4, watermark=0.0)
    kv.allocate_slots("a", 9)  # 3 blocks
    assert kv.usage == pytest.approx(3 / 8)
    kv.allocate_slots("b", 20)  # 5 blocks
    assert kv.usage == pytest.approx(1.0)
    kv.free("a")
    assert kv.usage == pytest.approx(5 / 8)


def test_can_admit_without_watermark_uses_every_free_block() -> None:
    kv = PagedKVCacheManager(num_blocks=10, block_size=4, watermark=0.2)
    assert kv.watermark_blocks == 2
    assert kv.can_admit("a", 40, keep_watermark=False)
    assert not kv.can_admit("a", 41, keep_watermark=False)


def test_can_admit_with_watermark_holds_blocks_back() -> None:
    """The watermark keeps ``int(watermark * num_blocks)`` blocks away from newcomers."""
    kv = PagedKVCacheManager(num_blocks=10, block_size=4, watermark=0.2)
    assert kv.can_admit("a", 32)  # 8 blocks == 10 free - 2 reserved
    assert not kv.can_admit("a", 33)  # 9 blocks
    kv.allocate_slots("x", 16)  # 4 blocks; 6 free
    assert kv.can_admit("a", 16)
    assert not kv.can_admit("a", 17)
    assert kv.can_admit("a", 24, keep_watermark=False)
    assert not kv.can_admit("a", 25, keep_watermark=False)


def test_can_admit_counts_blocks_already_held() -> None:
    """A request that holds blocks (a chunked prefill) only needs the extra ones."""
    kv = PagedKVCacheManager(num_blocks=4, block_size=4, watermark=0.0)
    kv.allocate_slots("a", 8)  # 2 blocks, 2 free
    assert kv.can_admit("a", 16)  # needs 2 more
    assert not kv.can_admit("a", 17)
    assert not kv.can_admit("b", 12)  # a newcomer needs 3


def test_can_admit_does_not_allocate() -> None:
    kv = PagedKVCacheManager(num_blocks=4, block_size=4, watermark=0.0)
    assert kv.can_admit("a", 16)
    assert kv.num_free_blocks == 4
    assert "a" not in kv.block_tables


def test_watermark_is_rounded_down_to_whole_blocks() -> None:
    assert PagedKVCacheManager(num_blocks=99, block_size=1).watermark_blocks == 0  # 0.99 blocks
    assert PagedKVCacheManager(num_blocks=100, block_size=1).watermark_blocks == 1
    assert PagedKVCacheManager(num_blocks=100, block_size=1, watermark=0.0).watermark_blocks == 0


# ----- memory report ------------------------------------------------------------


def test_grow_table_returns_the_table_and_grows_only_past_its_last_block() -> None:
    kv = PagedKVCacheManager(num_blocks=8, block_size=4, watermark=0.0)
    table = kv.grow_table("a", 3)
    assert table == kv.block_ids("a") and len(table) == 1
    assert kv.grow_table("a", 4) is table, "room in the last block: the same table"
    grown = kv.grow_table("a", 5)
    assert grown is not table and grown[:1] == table and len(grown) == 2
    assert kv.grow_table("b", 4 * 7) is None and "b" not in kv.block_tables, "short pool: nothing taken"


def test_used_slots_follow_allocation_swap_and_free() -> None:
    """The used-slot sum is kept as tables change; it always equals the tokens of the device-resident requests."""
    kv = PagedKVCacheManager(num_blocks=16, block_size=4, watermark=0.0, num_cpu_blocks=8)
    filled = {}

    def check() -> None:
        report = kv.memory_report()
        assert report.used_slots == sum(filled[r] for r in kv.block_tables)
        assert report.reserved_slots == sum(len(t) for t in kv.block_tables.values()) * kv.block_size

    for request_id, num_tokens in [("a", 5), ("b", 1), ("a", 6), ("c", 9), ("b", 4), ("b", 5)]:
        assert kv.allocate_slots(request_id, num_tokens)
        filled[request_id] = num_tokens
        check()
    assert kv.swap_out("a") is not None
    check()
    assert kv.memory_report().used_slots == filled["b"] + filled["c"]
    kv.swap_in("a")
    check()
    kv.grow_table("a", 7)
    filled["a"] = 7
    check()
    kv.free("c")
    check()
    kv.swap_out("b")
    kv.free("b")  # freed while swapped out: its slots had already left the sum
    check()
    kv.free("a")
    assert kv.memory_report().used_slots == 0 and kv.memory_report().reserved_slots == 0
