"""The reference-counted block pool, its content index, and the prefix-caching KV manager (core/kv/prefix_cache.py)."""

from __future__ import annotations

import pytest

from conveyor.core.kv import NO_PREFIX, PrefixCachingKVCacheManager
from conveyor.core.kv.prefix_cache import RefCountedBlockPool
from conveyor.core.request import Request
from conveyor.core.sampling import SamplingParams


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


def _request(request_id: str, tokens: list[int]) -> Request:
    return Request(request_id, tokens, SamplingParams(max_tokens=4), arrival_time=0.0)


def test_a_finished_sequence_stays_cached_and_its_tail_is_evicted_first() -> None:
    kv = PrefixCachingKVCacheManager(num_blocks=4, block_size=2, watermark=0.0)
    first = _request("a", [1, 2, 3, 4, 5, 6, 7])
    kv.admit(first, 7)
    first.num_computed_tokens = 7
    kv.commit_computed(first)  # blocks 0-2 are full: indexed; block 3 holds one token
    table = kv.block_tables["a"]
    kv.free("a")
    assert kv.pool.free_block_ids() == [table[3], table[2], table[1], table[0]], "the tail is evicted first"
    assert kv.num_cached_free_blocks == 3
    prefix = kv.cached_prefix(_request("b", [1, 2, 3, 4, 9, 9]))
    assert prefix.block_ids == (table[0], table[1]) and prefix.num_tokens == 4
    assert kv.cached_prefix(_request("c", [1, 2, 3, 4])).num_tokens == 2, "the last token is always computed"
    assert kv.cached_prefix(_request("d", [2, 1, 3, 4, 5])) is NO_PREFIX


def test_admission_counts_a_free_cached_block_it_reuses() -> None:
    kv = PrefixCachingKVCacheManager(num_blocks=3, block_size=2, watermark=0.0)
    first = _request("a", [1, 2, 3, 4, 5])
    kv.admit(first, 5)
    first.num_computed_tokens = 5
    kv.commit_computed(first)
    kv.free("a")
    second = _request("b", [1, 2, 3, 4, 8, 8, 8])
    prefix = kv.cached_prefix(second)
    assert prefix.num_tokens == 4
    # 7 tokens need 4 blocks: 2 found (free, so they count against the pool) + 2 new > 3 blocks.
    assert not kv.can_admit("b", 7, prefix=prefix)
    assert kv.can_admit("b", 6, prefix=prefix)
    kv.admit(second, 6, prefix)
    assert kv.block_tables["b"][:2] == list(prefix.block_ids) and kv.num_free_blocks == 0
    assert (kv.num_queries, kv.num_hits) == (5 + 7, 4)
