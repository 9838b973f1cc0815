"""Prefix caching: full KV blocks found again by their content, so a shared prompt prefix is computed once.

A full block is known by the chain of token ids that leads up to it: its key
is ``(the key node of the block before it, its own token ids)``. Keys are
compared whole, token by token, and the parent by identity, so two different
prefixes can never be mistaken for each other (no hash collision can return
wrong KV); the dictionary lookup is still O(1) per block.

A block whose last user finishes keeps its content and its key: it waits in
an LRU queue of evictable blocks and is only reused when the pool has no
never-cached free block left, so a repeated system prompt or an earlier turn
of a conversation is found again as long as memory allows.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence


class BlockKey:
    """The identity of one full block's content: the node before it and its token ids.

    Nodes are compared by identity; a child's key holds its parent node, so a
    parent stays alive (and its identity unique) as long as any child key does.
    """

    __slots__ = ("parent", "token_ids")

    def __init__(self, parent: BlockKey | None, token_ids: tuple[int, ...]) -> None:
        self.parent = parent
        self.token_ids = token_ids


class RefCountedBlockPool:
    """A fixed number of KV blocks with reference counts, and the content index of the full ones.

    Free blocks are of two kinds: never cached (or evicted), taken first; and
    cached (their content is indexed), taken only when the first kind runs out,
    least recently freed first.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced; LRU first
        self._index: dict[tuple[BlockKey | None, tuple[int, ...]], int] = {}  # content -> block
        self._key_of: dict[int, tuple[BlockKey | None, tuple[int, ...]]] = {}  # block -> its content key
        self._node_of: dict[int, BlockKey] = {}
        self.num_evictions = 0

    # ----- the plain pool ----------------------------------------------------

    @property
    def num_free(self) -> int:
        """Blocks that can be taken: never cached, plus cached ones no request holds."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached_free(self) -> int:
        """Free blocks that still hold a cached prefix (evicted only under memory pressure)."""
        return len(self._evictable)

    @property
    def num_cached(self) -> int:
        """Blocks whose content is indexed, held or not."""
        return len(self._index)

    def can_take(self, n: int) -> bool:
        return n <= self.num_free

    def unusable_free_blocks(self) -> int:
        """Free blocks that no request could use: none, since any block serves any request."""
        return 0

    def take(self, n: int) -> list[int]:
        """``n`` blocks with a reference each: never-cached blocks first, then the least recently used cached."""
        if n > self.num_free:
            raise RuntimeError(f"asked for {n} KV blocks, {self.num_free} free")
        blocks = []
        for _ in range(n):
            if self._free:
                block = self._free.popleft()
            else:
                block, _ = self._evictable.popitem(last=False)
                self._forget(block)
                self.num_evictions += 1
            self.ref_counts[block] = 1
            blocks.append(block)
        return blocks

    def give_back(self, block_ids: Iterable[int]) -> None:
        """Drop one reference to each block, in the order given: the first to reach zero is evicted first."""
        ref_counts, cached = self.ref_counts, self._key_of
        for block in block_ids:
            ref_counts[block] -= 1
            if ref_counts[block]:
                continue
            if block in cached:
                self._evictable[block] = None
            else:
                self._free.append(block)

    # ----- the content index ---------------------------------------------------

    def lookup(self, parent: BlockKey | None, token_ids: tuple[int, ...]) -> tuple[int, BlockKey] | None:
        """The cached block holding ``token_ids`` after ``parent``, and its node; None on a miss."""
        block = self._index.get((parent, token_ids))
        return None if block is None else (block, self._node_of[block])

    def acquire(self, block_ids: Sequence[int]) -> None:
        """One more reference to each of these cached blocks (a cache hit); an unreferenced one stops being
        evictable."""
        for block in block_ids:
            if self.ref_counts[block] == 0:
                del self._evictable[block]
            self.ref_counts[block] += 1

    def num_unreferenced(self, block_ids: Sequence[int]) -> int:
        """How many of these blocks are free now, so that a hit on them takes them from the free count."""
        ref_counts = self.ref_counts
        return sum(1 for block in block_ids if ref_counts[block] == 0)

    def register(self, block: int, parent: BlockKey | None, token_ids: tuple[int, ...]) -> BlockKey:
        """Index a block that now holds ``token_ids`` after ``parent``; returns the node of that content.

        If another block already holds the same content, that one stays indexed and its node is returned:
        the content, not the block, is what later keys chain on.
        """
        key = (parent, token_ids)
        existing = self._index.get(key)
        if existing is not None:
            return self._node_of[existing]
        node = BlockKey(parent, token_ids)
        self._index[key] = block
        self._key_of[block] = key
        self._node_of[block] = node
        return node

    def _forget(self, block: int) -> None:
        key = self._key_of.pop(block)
        del self._index[key]
        del self._node_of[block]
