"""An approximate map of which prompt prefixes each replica holds in its prefix cache.

The router cannot see inside a replica's KV manager, so it remembers what it sent there: each
routed prompt's full blocks, and once a sequence finishes, its answer's too (the replica caches
the blocks it computed, and a chat's next turn resends the answer), as chained block hashes (a
block's key covers every token before it, as the replicas' own prefix caches key blocks). Like
the cache it mirrors, the index is bounded: it keeps at most the replica's KV capacity in
blocks, least recently used out first, and forgets blocks unused for ``ttl`` seconds; a replica
that restarts starts empty again.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


def block_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    """Chained keys of the prompt's full blocks: equal keys mean equal prefixes up to that block.

    The last, partial block is left out, as the engines' prefix caches leave it out.
    """
    hashes, parent = [], 0
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash((parent, tuple(token_ids[start : start + block_size])))
        hashes.append(parent)
    return hashes


class PrefixIndex:
    """One replica's blocks as the router believes them cached: block key -> last time it was routed."""

    def __init__(self, capacity_blocks: int, ttl: float) -> None:
        if capacity_blocks < 1 or ttl <= 0:
            raise ValueError(f"a prefix index needs capacity_blocks >= 1 and ttl > 0, got {capacity_blocks}, {ttl}")
        self.capacity_blocks = capacity_blocks
        self.ttl = ttl
        self._last_used: OrderedDict[int, float] = OrderedDict()  # oldest first

    def __len__(self) -> int:
        return len(self._last_used)

    def match_length(self, hashes: Sequence[int], now: float) -> int:
        """How many leading blocks of ``hashes`` the replica is believed to hold."""
        self._expire(now)
        matched = 0
        for key in hashes:
            if key not in self._last_used:
                break
            matched += 1
        return matched

    def insert(self, hashes: Sequence[int], now: float) -> None:
        """The replica was sent these blocks: they are its most recently used, the oldest leave past capacity.

        A prefix's first block is marked used last, so it leaves after its descendants, never before: a
        block whose parent is gone could never be matched again.
        """
        for key in reversed(hashes):
            self._last_used[key] = now
            self._last_used.move_to_end(key)
        while len(self._last_used) > self.capacity_blocks:
            self._last_used.popitem(last=False)

    def resize(self, capacity_blocks: int) -> None:
        """Follow the replica's real KV capacity once it reports it."""
        self.capacity_blocks = max(capacity_blocks, 1)
        while len(self._last_used) > self.capacity_blocks:
            self._last_used.popitem(last=False)

    def clear(self) -> None:
        self._last_used.clear()

    def _expire(self, now: float) -> None:
        while self._last_used:
            key, last_used = next(iter(self._last_used.items()))
            if now - last_used <= self.ttl:
                break
            del self._last_used[key]
