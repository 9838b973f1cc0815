"""Request-level (static) batching: the baseline that continuous batching replaces.

A batch is chosen from the waiting queue at one instant: up to
``max_num_seqs`` requests, as many as the free KV blocks can take prompts
for. Nothing joins until every member has finished. A member that finishes
early keeps its slot idle and its result waits for the batch to complete,
as in request-level serving systems. Everything else (token budget, chunked
prefill, preemption, the model and sampling) is shared with the continuous
scheduler, so a difference in the figures comes from the policy alone.
"""

from __future__ import annotations

from collections.abc import Mapping

from conveyor.core.kv import blocks_for_tokens
from conveyor.core.request import FinishReason, Request, RequestStatus
from conveyor.core.scheduler.continuous import Scheduler
from conveyor.core.scheduler.output import SchedulerOutput


class StaticScheduler(Scheduler):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._members: set[str] = set()  # the current batch's unfinished requests
        self._held: list[Request] = []  # finished members, delivered when the batch completes

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) or bool(self._held)

    def slot_holders(self) -> list[str]:
        """Running members, preempted members waiting to resume, and finished members held back."""
        swapped = sorted(self._members_in(RequestStatus.SWAPPED), key=self._order)
        waiting = sorted(self._members_in(RequestStatus.WAITING, RequestStatus.PREEMPTED), key=self._order)
        preempted = [r.request_id for r in swapped + waiting]
        return [r.request_id for r in self.running] + preempted + [r.request_id for r in self._held]

    def _next_to_admit(self) -> Request | None:
        """The first waiting member of the current batch (forming a new batch when the last one is done)."""
        if not self._members and not self._held:
            self._form_batch()
        if len(self._members) == len(self.running) + len(self.swapped):
            return None  # only members run or are swapped out, so none waits: no need to look through them
        # The queue is sorted by the policy's order, so its first member is the member first in that order.
        return min(self._members_in(RequestStatus.WAITING, RequestStatus.PREEMPTED), key=self._order, default=None)

    def _members_in(self, *statuses: RequestStatus) -> list[Request]:
        """Members with one of ``statuses``; found through the batch (at most max_num_seqs), not the queues."""
        return [r for r in map(self.requests.__getitem__, self._members) if r.status in statuses]

    def _form_batch(self) -> None:
        """Take the head of the queue, up to max_num_seqs, while their prompts fit in free blocks."""
        free = self.kv_manager.num_free_blocks
        for request in self.waiting:
            # In every KV group (one, unless windowed layers have their own: conveyor.core.kv.groups).
            need = blocks_for_tokens(request.num_tokens + 1, self.kv_manager.block_size) * self.kv_manager.num_groups
            if len(self._members) == self.config.max_num_seqs or (need > free and self._members):
                break
            free -= need
            self._members.add(request.request_id)

    def update(self, output: SchedulerOutput, sampled_token_ids: dict[str, int],
               accepted_drafts: Mapping[str, int] | None = None) -> list[Request]:
        delivered: list[Request] = []
        for request in super().update(output, sampled_token_ids, accepted_drafts):
            if request.is_finished:
                self._held.append(request)  # held back until the batch completes
            else:
                delivered.append(request)
        if not self._members and self._held:
            now = self.clock()
            for request in self._held:
                request.finish_time = now  # the caller sees the result only now
            delivered.extend(self._held)
            self._held = []
        return delivered

    def _finish(self, request: Request, reason: FinishReason, stop_reason: str | int | None = None) -> None:
        super()._finish(request, reason, stop_reason)
        self._members.discard(request.request_id)
