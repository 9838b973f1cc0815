"""Paged KV-cache bookkeeping: fixed-size blocks in one pool, a block table per request.

Pure Python: it decides which block ids a request owns; the executor holds
the tensors those ids index. A request takes a block only when its tokens
spill into it, so memory held tracks memory used, within one block.
"""

from __future__ import annotations

from collections import deque


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class BlockPool:
    """The free list of a fixed number of blocks."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def take(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} KV blocks, {len(self._free)} free")
        return [self._free.popleft() for _ in range(n)]

    def give_back(self, block_ids: list[int]) -> None:
        self._free.extend(block_ids)


class PagedKVCacheManager:
    """Owns the block tables of all requests that hold KV in the pool.

    ``watermark_blocks`` are held back from *admission* (not from requests
    already running), so that admitting one more request does not force a
    preemption on the very next step.
    """

    def __init__(self, num_blocks: int, block_size: int, watermark: float = 0.01) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.watermark_blocks = int(watermark * num_blocks)
        self.block_tables: dict[str, list[int]] = {}

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests, 0..1."""
        return 1.0 - self.pool.num_free / self.pool.num_blocks

    @property
    def capacity_tokens(self) -> int:
        return self.pool.num_blocks * self.block_size

    def block_ids(self, request_id: str) -> list[int]:
        return self.block_tables.get(request_id, [])

    def _extra_blocks(self, request_id: str, num_tokens: int) -> int:
        held = len(self.block_tables.get(request_id, ()))
        return max(blocks_for_tokens(num_tokens, self.block_size) - held, 0)

    def can_admit(self, request_id: str, num_tokens: int, keep_watermark: bool = True) -> bool:
        """Whether a waiting request could get slots for ``num_tokens`` tokens."""
        reserve = self.watermark_blocks if keep_watermark else 0
        return self._extra_blocks(request_id, num_tokens) <= self.pool.num_free - reserve

    def allocate_slots(self, request_id: str, num_tokens: int) -> bool:
        """Grow the request's block table to hold ``num_tokens`` tokens; False if the pool is short."""
        extra = self._extra_blocks(request_id, num_tokens)
        if extra > self.pool.num_free:
            return False
        table = self.block_tables.setdefault(request_id, [])
        if extra:
            table.extend(self.pool.take(extra))
        return True

    def free(self, request_id: str) -> None:
        table = self.block_tables.pop(request_id, None)
        if table:
            self.pool.give_back(table)
