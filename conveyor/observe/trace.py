"""The scheduler's decisions, step by step, as JSON lines: what the pictures and checks read.

The first line is a header (``{"config": ...}``) naming the policy and its
limits; each further line is one step. Pure Python, so the real engine and a
simulator write the same format.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from conveyor.core.request import Request
from conveyor.core.scheduler.output import SchedulerOutput

if TYPE_CHECKING:
    from conveyor.core.engine_core import EngineCore


@dataclass(slots=True)
class StepRecord:
    step: int
    start: float  # seconds since the trace began
    end: float
    scheduled: dict[str, int]  # request id -> tokens computed this step
    slots: list[str]  # requests holding a batch slot during the step, busy or idle
    finished: list[str]
    preempted: list[str]
    num_waiting: int
    num_running: int
    kv_usage: float
    num_swapped: int = 0
    blocks_swapped_in: int = 0
    blocks_swapped_out: int = 0
    kv_reserved_slots: int = 0
    kv_used_slots: int = 0
    kv_unusable_free_slots: int = 0
    kv_shared_slots: int = 0  # slots that prefix caching's shared blocks save
    kv_cached_free_slots: int = 0  # free slots still holding a cached prefix
    cached: dict[str, int] = field(default_factory=dict)  # admitted this step with cached tokens: id -> tokens
    # Block tables that changed in this step: id -> [first changed index, the block ids from there on].
    # A table that grew by one block is [old length, new block]; a released one (finished, preempted,
    # aborted) is [0]. Replaying these from the first step rebuilds every request's table at every step.
    kv_blocks: dict[str, list[int]] = field(default_factory=dict)
    # Speculative decoding: requests that carried drafts this step -> drafts, and -> how many were accepted.
    drafts: dict[str, int] = field(default_factory=dict)
    accepted: dict[str, int] = field(default_factory=dict)


class BlockTableChanges:
    """Which requests' block tables changed since the previous step, and how: what ``StepRecord.kv_blocks`` holds.

    The KV manager replaces a table when it grows (never changes it in place), and the scheduler hands the
    table itself to the step's output, so a table that did not change is the same object as last step's:
    one identity check per scheduled request finds the changes, and a grown table costs only its new blocks.
    """

    def __init__(self, tables: dict[str, list[int]] | None = None, keep_released: bool = False) -> None:
        self.tables: dict[str, list[int]] = dict(tables or {})  # each holder's table, as last recorded
        self._keep_released = keep_released
        self.released: list[list[int]] = []  # tables given up since the last drain (kept when asked for)

    def record(self, output: SchedulerOutput, finished: list[str]) -> dict[str, list[int]]:
        changes: dict[str, list[int]] = {}
        for request_id in output.finished_request_ids:  # ended since the previous step, aborts included
            self._release(request_id, changes)
        for request_id in output.preempted_request_ids:
            self._release(request_id, changes)
        tables = self.tables
        for item in output.scheduled:
            table, old = item.block_ids, tables.get(item.request_id)
            if table is old:
                continue
            start = len(old) if old is not None and table[: len(old)] == old else 0
            tables[item.request_id] = table
            changes[item.request_id] = [start, *table[start:]]
        for request_id in finished:
            self._release(request_id, changes)
        return changes

    def release(self, request_id: str) -> bool:
        """Forget a request that left between steps (an abort); whether it held a table."""
        return self._release(request_id, {})

    def _release(self, request_id: str, changes: dict[str, list[int]]) -> bool:
        table = self.tables.pop(request_id, None)
        if table is None:
            return False
        changes[request_id] = [0]
        if self._keep_released:
            self.released.append(table)
        return True

    def drain_released(self) -> list[int]:
        """The block ids of the tables released since the last call."""
        blocks = [block for table in self.released for block in table]
        self.released = []
        return blocks


class StepRecorder:
    """Turns each step's decision into a StepRecord: times from its own origin, table changes since its start."""

    def __init__(self, origin: float, tables: dict[str, list[int]] | None = None, keep_released: bool = False):
        self.origin = origin
        self.tables = BlockTableChanges(tables, keep_released)

    def record(
        self, output: SchedulerOutput, slots: list[str], finished: list[str], start: float, end: float,
        accepted: Mapping[str, int] | None = None,
    ) -> StepRecord:
        """``accepted``: drafts accepted by request, in a step that carried drafts."""
        return StepRecord(
            step=output.step,
            start=start - self.origin,
            end=end - self.origin,
            scheduled={s.request_id: s.num_scheduled_tokens for s in output.scheduled},
            slots=slots,
            finished=finished,
            preempted=list(output.preempted_request_ids),
            num_waiting=output.num_waiting,
            num_running=output.num_running,
            num_swapped=output.num_swapped,
            blocks_swapped_in=len(output.blocks_to_swap_in),
            blocks_swapped_out=len(output.blocks_to_swap_out),
            kv_usage=round(output.kv_usage, 5),
            cached=dict(output.cached_tokens),
            kv_blocks=self.tables.record(output, finished),
            **_memory_fields(output),
            **_draft_fields(output, accepted),
        )


def step_as_dict(step: StepRecord) -> dict[str, Any]:
    """A record as the JSON line writes it (a shallow copy: its dicts and lists are shared, never changed)."""
    return {name: getattr(step, name) for name in _STEP_FIELDS}


def _draft_fields(output: SchedulerOutput, accepted: Mapping[str, int] | None) -> dict[str, dict[str, int]]:
    if not output.num_draft_tokens:
        return {}
    drafts = {s.request_id: s.num_draft_tokens for s in output.scheduled if s.num_draft_tokens}
    return {"drafts": drafts, "accepted": {r: accepted[r] for r in drafts if r in accepted} if accepted else {}}


def _memory_fields(output: SchedulerOutput) -> dict[str, int]:
    memory = output.memory
    if memory is None:
        return {}
    return {
        "kv_reserved_slots": memory.reserved_slots,
        "kv_used_slots": memory.used_slots,
        "kv_unusable_free_slots": memory.unusable_free_slots,
        "kv_shared_slots": memory.shared_slots,
        "kv_cached_free_slots": memory.cached_free_slots,
    }


@dataclass(slots=True)
class Trace:
    config: dict[str, Any]
    origin: float
    steps: list[StepRecord] = field(default_factory=list)
    recorder: StepRecorder | None = field(default=None, repr=False, compare=False)

    def record(
        self, output: SchedulerOutput, slots: list[str], finished: list[str], start: float, end: float,
        accepted: Mapping[str, int] | None = None,
    ) -> StepRecord:
        if self.recorder is None:
            self.recorder = StepRecorder(self.origin)
        step = self.recorder.record(output, slots, finished, start, end, accepted)
        self.steps.append(step)
        return step

    # ----- a StepWatcher of the core (conveyor.core.engine_core) -----

    def on_add(self, request_id: str) -> None:
        """Requests enter the trace when first scheduled."""

    def on_abort(self, request_id: str) -> None:
        """An abort shows in the next step's record."""

    def after_step(self, output: SchedulerOutput, slots: list[str], updated: list[Request], start: float,
                   end: float, accepted: Mapping[str, int] | None = None) -> None:
        self.record(output, slots, [r.request_id for r in updated if r.is_finished], start, end, accepted)

    def write(self, path: str | Path) -> None:
        with open(path, "w") as f:
            f.write(json.dumps({"config": self.config}) + "\n")
            for step in self.steps:
                f.write(json.dumps(step_as_dict(step)) + "\n")

    @classmethod
    def read(cls, path: str | Path) -> Trace:
        with open(path) as f:
            lines = [json.loads(line) for line in f if line.strip()]
        if not lines or "config" not in lines[0]:
            raise ValueError(f"trace: {path} does not start with a config header line")
        return cls(lines[0]["config"], 0.0, [StepRecord(**line) for line in lines[1:]])

    def peak_running(self) -> int:
        return max((step.num_running for step in self.steps), default=0)

    def mean_kv_waste(self) -> float:
        """Share of reserved KV slots that held no token, averaged over the steps that reserved any."""
        shares = [1 - s.kv_used_slots / s.kv_reserved_slots for s in self.steps if s.kv_reserved_slots]
        return sum(shares) / len(shares) if shares else 0.0

    def slot_fill(self) -> tuple[list[list[bool | None]], float]:
        """Rows = batch slots, columns = steps: True busy, False held but idle, None empty.

        Also returns the idle fraction: the share of slot-steps (``max_num_seqs`` x steps) that did no work.
        """
        num_slots = self.config["max_num_seqs"]
        owner: dict[str, int] = {}
        grid: list[list[bool | None]] = [[None] * len(self.steps) for _ in range(num_slots)]
        busy = 0
        for col, step in enumerate(self.steps):
            holding = set(step.slots)
            for request_id in [r for r in owner if r not in holding]:
                del owner[request_id]
            free = sorted(set(range(num_slots)) - set(owner.values()), reverse=True)
            for request_id in step.slots:
                if request_id not in owner:
                    owner[request_id] = free.pop()
                working = request_id in step.scheduled
                grid[owner[request_id]][col] = working
                busy += working
        total = num_slots * len(self.steps)
        return grid, (1 - busy / total) if total else 0.0


_STEP_FIELDS = tuple(f.name for f in fields(StepRecord))


def start_trace(core: EngineCore) -> Trace:
    """Record every step of ``core`` from now on."""
    return core.watch(Trace(core.trace_header(), core.clock()))
