"""Decodes advanced as a group: the simulator's fast-forward, exact to the step.

A long simulated run spends nine tenths of its time visiting every running request in every step: its
share of the step, its block table, its token, its stop check. Yet once a request only decodes, and the
token it draws is known (the simulator's executor always draws the same one, and a request ends at its
drawn output length), its future is fixed until something happens to it: it computes one token a step,
needs a new block every ``block_size`` steps, fills one (which prefix caching indexes) every
``block_size`` steps, and ends at a step known from the moment it starts decoding. Such a request joins
the *group*: its state is left as it was when it joined, and what it does is done only at its events
(a block taken, a block indexed, its finish), in the order the step-by-step loop would have done them.
A step then costs the other requests' work and the group's events, not a visit per running request.

Every decision a step makes is still the scheduler's own: admission reads the real pool, queues and
``max_num_seqs``; the group only replaces the loop over decodes whose outcome is known. Where it would not be
known (the token budget would not reach every decode, a request is swapped out), the group leaves
first: each member's state is brought up to date and the step runs exactly as the plain scheduler runs
it. A pool that runs short is met in the running queue's order, as the plain loop meets it: the request
short of a block preempts from the back, and a member among the victims leaves the group first. The
results are therefore identical to stepping one request at a time: every request's tokens, times and
blocks, every step's figures and trace (``listed`` expands a step's group into the requests it stands
for). The tests hold it to that.

Only the simulator uses this (``EngineCore(fast_forward_token=...)``): the real engine must run every
request through the model. It applies where a decode's step has no side effect beyond the request
itself: the policy keeps no per-token accounts and preempts nobody for a newcomer (fcfs, lpm), steps are
not timed, one prompt is computed at a time, and the KV layout has one group (no sliding windows).
Elsewhere the scheduler behaves exactly as ``Scheduler``.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from conveyor.core.kv import MemoryReport, PagedKVCacheManager
from conveyor.core.request import FinishReason, Request, RequestStatus
from conveyor.core.scheduler.config import SchedulerConfig
from conveyor.core.scheduler.continuous import Scheduler
from conveyor.core.scheduler.items import num_new_tokens, scheduled_request
from conveyor.core.scheduler.output import ScheduledRequest, SchedulerOutput
from conveyor.core.scheduler.policies import SchedulingPolicy

GROUP_PAUSE_STEPS = 16  # after the group had to leave (a swap, a budget short of it), steps before joining again


@dataclass(frozen=True, slots=True)
class GroupStep:
    """A step of the group alone: its decodes, the keys they attend to in all, the KV slots reserved and used
    after its blocks were taken (``MemoryReport``'s two figures of the same names), and the block references
    beyond the first (prefix caching's sharing: with every holder of a block decoding in the step, the reads
    of a block that an earlier decode of the step made too, ``StepWork.shared_decode_blocks``)."""

    num_decodes: int
    context: int
    reserved_slots: int
    used_slots: int
    shared_blocks: int = 0


class _Member:
    """A decoding request in the group, and its coming events as step numbers (``SchedulerOutput.step``).

    It joined after step ``k`` with ``t`` tokens (prompt and output) and ``o`` output tokens; in a later
    step ``m`` it computes position ``end(m) - 1`` with ``end(m) = context_base + m``, and after that step
    it has ``output_base + m`` output tokens.
    """

    __slots__ = ("alive", "context_base", "finish", "key", "next_alloc", "next_commit", "output_base", "request",
                 "synced")

    def __init__(self, request: Request, key: tuple, step: int, finish: int, table_slots: int,
                 block_size: int, indexes_blocks: bool) -> None:
        self.request = request
        self.key = key  # the policy's order: events of one step happen in the running queue's order
        self.context_base = request.num_tokens - 1 - step
        self.output_base = len(request.output_token_ids) - step
        self.finish = finish
        self.synced = request.num_tokens - 1  # the tokens the KV manager counts for it (brought up at events)
        self.alive = True
        # Its next block is taken in the step whose end passes the table's last slot, then every block_size steps.
        self.next_alloc = table_slots - self.context_base + 1
        # It fills a block (end a multiple of the block size) every block_size steps; only prefix caching cares,
        # and only where it indexes the request's blocks as they fill (PagedKVCacheManager.holds_back).
        first_fill = step + 1 + (-(self.context_base + step + 1)) % block_size
        self.next_commit = first_fill if indexes_blocks else finish + 1

    def end(self, step: int) -> int:
        return self.context_base + step


_BY_KEY = operator.attrgetter("key")  # members sort in the running queue's order


class FastForwardScheduler(Scheduler):
    """The continuous scheduler, with the running requests whose decodes are determined advanced as a group."""

    def __init__(self, config: SchedulerConfig, kv_manager: PagedKVCacheManager,
                 clock: Callable[[], float], decode_token: int) -> None:
        """``decode_token``: the token every decode draws (the simulated executor's)."""
        super().__init__(config, kv_manager, clock)
        policy = type(self.policy)
        self.decode_token = decode_token
        # Where a decode's step touches more than the request itself, the group would not be exact: stay plain.
        self.fast_forward = (
            self.prefills is None and not self.times_steps and self._victims_from_back
            and policy.on_tokens is SchedulingPolicy.on_tokens and policy.victims_for is SchedulingPolicy.victims_for
            and kv_manager.num_groups == 1 and not kv_manager.windowed
        )
        self._members: dict[str, _Member] = {}
        self._context_base = 0  # sum of the members' context_base: their context in step m is this + n m
        self._synced = 0  # sum of the members' synced tokens: the KV manager's used slots lag the truth by the rest
        self._allocs: dict[int, list[_Member]] = {}  # step -> members that take a block in it
        self._commits: dict[int, list[_Member]] = {}  # step -> members that fill a block in it (prefix caching)
        self._finishes: dict[int, list[_Member]] = {}  # step -> members that end in it
        self._num_loop_items = 0  # this step's requests scheduled by the running loop (those after were admitted)
        self._paused_until = 0  # no joining before this step (the whole group just had to leave)
        self.num_grouped_decodes = 0  # decodes advanced as a group, over the run
        self.num_listed_decodes = 0  # and those visited one by one
        self.num_group_steps = 0  # steps of the group alone (advance_group), run without an output

    # ----- a step ----------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        step = self.step_index + 1
        self._num_loop_items = 0
        if self._members and not self._group_can_advance(step):
            self._leave_all()
            self._paused_until = step + GROUP_PAUSE_STEPS
        output = super().schedule()
        num_grouped = len(self._members)  # less any the step preempted
        if num_grouped:
            output.num_grouped_decodes = num_grouped
            output.grouped_decode_context = self._group_context(step)
            self.num_grouped_decodes += num_grouped
        return output

    def _memory_report(self) -> MemoryReport:
        """The manager counts each member's tokens as of its last event: the group adds the rest (``schedule``
        asks once it has numbered the step)."""
        return self.kv_manager.memory_report(uncounted_slots=self._group_context(self.step_index) - self._synced)

    def _group_context(self, step: int) -> int:
        """The keys the members attend to in ``step``, all told (the sum of their ``end(step)``)."""
        return self._context_base + len(self._members) * step

    def _schedule_running(self, budget: int, drafts: dict[str, list[int]] | None = None,
                          ) -> tuple[list[ScheduledRequest], int]:
        """The running loop: members take their one token (and, at their events, a block) without a visit. (No
        drafts here: speculative decoding runs the plain scheduler, see build_scheduler.)"""
        if not self._members:
            scheduled, budget = super()._schedule_running(budget)
        elif len(self.running) == len(self._members) and self._pool_has_the_blocks(self.step_index + 1):
            step = self.step_index + 1  # decodes only, and nobody is preempted: the group's blocks, in order
            self._take_blocks(self._due(self._allocs, step), step)
            scheduled, budget = [], budget - len(self._members)
        else:
            scheduled, budget = self._schedule_in_order(budget)
        self._num_loop_items = len(scheduled)
        self.num_listed_decodes += sum(1 for item in scheduled if len(item.token_ids) == 1)
        return scheduled, budget

    def _schedule_in_order(self, budget: int) -> tuple[list[ScheduledRequest], int]:
        """The plain loop over the running queue, members and other requests side by side (a prompt chunk or a
        recompute under way, or a pool that may run short): members take their token and, when due, their
        block; a request the pool is short for preempts from the back (members among the victims leave the
        group first), as the plain loop does. ``_group_can_advance`` checked that the budget reaches every
        member."""
        step = self.step_index + 1
        due = {member.request.request_id: member for member in self._due(self._allocs, step)}
        members, grow_table = self._members, self.kv_manager.grow_table
        scheduled: list[ScheduledRequest] = []
        for request in self.running:  # victims leave from the back: the loop never meets one
            if budget <= 0:
                break
            request_id = request.request_id
            member = members.get(request_id)
            num_new = 1 if member is not None else num_new_tokens(request, budget)
            end = member.end(step) if member is not None else request.num_computed_tokens + num_new
            block_ids = grow_table(request_id, end) if member is None or request_id in due else True
            if block_ids is None:  # the pool is short
                block_ids, refund = self._make_room(request, end, scheduled)
                budget += refund
                if block_ids is None:
                    break  # the request preempted itself: it was the back of the queue
            if member is not None:
                if request_id in due:  # grow_table counted its tokens up to end
                    self._synced += end - member.synced
                    member.synced = end
                    self._next_block(member, step)
            else:
                scheduled.append(scheduled_request(request, num_new, block_ids))
            budget -= num_new
        return scheduled, budget

    def _group_can_advance(self, step: int) -> bool:
        """Whether the step can run with the group as it is: nobody swapped out (resuming reads every running
        request's length), and the budget reaches every member in the running loop's order. (A pool that runs
        short is met in order, as the plain loop meets it: see ``_schedule_in_order``.)"""
        if self.swapped:
            return False
        members, budget = self._members, self.config.max_num_batched_tokens
        if len(self.running) == len(members):
            return len(members) <= budget
        running = self.running
        for index, request in enumerate(running):  # the running loop's budget, played out without taking anything
            if budget <= 0:  # the loop stops here: fine unless a member is left unserved
                return not any(r.request_id in members for r in running[index:])
            budget -= 1 if request.request_id in members else num_new_tokens(request, budget)
        return True

    def _pool_has_the_blocks(self, step: int) -> bool:
        """Whether the pool has the block of every member due one in ``step`` (one each: _Member.next_alloc)."""
        return sum(1 for m in self._allocs.get(step, ()) if m.alive) <= self.kv_manager.num_free_blocks

    def update(self, output: SchedulerOutput, sampled_token_ids: dict[str, int],
               accepted_drafts: Mapping[str, int] | None = None) -> list[Request]:
        """The listed requests as the plain scheduler updates them, the members' events of this step merged in
        the running queue's order; then every request that now only decodes joins the group. (``accepted_drafts``
        is always empty: no drafts here, see _schedule_running.)"""
        updated: list[Request] = []
        if not output.num_grouped_decodes:
            self._update_items(output.scheduled, sampled_token_ids, updated)
        else:
            step, loop_items = output.step, output.scheduled[: self._num_loop_items]
            events = self._step_events(step)
            for item in loop_items:  # few: prompt chunks or recomputes under way beside the group
                request = self.requests.get(item.request_id)
                if request is not None:  # (an aborted one is skipped by _update_items)
                    key = self._order(request)
                    while events and events[0].key < key:
                        self._member_event(events.pop(0), step, updated)
                self._update_items([item], sampled_token_ids, updated)
            for member in events:
                self._member_event(member, step, updated)
            self._update_items(output.scheduled[self._num_loop_items :], sampled_token_ids, updated)
            self.num_generation_tokens += output.num_grouped_decodes
        self.policy.on_tokens(updated)
        if self.fast_forward and output.step >= self._paused_until and not self.swapped:
            for request in updated:
                if request.status is RequestStatus.RUNNING and request.request_id not in self._members:
                    self._join(request, output.step)
        return updated

    # ----- steps of the group alone: no output, no listing (the simulator's loop between events) -----------

    def group_step_ready(self) -> bool:
        """Whether the next step holds the group alone and can advance it: nothing waits or is swapped out,
        every running request is a member, and the pool has the blocks the step takes."""
        step = self.step_index + 1
        return (bool(self._members) and not self.waiting and not self.swapped
                and len(self.running) == len(self._members) and self._group_can_advance(step)
                and self._pool_has_the_blocks(step))

    def advance_group(self) -> GroupStep:
        """The scheduling half of such a step (``group_step_ready``): the step numbered, its blocks taken.
        What ``schedule`` would decide, without building the output nobody reads."""
        self._finished_since_last_step = []  # handed to the executor with this step, as schedule does
        self._num_loop_items = 0
        step = self.step_index = self.step_index + 1
        self._take_blocks(self._due(self._allocs, step), step)
        num_decodes = len(self._members)
        self.num_grouped_decodes += num_decodes
        self.num_group_steps += 1
        context, kv = self._group_context(step), self.kv_manager
        return GroupStep(num_decodes, context, *kv.reserved_and_used_slots(context - self._synced),
                         kv.num_shared_slots // kv.block_size)

    def finish_group_step(self) -> list[Request]:
        """The update half: the members' events of the step in the running queue's order; the requests that
        finished in it."""
        step, finished = self.step_index, []
        self.num_generation_tokens += len(self._members)
        # Indexing a block and giving a finished request's blocks back commute (neither reads what the other
        # changes), so each kind keeps its own order and the two need no merging.
        commits = self._due(self._commits, step)
        if commits:
            self._commit_all(commits, step)
        for member in self._due(self._finishes, step):
            self._end(member, step, finished)
        return finished

    def listed(self, output: SchedulerOutput) -> SchedulerOutput:
        """The step with its group expanded into the requests it stands for, as the plain scheduler lists them:
        the running loop's in the running queue's order, then the admitted. Called right after ``schedule``."""
        if not output.num_grouped_decodes:
            return output
        step, token = output.step, self.decode_token
        loop = {item.request_id: item for item in output.scheduled[: self._num_loop_items]}
        listed: list[ScheduledRequest] = []
        for request in self.running:
            member = self._members.get(request.request_id)
            if member is not None:
                start = member.end(step) - 1
                listed.append(ScheduledRequest(
                    request.request_id, start, [token], self.kv_manager.block_ids(request.request_id),
                    request.sampling_params, True, member.output_base + step - 1, request.prompt_token_ids,
                    request.output_token_ids, request.eos_token_id))
            elif request.request_id in loop:
                listed.append(loop[request.request_id])
        listed.extend(output.scheduled[self._num_loop_items :])
        return dataclasses.replace(output, scheduled=listed, num_grouped_decodes=0, grouped_decode_context=0)

    # ----- the group's events ---------------------------------------------------

    def _join(self, request: Request, step: int) -> None:
        """The request has just drawn a token after step ``step`` and only decodes from now on."""
        finish = step + self._steps_to_finish(request)
        table_slots = len(self.kv_manager.block_ids(request.request_id)) * self.kv_manager.block_size
        kv = self.kv_manager  # prefix caching indexes the blocks it fills, unless it holds them back
        indexes = not kv.holds_back(request.request_id)  # (and without prefix caching, none are indexed)
        member = _Member(request, self._order(request), step, finish, table_slots, kv.block_size, indexes)
        # The tokens it will have drawn by its finish, written now (cut back if it leaves the group before): the
        # group owns the request meanwhile, and its commits read them.
        request.output_token_ids.extend([self.decode_token] * (finish - step))
        self._members[request.request_id] = member
        self._context_base += member.context_base
        self._synced += member.synced
        self._finishes.setdefault(finish, []).append(member)
        if member.next_alloc <= finish:
            self._allocs.setdefault(member.next_alloc, []).append(member)
        if member.next_commit <= finish:
            self._commits.setdefault(member.next_commit, []).append(member)

    def _steps_to_finish(self, request: Request) -> int:
        """Steps until the request ends, drawing ``decode_token`` each step (``_check_stop``'s rules)."""
        params, token = request.sampling_params, self.decode_token
        if (token == request.eos_token_id and not params.ignore_eos) or token in params.stop_token_ids:
            return 1
        return max(1, request.tokens_left(self.config.max_model_len))

    @staticmethod
    def _due(events: dict[int, list[_Member]], step: int) -> list[_Member]:
        """The members whose event of this kind falls in ``step``, in the running queue's order."""
        members = events.pop(step, None)
        if not members:
            return []
        if len(members) == 1:
            return members if members[0].alive else []
        return sorted((m for m in members if m.alive), key=_BY_KEY)

    def _step_events(self, step: int) -> list[_Member]:
        """The members' update events of ``step`` in the running queue's order (a member filling a block in
        the step it ends appears twice: its commit first, as sorting is stable)."""
        commits, finishes = self._due(self._commits, step), self._due(self._finishes, step)
        if not commits or not finishes:
            return commits or finishes
        return sorted(commits + finishes, key=_BY_KEY)

    def _sync(self, member: _Member, step: int) -> None:
        """Bring the KV manager's count of the member's tokens up to ``end(step)`` (a block too when due)."""
        end = member.end(step)
        self.kv_manager.grow_table(member.request.request_id, end)
        self._synced += end - member.synced
        member.synced = end

    def _take_blocks(self, members: list[_Member], step: int) -> None:
        """The next block of each of these members in ``step``, in their order: the step holds nobody else."""
        if not members:
            return
        self.kv_manager.append_blocks([member.request.request_id for member in members])
        later = step + self.kv_manager.block_size
        going_on = []
        for member in members:
            member.next_alloc = later
            if later <= member.finish:
                going_on.append(member)
        if going_on:
            self._allocs.setdefault(later, []).extend(going_on)

    def _next_block(self, member: _Member, step: int) -> None:
        member.next_alloc = step + self.kv_manager.block_size
        if member.next_alloc <= member.finish:
            self._allocs.setdefault(member.next_alloc, []).append(member)

    def _member_event(self, member: _Member, step: int, updated: list[Request]) -> None:
        """A member's event in this step's update: it filled a block (indexed), or it ends."""
        if member.next_commit == step:
            self._commit_all([member], step)
        else:
            self._end(member, step, updated)

    def _commit_all(self, members: list[_Member], step: int) -> None:
        """These members filled a block in ``step``: prefix caching indexes them, in order (the lookups hoisted:
        every decode fills a block every block_size steps, so this runs for a sixteenth of the group)."""
        commit, later = self.kv_manager.commit_computed, step + self.kv_manager.block_size
        going_on = []
        for member in members:
            request = member.request
            request.num_computed_tokens = member.end(step)
            commit(request)
            member.next_commit = later
            if later <= member.finish:
                going_on.append(member)
        if going_on:
            self._commits.setdefault(later, []).extend(going_on)

    def _end(self, member: _Member, step: int, updated: list[Request]) -> None:
        """The member draws its last token in ``step``."""
        request = member.request
        request.num_computed_tokens = member.end(step)
        self._sync(member, step)
        self._remove(member)
        reason, stop_reason = self._check_stop(request, self.decode_token)
        if reason is None:  # _steps_to_finish and _check_stop disagree: a bug, never a request left running
            raise RuntimeError(f"request {request.request_id} was to finish in step {step} and did not")
        updated.append(request)
        self.running.remove(request)
        self._finish(request, reason, stop_reason)

    def _remove(self, member: _Member) -> None:
        member.alive = False
        del self._members[member.request.request_id]
        self._context_base -= member.context_base
        self._synced -= member.synced

    def _leave(self, member: _Member) -> None:
        """The member leaves the group between steps, its request brought up to date (after the last step)."""
        step, request = self.step_index, member.request
        request.num_computed_tokens = member.end(step)
        del request.output_token_ids[member.output_base + step :]  # the tokens not drawn yet
        self._sync(member, step)
        self._remove(member)

    def _leave_all(self) -> None:
        for member in list(self._members.values()):
            self._leave(member)
        self._allocs.clear()
        self._commits.clear()
        self._finishes.clear()

    # ----- whatever acts on one request leaves it out of the group first ------------------

    def abort_request(self, request_id: str, reason: FinishReason = FinishReason.ABORT) -> Request | None:
        if (member := self._members.get(request_id)) is not None:
            self._leave(member)
        return super().abort_request(request_id, reason)

    def finish_request(self, request_id: str, reason: FinishReason, stop_reason: str | int | None = None,
                       num_output_tokens: int | None = None) -> None:
        if (member := self._members.get(request_id)) is not None:
            self._leave(member)
        super().finish_request(request_id, reason, stop_reason, num_output_tokens)

    def _preempt(self, request: Request) -> None:
        if (member := self._members.get(request.request_id)) is not None:
            self._leave(member)
        super()._preempt(request)
