"""KV-cache managers: which request owns which slots of the KV memory (no tensors here)."""

from conveyor.kv.paged import BlockPool, PagedKVCacheManager, blocks_for_tokens

__all__ = ["BlockPool", "PagedKVCacheManager", "blocks_for_tokens"]
