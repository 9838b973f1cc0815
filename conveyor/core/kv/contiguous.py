"""Contiguous KV reservation: the "traditional" layout that paged attention replaced.

At admission a request reserves one contiguous slab of slots for the longest
sequence it could reach (``max_model_len``), however short it turns out. The
slab is expressed as a run of consecutive block ids, so the same attention
over block tables reads it, and the two layouts differ in memory policy only.
Two losses follow, both reported: internal waste (slots reserved but never
filled) and external fragmentation (free slots in holes too small for a slab).
"""

from __future__ import annotations

from conveyor.core.kv.paged import PagedKVCacheManager, blocks_for_tokens


class ContiguousBlockPool:
    """Free blocks as a byte map (1 free, 0 taken); every request takes one run of ``slab_blocks`` consecutive
    blocks (first fit). Runs are found with ``bytearray.find``, so a scan costs one step per run, not per block."""

    def __init__(self, num_blocks: int, slab_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.slab_blocks = slab_blocks
        self._free = bytearray(b"\x01") * num_blocks
        self._num_free = num_blocks

    @property
    def num_free(self) -> int:
        return self._num_free

    def free_block_ids(self) -> list[int]:
        """The free blocks' ids, in ascending order (a copy: for checks and reports)."""
        return [block for block, free in enumerate(self._free) if free]

    def _free_runs(self) -> list[tuple[int, int]]:
        """(start, length) of every maximal run of free blocks."""
        runs, free = [], self._free
        start = free.find(1)
        while start != -1:
            end = free.find(0, start)
            end = len(free) if end == -1 else end
            runs.append((start, end - start))
            start = free.find(1, end)
        return runs

    def can_take(self, n: int) -> bool:
        if n > self._num_free:  # no need to look for holes
            return False
        return n == 0 or any(length >= n for _, length in self._free_runs())

    def can_take_after_freeing(self, n: int, freed: list[int]) -> bool:
        """Whether a run of ``n`` blocks would be free once the blocks ``freed`` were given back."""
        if n > self._num_free + len(freed):
            return False
        saved, self._free = self._free, bytearray(self._free)
        try:
            for block in freed:
                self._free[block] = 1
            return n == 0 or any(length >= n for _, length in self._free_runs())
        finally:
            self._free = saved

    def unusable_free_blocks(self) -> int:
        """Free blocks outside any slab-sized piece of a hole."""
        if self._num_free < self.slab_blocks:  # too few for any slab, wherever they are
            return self._num_free
        usable = sum(length // self.slab_blocks * self.slab_blocks for _, length in self._free_runs())
        return self._num_free - usable

    def take(self, n: int) -> list[int]:
        for start, length in self._free_runs():
            if length >= n:
                self._free[start : start + n] = bytes(n)
                self._num_free -= n
                return list(range(start, start + n))
        raise RuntimeError(f"no run of {n} contiguous free KV blocks")

    def give_back(self, block_ids: list[int]) -> None:
        low, high = (min(block_ids), max(block_ids)) if block_ids else (0, -1)
        if high - low + 1 == len(block_ids):  # distinct blocks forming one run: a whole slab, as a rule
            self._free[low : high + 1] = b"\x01" * len(block_ids)
        else:
            for block in block_ids:
                self._free[block] = 1
        self._num_free += len(block_ids)


class ContiguousKVCacheManager(PagedKVCacheManager):
    """Each request holds one slab of ``max_model_len`` slots from admission to finish."""

    def __init__(self, num_blocks: int, block_size: int, max_model_len: int, num_cpu_blocks: int = 0) -> None:
        # No watermark: a running request never needs another slot, so admission cannot cause preemption.
        super().__init__(num_blocks, block_size, watermark=0.0, num_cpu_blocks=num_cpu_blocks)
        self.slab_blocks = blocks_for_tokens(max_model_len, block_size)
        self.pool = ContiguousBlockPool(num_blocks, self.slab_blocks)

    def _extra_blocks(self, request_id: str, num_tokens: int) -> int:
        return 0 if self.block_tables.get(request_id) else self.slab_blocks

    def trim_table(self, request_id: str, num_tokens: int) -> None:
        """Count only ``num_tokens`` slots as used; the slab itself is the request's until it ends."""
        self._used_slots += num_tokens - self._num_tokens[request_id]
        self._num_tokens[request_id] = num_tokens
