"""The reference-counted block pool and its content index (conveyor/core/kv/prefix_cache.py)."""

from __future__ import annotations

import pytest

from conveyor.core.kv.prefix_cache import RefCountedBlockPool


def test_a_cached_block_is_found_by_its_content_and_its_parent_only() -> None:
    pool = RefCountedBlockPool(4)
    first, second = pool.take(2)
    root = pool.register(first, None, (1, 2))
    pool.register(second, root, (3, 4))
    assert pool.lookup(None, (1, 2)) == (first, root)
    assert pool.lookup(root, (3, 4))[0] == second
    assert pool.lookup(None, (3, 4)) is None, "the same tokens after another prefix are another block"
    other_root = pool.register(pool.take(1)[0], None, (9, 9))
    assert pool.lookup(other_root, (3, 4)) is None


def test_free_blocks_are_taken_before_cached_ones_and_cached_ones_least_recently_freed_first() -> None:
    pool = RefCountedBlockPool(4)
    blocks = pool.take(4)
    for block, token in zip(blocks[:3], (10, 11, 12)):
        pool.register(block, None, (token,))
    pool.give_back([blocks[2], blocks[0], blocks[1], blocks[3]])  # blocks[3] was never cached
    assert (pool.num_free, pool.num_cached_free) == (4, 3)
    assert pool.take(1) == [blocks[3]], "a never-cached block goes first"
    assert pool.num_evictions == 0
    assert pool.take(1) == [blocks[2]], "then the least recently freed cached block"
    assert pool.lookup(None, (12,)) is None and pool.num_evictions == 1
    assert pool.lookup(None, (10,)) is not None


def test_a_hit_takes_a_reference_and_the_block_leaves_the_evictable_queue() -> None:
    pool = RefCountedBlockPool(2)
    block = pool.take(1)[0]
    pool.register(block, None, (5,))
    pool.give_back([block])
    assert pool.num_unreferenced([block]) == 1
    pool.acquire([block])
    pool.acquire([block])
    assert pool.ref_counts[block] == 2 and pool.num_cached_free == 0 and pool.num_free == 1
    pool.give_back([block])
    assert pool.num_free == 1, "still held by one request"
    pool.give_back([block])
    assert pool.num_free == 2 and pool.num_cached_free == 1
    with pytest.raises(RuntimeError, match="asked for 3"):
        pool.take(3)


def test_registering_content_that_is_already_cached_keeps_the_first_block() -> None:
    pool = RefCountedBlockPool(3)
    a, b = pool.take(2)
    node = pool.register(a, None, (7, 7))
    assert pool.register(b, None, (7, 7)) is node
    pool.give_back([b])
    assert pool.num_cached_free == 0 and pool.num_free == 2, "the duplicate is a plain free block"
