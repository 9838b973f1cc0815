"""The paged KV manager over KV groups: a block table per group and request, every group from one pool.

A windowed group's layers only ever read the last ``window`` positions, so once a request has computed
``n`` tokens (the next query sits at position ``n``), the blocks wholly before position ``n - window + 1``
are of no use to them: :meth:`GroupedKVCacheManager.release_behind_window` gives those back after each
step, leaving ``NULL_BLOCK`` in their entries. A step still takes blocks for every token it computes in
every group (a prompt chunk writes its K/V before attending), and gives back what fell behind right after.
So a request holds, in each windowed group, at most ``ceil((window - 1) / block_size) + 1`` blocks between
steps, and ``ceil((window - 1 + C) / block_size) + 1`` while a step computes ``C`` of its tokens; a full
group holds its whole context. Admission, growth, preemption and swap count every group's blocks.

Prefix caching is not combined with groups: a cached prefix is only of use with the windowed groups'
blocks of its last window, which this manager gives back. The engine therefore builds this manager only
with prefix caching off (``--no-enable-prefix-caching``); with it on, windowed layers keep their blocks
and attend through a mask, as before.
"""

from __future__ import annotations

from conveyor.core.kv.groups import NULL_BLOCK, KVLayout
from conveyor.core.kv.paged import MemoryReport, PagedKVCacheManager, blocks_for_tokens
from conveyor.core.request import Request

Tables = tuple[list[int], ...]


def blocks_behind(num_computed: int, window: int, block_size: int) -> int:
    """Leading blocks no query from position ``num_computed`` on reads with a window of ``window``."""
    behind = (num_computed - window + 1) // block_size
    return behind if behind > 0 else 0


def _live(tables: Tables) -> list[int]:
    return [block for table in tables for block in table if block != NULL_BLOCK]


def _mapped(tables: Tables, new_ids: list[int]) -> Tables:
    """``tables`` with their live blocks replaced, in order, by ``new_ids`` (a swap's other side)."""
    ids = iter(new_ids)
    return tuple([NULL_BLOCK if block == NULL_BLOCK else next(ids) for block in table] for table in tables)


class GroupedKVCacheManager(PagedKVCacheManager):
    """One table per KV group and request; ``block_tables`` holds group 0's, as for one group.

    Tables are replaced, never changed in place (a release writes a new list too), so a step's output may
    hold them uncopied. ``num_blocks`` counts group blocks: each is ``layers_per_group`` layers' K/V.
    """

    def __init__(self, num_blocks: int, block_size: int, layout: KVLayout, watermark: float = 0.01,
                 num_cpu_blocks: int = 0) -> None:
        super().__init__(num_blocks, block_size, watermark, num_cpu_blocks)
        self.layout = layout
        self.num_groups = layout.num_groups
        self.windowed = layout.windowed
        self._windows = [(g, window) for g, window in enumerate(layout.windows) if window is not None]
        self.group_tables: dict[str, Tables] = {}
        self.cpu_group_tables: dict[str, Tables] = {}
        self._behind: dict[str, list[int]] = {}  # per request and group: leading entries given back
        self._num_behind = 0  # their sum over the requests on the device (their slots are used no more)

    @property
    def capacity_tokens(self) -> int:
        """Tokens one request could hold if every group kept them all: what max_model_len is checked against."""
        return self.pool.num_blocks // self.num_groups * self.block_size

    def group_block_ids(self, request_id: str) -> Tables:
        return self.group_tables.get(request_id, ())

    def _device_blocks(self, request_id: str) -> list[int]:
        return _live(self.group_tables.get(request_id, ()))

    def _extra_blocks(self, request_id: str, num_tokens: int) -> int:
        # Every group's table has the same length (entries behind a window included): each lacks as many.
        return self.num_groups * super()._extra_blocks(request_id, num_tokens)

    def _grow(self, request_id: str, num_tokens: int) -> list[int] | None:
        counted = self._num_tokens.get(request_id, 0) if request_id in self.block_tables else 0
        tables = self.group_tables.get(request_id) or tuple([] for _ in range(self.num_groups))
        extra = blocks_for_tokens(num_tokens, self.block_size) - len(tables[0])
        if extra > 0:
            if not self.pool.can_take(extra * self.num_groups):
                return None
            taken = self.pool.take(extra * self.num_groups)
            tables = tuple(table + taken[g * extra : (g + 1) * extra] for g, table in enumerate(tables))
        self.group_tables[request_id] = tables
        self._behind.setdefault(request_id, [0] * self.num_groups)
        self.block_tables[request_id] = tables[0]
        self._used_slots += num_tokens - counted
        self._num_tokens[request_id] = num_tokens
        return tables[0]

    def trim_table(self, request_id: str, num_tokens: int) -> None:
        """Count only ``num_tokens`` slots as used; the blocks past them stay with the request (every group's
        table keeps one length, which windows rely on), to be filled by its next tokens."""
        self._used_slots += num_tokens - self._num_tokens[request_id]
        self._num_tokens[request_id] = num_tokens

    def release_behind_window(self, request: Request) -> None:
        """Give back each windowed group's blocks that the request's next query (at ``num_computed_tokens``)
        and every later one no longer read."""
        request_id = request.request_id
        tables = self.group_tables.get(request_id)
        if tables is None:
            return
        behind, freed, new_tables = self._behind[request_id], [], list(tables)
        for g, window in self._windows:
            target = min(blocks_behind(request.num_computed_tokens, window, self.block_size), len(tables[g]))
            if target > behind[g]:
                freed += tables[g][behind[g] : target]
                new_tables[g] = [NULL_BLOCK] * target + tables[g][target:]
                self._num_behind += target - behind[g]
                behind[g] = target
        if freed:
            self.group_tables[request_id] = tables = tuple(new_tables)
            self.block_tables[request_id] = tables[0]
            self._give_back(freed)

    def free(self, request_id: str) -> None:
        tables = self.group_tables.pop(request_id, None)
        behind = self._behind.pop(request_id, None)
        if tables is not None and behind is not None:
            self._num_behind -= sum(behind)
        self._drop_table(request_id)
        self._num_tokens.pop(request_id, None)
        if tables:
            self._give_back(_live(tables))
        self.cpu_block_tables.pop(request_id, None)
        cpu_tables = self.cpu_group_tables.pop(request_id, None)
        if cpu_tables:
            self.cpu_pool.give_back(_live(cpu_tables))

    def reserved_and_used_slots(self, uncounted_slots: int = 0) -> tuple[int, int]:
        """Slots count in every group: a token's K/V lies once in each group that still holds it."""
        reserved, _ = super().reserved_and_used_slots()
        return reserved, self.num_groups * (self._used_slots + uncounted_slots) - self.block_size * self._num_behind

    def memory_report(self, uncounted_slots: int = 0) -> MemoryReport:
        report = super().memory_report()
        reserved, used = self.reserved_and_used_slots(uncounted_slots)
        return MemoryReport(self.pool.num_blocks * self.block_size, reserved, used, report.unusable_free_slots,
                            report.num_requests)

    # ----- swap: every group's live blocks, the entries behind a window staying NULL ------------------

    def swap_out(self, request_id: str) -> list[tuple[int, int]] | None:
        tables = self.group_tables.get(request_id, ())
        live = _live(tables)
        if self.cpu_pool is None or len(live) > self.cpu_pool.num_free:
            return None
        cpu_live = self.cpu_pool.take(len(live))
        self.group_tables.pop(request_id, None)
        self._drop_table(request_id)
        self._give_back(live)
        self._num_behind -= sum(self._behind.get(request_id, ()))
        self.cpu_group_tables[request_id] = _mapped(tables, cpu_live)
        self.cpu_block_tables[request_id] = cpu_live
        return list(zip(live, cpu_live))

    def can_swap_in(self, request_id: str, num_tokens: int, keep_watermark: bool = True, headroom: int = 0) -> bool:
        cpu_tables = self.cpu_group_tables.get(request_id) or ([],)
        grow = max(blocks_for_tokens(num_tokens, self.block_size) - len(cpu_tables[0]), 0) * self.num_groups
        reserve = self.watermark_blocks if keep_watermark else 0
        return self.pool.can_take(grow + len(_live(cpu_tables)) + max(reserve, headroom))

    def swap_in(self, request_id: str) -> list[tuple[int, int]]:
        cpu_tables = self.cpu_group_tables.pop(request_id)
        self.cpu_block_tables.pop(request_id, None)
        cpu_live = _live(cpu_tables)
        device = self.pool.take(len(cpu_live))
        self.cpu_pool.give_back(cpu_live)
        tables = _mapped(cpu_tables, device)
        self.group_tables[request_id] = tables
        self.block_tables[request_id] = tables[0]
        self._used_slots += self._num_tokens.get(request_id, 0)
        self._num_behind += sum(self._behind.get(request_id, ()))
        return list(zip(cpu_live, device))
