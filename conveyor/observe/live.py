"""The engine's state as it changes, for the live dashboard: step records and the deltas of a compact snapshot.

After each step the recorder keeps the step's trace record (the schema of
:mod:`conveyor.observe.trace`) and notes which requests the step touched.
Publishing (at most every ``min_interval`` seconds, so the steps in between
are coalesced) turns only those requests into rows: the work is proportional
to what changed, not to the number of requests or blocks. Block tables travel
inside the step records as changes (``kv_blocks``); a new watcher starts from a
keyframe, the one message that carries everything.

Deltas are plain dicts and lists, never changed after they are made, so the
thread that runs the engine builds them and another thread may encode them.
Pure Python: the simulator could publish the same stream.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from conveyor.core.request import Request, RequestStatus
from conveyor.core.scheduler import Scheduler, SchedulerOutput
from conveyor.observe.figures import percentile
from conveyor.observe.trace import StepRecord, StepRecorder, step_as_dict

if TYPE_CHECKING:
    from conveyor.core.engine_core import EngineCore

THROUGHPUT_WINDOW_S = 10.0  # tokens/s over the steps that ended this recently
LATENCY_WINDOW_S = 60.0  # TTFT and TPOT percentiles over the requests that finished this recently
HISTORY_STEPS = 600  # steps a new watcher gets, so its timeline does not start empty
MAX_PENDING_STEPS = 5000  # a watcher further behind than this gets a fresh keyframe instead
TEXT_CHARS = 200  # prompt text shown per request, when the server shows text at all


class LiveRecorder:
    """Step records and touched requests of one engine, turned into deltas on demand (``flush``)."""

    def __init__(
        self,
        scheduler: Scheduler,
        clock: Callable[[], float],
        config: dict[str, Any],
        show_text: bool = False,
        min_interval: float = 0.1,
    ) -> None:
        self._scheduler = scheduler
        self._kv = scheduler.kv_manager
        self._speculator = scheduler.speculator  # speculative decoding's, for each request's drafts; None without
        self._clock = clock
        self.origin = clock()
        self.config = config
        self.show_text = show_text
        self.min_interval = min_interval
        # Seeded with the tables held now, so a watcher sees the blocks of requests that run without a change.
        self._steps = StepRecorder(self.origin, self._kv.block_tables, keep_released=True)
        self._pending: list[StepRecord] = []
        self._history: deque[StepRecord] = deque(maxlen=HISTORY_STEPS)
        self._touched: set[str] = set()
        self._tokens: deque[tuple[float, int, int]] = deque()  # (step end, output tokens, tokens computed)
        self._latencies: deque[tuple[float, float, float | None]] = deque()  # (finish, TTFT, TPOT)
        self._last_flush = float("-inf")

    # ----- fed by the engine core, on the engine's thread ------------------------------

    def on_add(self, request_id: str) -> None:
        self._touched.add(request_id)

    def on_abort(self, request_id: str) -> None:
        """Its table is released by the next step's record (or by the next flush, if no step comes first)."""
        self._touched.add(request_id)

    def after_step(
        self, output: SchedulerOutput, slots: list[str], updated: list[Request], start: float, end: float,
        accepted: Mapping[str, int] | None = None,
    ) -> None:
        """``accepted``: drafts accepted by request, in a step that carried drafts (speculative decoding)."""
        finished = [r.request_id for r in updated if r.is_finished]
        step = self._steps.record(output, slots, finished, start, end, accepted)
        self._pending.append(step)
        self._history.append(step)
        touched = self._touched
        touched.update(step.scheduled)
        touched.update(output.preempted_request_ids)
        touched.update(output.finished_request_ids)
        touched.update(finished)
        num_sampled = sum(1 for item in output.scheduled if item.draws_token)
        self._tokens.append((end, num_sampled, sum(step.scheduled.values())))
        for request in updated:
            if request.is_finished and request.finish_reason != "abort":
                self._latencies.append(_latency_sample(request))

    # ----- publishing -------------------------------------------------------------

    def due(self) -> bool:
        """Whether a delta is waiting and the rate limit allows sending it now."""
        return bool(self._pending or self._touched) and self._clock() - self._last_flush >= self.min_interval

    def has_pending(self) -> bool:
        return bool(self._pending or self._touched)

    def flush(self) -> dict[str, Any]:
        """What changed since the previous flush: the steps, the touched requests' rows, released blocks."""
        now = self._last_flush = self._clock()
        requests, rows, removed, cpu_blocks, released = self._scheduler.requests, {}, [], {}, []
        for request_id in self._touched:
            request = requests.get(request_id)
            if request is None:
                removed.append(request_id)
                if self._steps.tables.release(request_id):  # left between steps (an abort), no step since
                    released.append(request_id)
                continue
            rows[request_id] = self._row(request)
            if request.status is RequestStatus.SWAPPED:
                cpu_blocks[request_id] = self._kv.cpu_block_tables.get(request_id, [])
        is_evictable = self._kv.is_evictable
        evictable = [block for block in self._steps.tables.drain_released() if is_evictable(block)]
        delta = {
            "keyframe": False, "time": now - self.origin, "steps": self._pending, "requests": rows,
            "removed": removed, "kv_released": released, "cpu_blocks": cpu_blocks, "evictable": evictable,
            **self._figures(now),
        }
        self._pending, self._touched = [], set()
        return delta

    def keyframe(self) -> dict[str, Any]:
        """Everything a new watcher needs: every request, every held table, recent steps, the config."""
        now = self._clock()
        requests = self._scheduler.requests
        tables = {request_id: [0, *table] for request_id, table in self._steps.tables.tables.items()}
        history = list(self._history)
        return {
            "keyframe": True, "time": now - self.origin, "config": self.config,
            "tables_step": history[-1].step if history else 0,  # the tables include every step up to this one
            "steps": history, "requests": {rid: self._row(r) for rid, r in requests.items()}, "removed": [],
            "kv_released": [],
            "tables": tables, "cpu_blocks": {rid: list(t) for rid, t in self._kv.cpu_block_tables.items()},
            "evictable": self._kv.evictable_block_ids(), **self._figures(now),
        }

    def _row(self, request: Request) -> dict[str, Any]:
        """One request as the dashboard's table shows it: ids and lengths, text only when the server allows."""
        num_output = len(request.output_token_ids)
        row = {
            "status": request.status.value, "prompt": len(request.prompt_token_ids), "output": num_output,
            "computed": request.num_computed_tokens, "max_tokens": request.sampling_params.max_tokens,
            "remaining": request.tokens_left(self._scheduler.config.max_model_len), "priority": request.priority,
            "order": request.arrival_order, "preemptions": request.num_preemptions,
            "cached": request.num_cached_tokens, "arrival": request.arrival_time - self.origin,
            "ttft": None if request.first_token_time is None else request.first_token_time - request.arrival_time,
        }
        if self._speculator is not None:
            row["drafted"], row["accepted"] = self._speculator.request_counts(request.request_id)
        if self.show_text and request.prompt_text is not None:
            row["text"] = request.prompt_text[:TEXT_CHARS]
        return row

    def _figures(self, now: float) -> dict[str, Any]:
        """The engine's counters, and throughput and latency over sliding windows."""
        tokens, latencies = self._tokens, self._latencies
        while tokens and tokens[0][0] < now - THROUGHPUT_WINDOW_S:
            tokens.popleft()
        while latencies and latencies[0][0] < now - LATENCY_WINDOW_S:
            latencies.popleft()
        span = (now - tokens[0][0]) if len(tokens) > 1 else 0.0
        ttft = [sample[1] for sample in latencies]
        tpot = [sample[2] for sample in latencies if sample[2] is not None]
        window = {
            "output_tokens_per_s": sum(t[1] for t in tokens) / span if span else 0.0,
            "total_tokens_per_s": sum(t[2] for t in tokens) / span if span else 0.0,
            "finished": len(latencies),
        }
        for name, values in (("ttft", ttft), ("tpot", tpot)):
            for q in (50, 90, 99):
                window[f"{name}_p{q}_s"] = percentile(values, q) if values else None
        return {"stats": asdict(self._scheduler.stats()), "window": window}


def _latency_sample(request: Request) -> tuple[float, float, float | None]:
    finish = request.finish_time or 0.0
    first = request.first_token_time if request.first_token_time is not None else finish
    num_output = len(request.output_token_ids)
    tpot = (finish - first) / (num_output - 1) if num_output > 1 else None
    return finish, first - request.arrival_time, tpot


def merge_deltas(older: dict[str, Any], newer: dict[str, Any]) -> bool:
    """Fold ``newer`` into ``older`` (a watcher's own shallow copy, not read yet); False if too far behind.

    ``older`` may be a keyframe: it stays one, with the newer steps' table changes applied on top by the
    reader (they come after its ``tables_step``).
    """
    if len(older["steps"]) + len(newer["steps"]) > MAX_PENDING_STEPS:
        return False
    older["steps"] = [*older["steps"], *newer["steps"]]
    gone = set(newer["removed"])
    # New containers, never the old ones changed: a delta is shared by every watcher it was sent to.
    older["requests"] = {rid: row for rid, row in older["requests"].items() if rid not in gone} | newer["requests"]
    older["cpu_blocks"] = {rid: t for rid, t in older["cpu_blocks"].items() if rid not in gone} | newer["cpu_blocks"]
    older["removed"] = [*older["removed"], *newer["removed"]]
    older["kv_released"] = [*older["kv_released"], *newer["kv_released"]]
    older["evictable"] = [*older["evictable"], *newer["evictable"]]
    for name in ("time", "stats", "window"):
        older[name] = newer[name]
    return True


def delta_as_json_ready(delta: dict[str, Any]) -> dict[str, Any]:
    """The delta with its step records as plain dicts, for ``json.dumps`` (on any thread)."""
    return {**delta, "steps": [step_as_dict(step) for step in delta["steps"]]}


def start_live(core: EngineCore, show_text: bool = False, min_interval: float = 0.1) -> LiveRecorder:
    """Keep what a live dashboard needs of ``core`` from now on, until ``core.unwatch`` of the recorder."""
    return core.watch(LiveRecorder(core.scheduler, core.clock, core.trace_header(), show_text, min_interval))
