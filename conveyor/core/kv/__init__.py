"""KV-cache managers: which request owns which slots of the KV memory (no tensors here)."""

from conveyor.core.kv.contiguous import ContiguousBlockPool, ContiguousKVCacheManager
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
    "BlockPool",
    "CachedPrefix",
    "ContiguousBlockPool",
    "ContiguousKVCacheManager",
    "MemoryReport",
    "PagedKVCacheManager",
    "PrefixCachingKVCacheManager",
    "blocks_for_tokens",
]
