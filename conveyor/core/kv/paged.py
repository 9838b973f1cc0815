"""Paged KV-cache bookkeeping: fixed-size blocks in one pool, a block table per request.

Pure Python: it decides which block ids a request owns; the executor holds
the tensors those ids index. A request takes a block only when its tokens
spill into it, so memory held tracks memory used, within one block.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from conveyor.core.request import Request


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

    def can_take(self, n: int) -> bool:
        return n <= len(self._free)

    def free_block_ids(self) -> list[int]:
        """The free blocks' ids, in the order they would be taken (a copy: for checks and reports)."""
        return list(self._free)

    def unusable_free_blocks(self) -> int:
        """Free blocks that no request could use: none, since any block serves any request."""
        return 0

    def can_take_after_freeing(self, n: int, freed: list[int]) -> bool:
        """Whether ``n`` blocks could be taken once the blocks ``freed`` were given back."""
        return n <= len(self._free) + len(freed)

    def take(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} KV blocks, {len(self._free)} free")
        return [self._free.popleft() for _ in range(n)]

    def give_back(self, block_ids: list[int]) -> None:
        self._free.extend(block_ids)


@dataclass(frozen=True, slots=True)
class MemoryReport:
    capacity_slots: int
    reserved_slots: int  # slots held by requests (a block shared by several counts once)
    used_slots: int  # slots that hold a token's K/V
    unusable_free_slots: int  # external fragmentation: free, but in holes too small for any request
    num_requests: int
    shared_slots: int = 0  # slots that sharing saves: block references beyond the first, times the block size
    cached_free_slots: int = 0  # free slots whose blocks still hold a cached prefix

    @property
    def internal_waste_slots(self) -> int:
        return self.reserved_slots - self.used_slots


@dataclass(frozen=True, slots=True)
class CachedPrefix:
    """The leading full blocks of a request found in the prefix cache: their ids, and how many tokens they hold.

    ``keys`` are the content keys of those blocks (see :mod:`conveyor.core.kv.prefix_cache`); the manager
    chains the request's next blocks on the last one.
    """

    block_ids: tuple[int, ...] = ()
    keys: tuple = ()
    num_tokens: int = 0


NO_PREFIX = CachedPrefix()


class PagedKVCacheManager:
    """Owns the block tables of all requests that hold KV in the pool, and of those swapped out to CPU.

    ``watermark_blocks`` are held back from *admission* (not from requests
    already running), so that admitting one more request does not force a
    preemption on the very next step. ``num_cpu_blocks`` is the swap space:
    a second pool, in host memory, that a preempted request's blocks can be
    copied to instead of being dropped.

    A block table is never changed in place (growing it makes a new list), so
    the scheduler hands the executor the table itself: it still shows the
    blocks of its own step after later steps have grown the request.
    """

    def __init__(self, num_blocks: int, block_size: int, watermark: float = 0.01, num_cpu_blocks: int = 0) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.cpu_pool = BlockPool(num_cpu_blocks) if num_cpu_blocks else None
        self.watermark_blocks = int(watermark * num_blocks)
        self.block_tables: dict[str, list[int]] = {}
        self.cpu_block_tables: dict[str, list[int]] = {}
        # Slots each request fills (kept while it is swapped out), and their sum over the device tables:
        # kept as the tables change, so the waste report costs nothing per request.
        self._num_tokens: dict[str, int] = {}
        self._used_slots = 0

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

    # Prefix caching's figures: none here (see PrefixCachingKVCacheManager).
    caches_prefixes = False
    num_queries = 0
    num_hits = 0
    num_cached_free_blocks = 0
    num_shared_slots = 0  # slots that shared blocks save (block references beyond the first, times block size)
    # KV groups (conveyor.core.kv.groups): one here, over the whole context; see GroupedKVCacheManager.
    num_groups = 1
    windowed = False

    @property
    def capacity_tokens(self) -> int:
        return self.pool.num_blocks * self.block_size

    def block_ids(self, request_id: str) -> list[int]:
        return self.block_tables.get(request_id, [])

    def is_evictable(self, block: int) -> bool:
        """Whether a block is free yet still holds a cached prefix (found again until evicted): never here."""
        return False

    def evictable_block_ids(self) -> list[int]:
        """The free blocks that still hold a cached prefix, least recently used first: none here."""
        return []

    def blocks_to_grow(self, request_id: str, num_tokens: int) -> int:
        """Blocks the request's tables lack to hold ``num_tokens`` tokens, every KV group counted."""
        return self._extra_blocks(request_id, num_tokens)

    def group_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """The request's table in each KV group: none but ``block_ids`` here (one group)."""
        return ()

    def release_behind_window(self, request: Request) -> None:
        """After a step: give back the blocks every windowed layer has passed (no window here)."""

    def _device_blocks(self, request_id: str) -> list[int]:
        """Every device block the request holds, in any group."""
        return self.block_tables.get(request_id, [])

    def _extra_blocks(self, request_id: str, num_tokens: int) -> int:
        extra = blocks_for_tokens(num_tokens, self.block_size) - len(self.block_tables.get(request_id, ()))
        return extra if extra > 0 else 0

    # ----- admission: where prefix caching (a subclass) hooks in ------------------

    def cached_prefix(self, request: Request) -> CachedPrefix:
        """The request's leading blocks already in the cache: none here (no prefix caching)."""
        return NO_PREFIX

    def can_admit(
        self, request_id: str, num_tokens: int, keep_watermark: bool = True, prefix: CachedPrefix = NO_PREFIX
    ) -> bool:
        """Whether a waiting request could get slots for ``num_tokens`` tokens (``prefix`` of them cached)."""
        reserve = self.watermark_blocks if keep_watermark else 0
        return self.pool.can_take(self._extra_blocks(request_id, num_tokens) + reserve)

    def can_admit_after_freeing(
        self, freed: list[str], request_id: str, num_tokens: int, keep_watermark: bool, prefix: CachedPrefix
    ) -> bool:
        """What ``can_admit`` would say once the requests ``freed`` gave their blocks back (nothing changes here):
        priority preemption asks it before preempting anyone."""
        reserve = self.watermark_blocks if keep_watermark else 0
        blocks = [block for victim in freed for block in self._device_blocks(victim)]
        return self.pool.can_take_after_freeing(self._extra_blocks(request_id, num_tokens) + reserve, blocks)

    def admit(self, request: Request, num_tokens: int, prefix: CachedPrefix = NO_PREFIX) -> list[int] | None:
        """A waiting request's table for ``num_tokens`` tokens, after ``can_admit`` said yes."""
        return self.grow_table(request.request_id, num_tokens)

    def prefix_in_flight(self, request: Request, prefix: CachedPrefix) -> bool:
        """Whether another running request is computing the block that follows ``prefix`` in this request:
        never here (no prefix caching)."""
        return False

    def commit_computed(self, request: Request) -> None:
        """Called after each step the request computed tokens in: nothing to do without prefix caching."""

    def holds_back(self, request_id: str) -> bool:
        """Whether the blocks the request fills from now on need no ``commit_computed``: none are indexed here."""
        return True

    def allocate_slots(self, request_id: str, num_tokens: int) -> bool:
        """Grow the request's block table to hold ``num_tokens`` tokens; False if the pool is short."""
        return self.grow_table(request_id, num_tokens) is not None

    def grow_table(self, request_id: str, num_tokens: int) -> list[int] | None:
        """Grow the request's block table to hold ``num_tokens`` tokens; the table, or None if the pool is short.

        The scheduler calls this for every running request in every step, and most calls (a decode
        inside its last block) find the table big enough already: a length check, no pool.
        """
        table = self.block_tables.get(request_id)
        if table is None or num_tokens > len(table) * self.block_size:
            return self._grow(request_id, num_tokens)
        self._used_slots += num_tokens - self._num_tokens[request_id]
        self._num_tokens[request_id] = num_tokens
        return table

    def _grow(self, request_id: str, num_tokens: int) -> list[int] | None:
        """``grow_table`` when the table lacks blocks (or the request has none): take them from the pool."""
        counted = self._num_tokens.get(request_id, 0) if request_id in self.block_tables else 0  # used slots so far
        table = self.block_tables.get(request_id, [])
        extra = self._extra_blocks(request_id, num_tokens)
        if extra:
            if not self.pool.can_take(extra):
                return None
            # A new list, never the old one grown in place: a step's output can hold a table uncopied.
            table = table + self.pool.take(extra)
        self.block_tables[request_id] = table
        self._used_slots += num_tokens - counted
        self._num_tokens[request_id] = num_tokens
        return table

    def trim_table(self, request_id: str, num_tokens: int) -> None:
        """Hold only the blocks the request's first ``num_tokens`` tokens fill; the slots past them are free
        again, and blocks holding none of those tokens go back to the pool (speculative decoding's rejected
        drafts: their slots were taken for the step that verified them)."""
        table = self.block_tables[request_id]
        self._used_slots += num_tokens - self._num_tokens[request_id]
        self._num_tokens[request_id] = num_tokens
        keep = blocks_for_tokens(num_tokens, self.block_size)
        if len(table) > keep:
            self.block_tables[request_id] = table[:keep]  # a new list: the step's output holds the old one
            self._give_back(table[keep:])

    def append_blocks(self, request_ids: list[str]) -> None:
        """One more block for each of these requests, taken in this order, their counts of tokens left as they
        are (``grow_table`` brings them up): a fast-forward's decodes that reach a new block in the same step.
        The caller has checked that the pool has them."""
        tables = self.block_tables
        for request_id, block in zip(request_ids, self.pool.take(len(request_ids)), strict=True):
            tables[request_id] = tables[request_id] + [block]  # a new list, as grow_table makes

    def _drop_table(self, request_id: str) -> list[int] | None:
        """Remove the request's device table, and its tokens from the used slots; the table, if any."""
        table = self.block_tables.pop(request_id, None)
        if table is not None:
            self._used_slots -= self._num_tokens.get(request_id, 0)
        return table

    def free(self, request_id: str) -> None:
        table = self._drop_table(request_id)
        self._num_tokens.pop(request_id, None)
        if table:
            self._give_back(table)
        cpu_table = self.cpu_block_tables.pop(request_id, None)
        if cpu_table:
            self.cpu_pool.give_back(cpu_table)

    def _give_back(self, table: list[int]) -> None:
        """Return a request's device blocks to the pool (prefix caching: tail first, see its override)."""
        self.pool.give_back(table)

    def memory_report(self, uncounted_slots: int = 0) -> MemoryReport:
        """Token slots reserved vs holding real KV, and free slots no request could use; ``uncounted_slots``:
        tokens in held blocks that the manager has not been told of yet (a fast-forward's group of decodes)."""
        pool, block_size, shared = self.pool, self.block_size, self.num_shared_slots
        reserved, used = self.reserved_and_used_slots(uncounted_slots)
        return MemoryReport(
            capacity_slots=self.capacity_tokens,
            reserved_slots=reserved,
            used_slots=used,
            unusable_free_slots=pool.unusable_free_blocks() * block_size,
            num_requests=len(self.block_tables),
            shared_slots=shared,
            cached_free_slots=self.num_cached_free_blocks * block_size,
        )

    def reserved_and_used_slots(self, uncounted_slots: int = 0) -> tuple[int, int]:
        """The two figures of ``memory_report`` that every simulated step sums (its waste), alone."""
        pool = self.pool
        # A shared block's tokens are held once.
        used = self._used_slots + uncounted_slots - self.num_shared_slots
        return (pool.num_blocks - pool.num_free) * self.block_size, used

    # ----- swap ---------------------------------------------------------------

    @property
    def num_cpu_blocks(self) -> int:
        return self.cpu_pool.num_blocks if self.cpu_pool else 0

    @property
    def num_free_cpu_blocks(self) -> int:
        return self.cpu_pool.num_free if self.cpu_pool else 0

    def swap_out(self, request_id: str) -> list[tuple[int, int]] | None:
        """Move the request's blocks to CPU; (device, cpu) pairs to copy, or None if swap space is short."""
        table = self.block_tables.get(request_id, [])
        if self.cpu_pool is None or len(table) > self.cpu_pool.num_free:
            return None
        cpu_table = self.cpu_pool.take(len(table))
        self._give_back(self._drop_table(request_id) or [])
        self.cpu_block_tables[request_id] = cpu_table
        return list(zip(table, cpu_table))

    def can_swap_in(self, request_id: str, num_tokens: int, keep_watermark: bool = True, headroom: int = 0) -> bool:
        """Whether the swapped request's blocks, plus room for ``num_tokens`` tokens, fit on the device, with
        ``headroom`` blocks still free beside them."""
        needed = blocks_for_tokens(num_tokens, self.block_size)
        held = len(self.cpu_block_tables.get(request_id, ()))
        reserve = self.watermark_blocks if keep_watermark else 0
        return self.pool.can_take(max(needed - held, 0) + held + max(reserve, headroom))

    def swap_in(self, request_id: str) -> list[tuple[int, int]]:
        """Move the request's blocks back to the device; (cpu, device) pairs to copy."""
        cpu_table = self.cpu_block_tables.pop(request_id)
        table = self.pool.take(len(cpu_table))
        self.cpu_pool.give_back(cpu_table)
        self.block_tables[request_id] = table
        self._used_slots += self._num_tokens.get(request_id, 0)
        return list(zip(cpu_table, table))
