"""KV-cache managers: which request owns which slots of the KV memory (no tensors here)."""

from conveyor.core.kv.contiguous import ContiguousBlockPool, ContiguousKVCacheManager
from conveyor.core.kv.paged import BlockPool, MemoryReport, PagedKVCacheManager, blocks_for_tokens

__all__ = [
    "BlockPool",
    "ContiguousBlockPool",
    "ContiguousKVCacheManager",
    "MemoryReport",
    "PagedKVCacheManager",
    "blocks_for_tokens",
]
