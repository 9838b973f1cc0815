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

from collections import Counter, OrderedDict, deque
from collections.abc import Iterable, Sequence

from conveyor.core.kv.paged import NO_PREFIX, CachedPrefix, PagedKVCacheManager, blocks_for_tokens
from conveyor.core.request import Request, RequestStatus

# The digest of a block's content (its parent node and token ids): Python's hash, which can collide; the index
# chains the nodes that share one and compares contents whole. (Tests make every content collide.)
content_digest = hash


class BlockKey:
    """The identity of one full block's content: the node before it and its token ids; and the block holding it.

    Nodes are compared by identity; a child's key holds its parent node, so a
    parent stays alive (and its identity unique) as long as any child key does.
    ``digest`` is the hash of ``(parent, token_ids)``, computed once: the index
    is keyed by it (an int hashes for nothing, where a tuple of a block's token
    ids is hashed anew at every dictionary operation), and nodes whose contents
    share a digest are chained through ``next_same_digest``, so the content is
    still compared whole.
    """

    __slots__ = ("block", "digest", "next_same_digest", "parent", "token_ids")

    def __init__(self, parent: BlockKey | None, token_ids: tuple[int, ...], block: int = -1, digest: int = 0) -> None:
        self.parent = parent
        self.token_ids = token_ids
        self.block = block
        self.digest = digest
        self.next_same_digest: BlockKey | None = None


# The node of a cached block that no lookup will ever look for: a block of a request's own tokens, given back by
# the request as it finished (PrefixCachingKVCacheManager). It is cached all the same, and evicted in its turn,
# so the pool takes blocks in the same order as if it were indexed; it is only in no index.
UNINDEXED = BlockKey(None, ())


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
        self._index: dict[int, BlockKey] = {}  # digest of a content -> its node (the first of those with it)
        self._node_of: dict[int, BlockKey] = {}  # cached block -> the node of its content
        self.num_evictions = 0
        self.num_shared_refs = 0  # references beyond the first, over all blocks: the sharing prefix caching buys

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
        return len(self._node_of)

    def can_take(self, n: int) -> bool:
        return n <= self.num_free

    def free_block_ids(self) -> list[int]:
        """The free blocks' ids, in the order they would be taken (a copy: for checks and reports)."""
        return [*self._free, *self._evictable]

    def unusable_free_blocks(self) -> int:
        """Free blocks that no request could use: none, since any block serves any request."""
        return 0

    def take(self, n: int) -> list[int]:
        """``n`` blocks with a reference each: never-cached blocks first, then the least recently used cached."""
        free, ref_counts, evictable = self._free, self.ref_counts, self._evictable
        if n > len(free) + len(evictable):
            raise RuntimeError(f"asked for {n} KV blocks, {self.num_free} free")
        blocks = [free.popleft() for _ in range(min(n, len(free)))]
        num_evicted = n - len(blocks)
        if num_evicted:
            index, node_of = self._index, self._node_of
            for _ in range(num_evicted):
                block = evictable.popitem(last=False)[0]
                node = node_of.pop(block)  # forgotten: its content is found no more
                if node is UNINDEXED:
                    pass
                elif index[node.digest] is node and node.next_same_digest is None:
                    del index[node.digest]  # alone with its digest, as nearly always
                else:
                    self._unchain(node)
                blocks.append(block)
            self.num_evictions += num_evicted
        for block in blocks:
            ref_counts[block] = 1
        return blocks

    def give_back(self, block_ids: Iterable[int]) -> None:
        """Drop one reference to each block, in the order given: the first to reach zero is evicted first."""
        ref_counts, cached = self.ref_counts, self._node_of
        for block in block_ids:
            ref_counts[block] -= 1
            if ref_counts[block]:
                self.num_shared_refs -= 1
                continue
            if block in cached:
                self._evictable[block] = None
            else:
                self._free.append(block)

    # ----- the content index ---------------------------------------------------

    def lookup(self, parent: BlockKey | None, token_ids: tuple[int, ...]) -> tuple[int, BlockKey] | None:
        """The cached block holding ``token_ids`` after ``parent``, and its node; None on a miss."""
        node = self._index.get(content_digest((parent, token_ids)))
        while node is not None and not (node.parent is parent and node.token_ids == token_ids):
            node = node.next_same_digest
        return None if node is None else (node.block, node)

    def is_evictable(self, block: int) -> bool:
        """Whether the block is free but still indexed: reused only when no never-cached block is left."""
        return self.ref_counts[block] == 0 and block in self._node_of

    def evictable_block_ids(self) -> list[int]:
        return list(self._evictable)

    def is_cached(self, block: int) -> bool:
        """Whether the block's content is indexed (it may be found by a later request)."""
        return block in self._node_of

    def acquire(self, block_ids: Sequence[int]) -> None:
        """One more reference to each of these cached blocks (a cache hit); an unreferenced one stops being
        evictable."""
        for block in block_ids:
            if self.ref_counts[block] == 0:
                del self._evictable[block]
            else:
                self.num_shared_refs += 1
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
        digest = content_digest((parent, token_ids))
        first = node = self._index.get(digest)
        while node is not None and not (node.parent is parent and node.token_ids == token_ids):
            node = node.next_same_digest
        if node is None:
            node = BlockKey(parent, token_ids, block, digest)
            node.next_same_digest = first
            self._index[digest] = self._node_of[block] = node
        return node

    def keep_unindexed(self, block_ids: Iterable[int]) -> None:
        """Count these held blocks as cached without indexing them (``UNINDEXED``): nobody will look for them."""
        node_of = self._node_of
        for block in block_ids:
            node_of[block] = UNINDEXED

    def _unchain(self, node: BlockKey) -> None:
        """Take an evicted node out of the chain of nodes with its digest (and the digest out of the index with
        the last of them)."""
        first = self._index[node.digest]
        if first is node:
            if node.next_same_digest is None:
                del self._index[node.digest]
            else:
                self._index[node.digest] = node.next_same_digest
            return
        while first.next_same_digest is not node:
            first = first.next_same_digest
        first.next_same_digest = node.next_same_digest


class PrefixCachingKVCacheManager(PagedKVCacheManager):
    """The paged KV manager with prefix caching: full blocks are indexed by content and shared by reference.

    - Admission asks :meth:`cached_prefix` for the request's longest run of cached leading blocks, at most
      up to its last token (which is always computed, so that there are logits to sample from); the
      request starts with those blocks and ``num_computed_tokens`` at their end. A request pooled by the
      mean (an embedding: conveyor.core.pooling) finds none, since it needs every position's hidden state.
    - After each step, :meth:`commit_computed` indexes the blocks the request has just filled.
    - A finished or preempted request gives its blocks back tail first: they stay cached, and the tail of a
      sequence is the first to be evicted. Re-admitted after preemption by recompute, a request finds its
      own blocks again if memory allowed them to stay.
    - Swapping a request out copies all its blocks, shared ones included, and drops its references; swapped
      back in, it gets blocks of its own.
    - A block holding a token of the request's own (``Request.private_after``: the simulator's requests) can
      be found again only by the request itself, re-admitted after a preemption. Such blocks are committed as
      its computed tokens fill them, but indexed only when the request is preempted or swapped out (from then
      on, all of its blocks as they fill); a request that finishes gives them back cached but unindexed
      (``UNINDEXED``), in the same eviction order. Nothing any request finds, and no block the pool takes,
      differs from indexing them at once; what is saved is building and evicting an index entry per block
      that nobody looks up (half of a long simulation's time).
    """

    caches_prefixes = True

    def __init__(self, num_blocks: int, block_size: int, watermark: float = 0.01, num_cpu_blocks: int = 0) -> None:
        super().__init__(num_blocks, block_size, watermark, num_cpu_blocks)
        self.pool: RefCountedBlockPool = RefCountedBlockPool(num_blocks)
        self._chains: dict[str, list[BlockKey]] = {}  # per running request: the keys of its indexed full blocks
        self._roots: dict[str, BlockKey] = {}  # one root per cache salt: salted prefixes are never shared
        self._filling: dict[str, Request] = {}  # running requests with full prompt blocks not yet indexed
        # Requests whose blocks of their own tokens are held back from the index (Request.private_after): past
        # their chain, every block their computed tokens fill is committed, and indexed only if they leave.
        self._held_back: dict[str, Request] = {}
        self._index_all: dict[str, Request] = {}  # requests preempted or swapped once: indexed as their blocks fill
        self.num_queries = 0  # tokens looked up at admission (vLLM: prefix_cache_queries)
        self.num_hits = 0  # tokens found

    @property
    def num_cached_free_blocks(self) -> int:
        return self.pool.num_cached_free

    @property
    def num_shared_slots(self) -> int:
        return self.pool.num_shared_refs * self.block_size

    def is_evictable(self, block: int) -> bool:
        return self.pool.is_evictable(block)

    def evictable_block_ids(self) -> list[int]:
        return self.pool.evictable_block_ids()

    def _root(self, request: Request) -> BlockKey | None:
        salt = request.cache_salt
        if salt is None:
            return None
        return self._roots.setdefault(salt, BlockKey(None, ()))

    def cached_prefix(self, request: Request) -> CachedPrefix:
        bs = self.block_size
        limit = (request.num_tokens - 1) // bs  # whole blocks, and never the last token
        if limit <= 0 or (request.pooling is not None and request.pooling.reads_every_position):
            return NO_PREFIX
        tokens = request.token_ids(0, limit * bs)
        parent, block_ids, keys = self._root(request), [], []
        for start in range(0, limit * bs, bs):
            hit = self.pool.lookup(parent, tuple(tokens[start : start + bs]))
            if hit is None:
                break
            block, parent = hit
            block_ids.append(block)
            keys.append(parent)
        if not block_ids:
            return NO_PREFIX
        return CachedPrefix(tuple(block_ids), tuple(keys), len(block_ids) * bs)

    def can_admit(
        self, request_id: str, num_tokens: int, keep_watermark: bool = True, prefix: CachedPrefix = NO_PREFIX
    ) -> bool:
        reserve = self.watermark_blocks if keep_watermark else 0
        new_blocks = blocks_for_tokens(num_tokens, self.block_size) - len(prefix.block_ids)
        # A hit on a cached block that nobody holds takes it out of the free count, as a new block would.
        return self.pool.can_take(max(new_blocks, 0) + self.pool.num_unreferenced(prefix.block_ids) + reserve)

    def can_admit_after_freeing(
        self, freed: list[str], request_id: str, num_tokens: int, keep_watermark: bool, prefix: CachedPrefix
    ) -> bool:
        reserve = self.watermark_blocks if keep_watermark else 0
        # A block comes free only when every reference to it goes: shared with a request that stays, it stays.
        references = Counter(block for victim in freed for block in self.block_tables.get(victim, ()))
        ref_counts = self.pool.ref_counts
        released = {block for block, n in references.items() if ref_counts[block] == n}
        new_blocks = max(blocks_for_tokens(num_tokens, self.block_size) - len(prefix.block_ids), 0)
        # A hit on a block nobody would hold takes it out of the free count, as in can_admit.
        unreferenced = sum(1 for block in prefix.block_ids if ref_counts[block] == 0 or block in released)
        return new_blocks + unreferenced + reserve <= self.pool.num_free + len(released)

    def admit(self, request: Request, num_tokens: int, prefix: CachedPrefix = NO_PREFIX) -> list[int] | None:
        request_id = request.request_id
        self.num_queries += request.num_tokens
        self.num_hits += prefix.num_tokens
        if prefix.block_ids:
            self.pool.acquire(prefix.block_ids)
            self.block_tables[request_id] = list(prefix.block_ids)
            self._num_tokens[request_id] = prefix.num_tokens
            self._used_slots += prefix.num_tokens
        self._chains[request_id] = list(prefix.keys)
        if request.private_after is not None and request_id not in self._index_all:
            self._held_back[request_id] = request
        if request.num_prompt_tokens // self.block_size > len(prefix.block_ids):
            self._filling[request_id] = request
        return self.grow_table(request_id, num_tokens)

    def prefix_in_flight(self, request: Request, prefix: CachedPrefix) -> bool:
        """Whether a running request is computing, now, the block that follows ``prefix`` in this request's
        prompt: its prompt has the same tokens up to that block's end, and the block is not indexed yet.

        Admitted now, this request would compute that block a second time, in the same step or the next
        chunk; admitted once the block is indexed, it finds it cached. The scheduler defers it.
        """
        end = prefix.num_tokens + self.block_size
        if end > request.num_tokens - 1:  # no full block left that admission could find cached
            return False
        wanted = None
        for other in self._prompts_filling():
            committed = self._num_committed(other.request_id)
            if other is request or committed > len(prefix.block_ids) or other.num_prompt_tokens < end:
                continue  # itself, past that block already (it would be cached), or too short to reach it
            if other.cache_salt == request.cache_salt:
                wanted = wanted if wanted is not None else request.token_ids(0, end)
                if other.token_ids(0, end) == wanted:
                    return True
        return False

    def _prompts_filling(self) -> list[Request]:
        """The requests on the device with full prompt blocks not yet indexed (forgetting those that are done;
        a swapped-out request computes nothing until it is back)."""
        for request_id, request in list(self._filling.items()):
            if request_id not in self._chains or (
                    self._num_committed(request_id) >= request.num_prompt_tokens // self.block_size):
                del self._filling[request_id]  # freed, or every full prompt block committed
        return [request for request_id, request in self._filling.items() if request_id in self.block_tables]

    def _num_committed(self, request_id: str) -> int:
        """The request's full blocks committed: indexed (its chain), or past it, held back and filled."""
        held = self._held_back.get(request_id)
        chain = len(self._chains[request_id])
        return chain if held is None else max(chain, held.num_computed_tokens // self.block_size)

    def holds_back(self, request_id: str) -> bool:
        """Whether the blocks the request fills from now on stay out of the index (no commit needs calling for
        them: the fast-forward's group skips those events)."""
        held = self._held_back.get(request_id)
        return held is not None and len(self._chains[request_id]) >= held.private_after // self.block_size

    def commit_computed(self, request: Request) -> None:
        """Index the full blocks the request has computed since the last call (those of its own tokens held back:
        indexed if it is ever preempted or swapped out)."""
        request_id = request.request_id
        chain = self._chains.get(request_id)
        if chain is None:
            return
        full = request.num_computed_tokens // self.block_size
        if request_id in self._held_back:  # only the blocks before its own tokens, once
            full = min(full, request.private_after // self.block_size)
        if full > len(chain):
            self._index(request, chain, full)

    def _index(self, request: Request, chain: list[BlockKey], end: int) -> None:
        """Index the request's blocks from the end of its chain up to block ``end``."""
        bs, done = self.block_size, len(chain)
        table = self.block_tables[request.request_id]
        parent = chain[-1] if chain else self._root(request)
        if end == done + 1:  # one block: every decode's block, and most chunks' (no second slice of the tokens)
            chain.append(self.pool.register(table[done], parent, tuple(request.token_ids(done * bs, end * bs))))
            return
        tokens = request.token_ids(done * bs, end * bs)
        for index in range(done, end):
            offset = (index - done) * bs
            parent = self.pool.register(table[index], parent, tuple(tokens[offset : offset + bs]))
            chain.append(parent)

    def _index_held(self, request_id: str) -> None:
        """The request leaves its blocks and may come back to look for them: index those held back, and from now
        on index its blocks as they fill."""
        request = self._held_back.pop(request_id)
        self._index(request, self._chains[request_id], request.num_computed_tokens // self.block_size)
        self._index_all[request_id] = request

    def free(self, request_id: str) -> None:
        held = self._held_back.get(request_id)
        if held is not None and held.status is RequestStatus.PREEMPTED:
            self._index_held(request_id)  # re-admitted, it looks for its blocks
        elif held is not None:  # it finishes: nobody will look for them
            del self._held_back[request_id]
            start = len(self._chains[request_id])
            self.pool.keep_unindexed(self.block_tables[request_id][start : held.num_computed_tokens // self.block_size])
        again = self._index_all.get(request_id)
        if again is not None and again.status is not RequestStatus.PREEMPTED:
            del self._index_all[request_id]
        self._chains.pop(request_id, None)
        super().free(request_id)

    def swap_out(self, request_id: str) -> list[tuple[int, int]] | None:
        if request_id in self._held_back:
            self._index_held(request_id)  # its blocks stay cached for whoever finds them, as they would indexed
        return super().swap_out(request_id)

    def _give_back(self, table: list[int]) -> None:
        self.pool.give_back(reversed(table))  # the tail first into the eviction queue: evicted first
