"""KV-cache managers: which request owns which slots of the KV memory (no tensors here)."""

from conveyor.core.kv.contiguous import ContiguousBlockPool, ContiguousKVCacheManager
from conveyor.core.kv.grouped import GroupedKVCacheManager, blocks_behind
from conveyor.core.kv.groups import NULL_BLOCK, KVGroup, KVLayout, kv_layout
from conveyor.core.kv.paged import (
    NO_PREFIX,
    BlockPool,
    CachedPrefix,
    MemoryReport,
    PagedKVCacheManager,
    blocks_for_tokens,
)
from conveyor.core.kv.prefix_cache import PrefixCachingKVCacheManager

__all__ = [
    "NO_PREFIX",
    "NULL_BLOCK",
    "BlockPool",
    "CachedPrefix",
    "ContiguousBlockPool",
    "ContiguousKVCacheManager",
    "GroupedKVCacheManager",
    "KVGroup",
    "KVLayout",
    "MemoryReport",
    "PagedKVCacheManager",
    "PrefixCachingKVCacheManager",
    "blocks_behind",
    "blocks_for_tokens",
    "kv_layout",
]
