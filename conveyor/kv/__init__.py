"""KV-cache managers: which request owns which slots of the KV memory (no tensors here)."""

from conveyor.kv.contiguous import ContiguousBlockPool, ContiguousKVCacheManager
from conveyor.kv.paged import BlockPool, MemoryReport, PagedKVCacheManager, blocks_for_tokens

__all__ = [
    "BlockPool",
    "ContiguousBlockPool",
    "ContiguousKVCacheManager",
    "MemoryReport",
    "PagedKVCacheManager",
    "blocks_for_tokens",
]
