"""Iteration-level (continuous) batching, as in Orca and vLLM.

Every step: serve the running requests first, oldest first, each with the
tokens it still lacks; then admit waiting requests in arrival order while
the KV pool, ``max_num_seqs`` and the step's token budget allow. A request
that finishes leaves after the step in which it finished, and its blocks
return to the pool at once, so a waiting request joins on the very next step.

When a running request needs a block and the pool is empty, the policy
names a victim (most: the running request last in their order, for fcfs the
most recent arrival; slo: the one that can best afford it), which is
preempted. By recompute, its KV is dropped and it goes back to the front of
the waiting queue, to be prefilled again later (prompt and output so far). By
swap, its blocks are copied to a CPU pool and it waits in the swapped queue;
swapped and waiting requests are then taken in the policy's order (a swapped
request resumes only when it and the running batch have room to go on, so it
is not swapped straight out again). When the CPU pool is full, that victim
falls back to recompute.

This class is the step's mechanics only. What differs between policies (the
order of the queues, whom to admit next, whom to preempt for a newcomer) is
a policy object (``policies/``), and what becomes of a victim's KV is a
preemption mode object (``preemption.py``), both chosen once at construction.
Whether a new request may join the queue at all (queue caps, deadlines) is
admission control's (``admission.py``), judged as it arrives.

With speculative decoding (``conveyor.core.spec``), a running request that
decodes may carry drafts: its last token and the drafts take the step's
budget and slots together, never at anyone's expense (no draft preempts), and
``update`` keeps the accepted drafts and the drawn token, one by one with the
stop rules, and gives back the slots of the rejected ones.
"""

from __future__ import annotations

import bisect
import logging
import math
import time
from collections.abc import Callable, Mapping

from conveyor.core.config import engine_option
from conveyor.core.errors import RequestRefused
from conveyor.core.kv import CachedPrefix, MemoryReport, PagedKVCacheManager
from conveyor.core.request import FinishReason, Request, RequestStatus, check_prompt_length
from conveyor.core.scheduler.admission import AdmissionControl, AdmissionView, margins
from conveyor.core.scheduler.config import SchedulerConfig
from conveyor.core.scheduler.items import num_new_tokens, scheduled_request, unschedule, with_drafts
from conveyor.core.scheduler.output import ScheduledRequest, SchedulerOutput
from conveyor.core.scheduler.policies import SchedulingPolicy, make_policy
from conveyor.core.scheduler.preemption import PreemptionMode, make_preemption
from conveyor.core.scheduler.prefill import PartialPrefills
from conveyor.core.scheduler.step_times import StepTimes
from conveyor.core.spec import Speculator
from conveyor.core.stats import EngineStats

POLICIES = engine_option("scheduling_policy").choices
PREEMPTION_MODES = engine_option("preemption_mode").choices
logger = logging.getLogger("conveyor.core.scheduler")


class Scheduler:
    """Decides, step by step, which requests run and how many tokens each computes."""

    def __init__(
        self,
        config: SchedulerConfig,
        kv_manager: PagedKVCacheManager,
        clock: Callable[[], float] = time.monotonic,
        policy: SchedulingPolicy | None = None,
        preemption: PreemptionMode | None = None,
        step_times: StepTimes | None = None,
        speculator: Speculator | None = None,
    ) -> None:
        """``policy`` and ``preemption`` default to the ones ``config`` names; ``step_times`` (what steps
        measured to cost: the slo policy and admission control read it) to a fresh one. ``speculator``:
        speculative decoding's drafts (conveyor.core.spec); None: none."""
        if config.max_model_len > kv_manager.capacity_tokens:
            # Otherwise a request alone in the engine could need more blocks than exist, and never finish.
            raise ValueError(
                f"max_model_len {config.max_model_len} is more than the KV cache holds "
                f"({kv_manager.capacity_tokens} tokens)"
            )
        self.config = config
        self.kv_manager = kv_manager
        self.clock = clock
        self.requests: dict[str, Request] = {}
        self.step_times = step_times if step_times is not None else StepTimes()
        self.policy = policy or make_policy(config.policy, kv_manager, config.tenant_weights, clock,
                                            self.step_times, config.max_num_batched_tokens)
        self.preemption = preemption or make_preemption(config.preemption_mode)
        self.admission = AdmissionControl(
            config.max_num_queued_requests, config.max_num_queued_tokens, config.admission_control,
            config.ttft_slo, config.tpot_slo, config.tenant_cache_salt, config.max_num_batched_tokens)
        # Steps are timed only where something reads the times (they cost a sum over the step's requests).
        self.times_steps = config.admission_control or self.policy.uses_step_times
        self.speculator = speculator
        # The base policy preempts for memory from the back of the running queue, which the loop over it has
        # not reached yet; a policy that picks elsewhere makes the loop run over a copy and skip its victims.
        self._victims_from_back = type(self.policy).memory_victim is SchedulingPolicy.memory_victim
        self.num_queued_tokens = 0  # tokens of the waiting queue's requests (prompt and output so far)
        self._admitted_tokens = 0  # of those, taken in by this step's admissions (the drain rates count them)
        self._admitted_requests = 0
        # Every queue is kept sorted by the policy's order: waiting is admitted from the front; running is
        # served from the front and preempted from the back.
        self._order = self.policy.order
        self.prefills = PartialPrefills.from_limits(
            config.max_num_partial_prefills, config.max_long_partial_prefills, config.long_prefill_token_threshold,
            config.max_num_batched_tokens, config.max_model_len)
        # Tokens one request may take in a step: the whole budget, or with partial prefills a prefill's share.
        self._chunk_cap = config.max_num_batched_tokens if self.prefills is None else self.prefills.chunk_cap
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.swapped: list[Request] = []
        self._finished_since_last_step: list[str] = []
        self._cached_this_step: dict[str, int] = {}  # admitted this step with a prefix-cache hit: tokens
        self._deferred: set[str] = set()  # waiting requests passed over in this step (their prefix is in flight)
        self._preempted_this_step: list[str] = []
        self._swap_out: list[tuple[int, int]] = []
        self.step_index = 0
        self.num_preemptions = 0
        self.num_swaps_out = 0
        self.num_prompt_tokens = 0  # prompts of the sequences that got their first token (vLLM: prompt_tokens)
        self.num_generation_tokens = 0  # tokens drawn
        self.num_failed_steps = 0
        self._num_added = 0

    @property
    def num_swap_fallbacks(self) -> int:
        """Swaps that found the CPU pool full and recomputed instead."""
        return self.preemption.num_fallbacks

    # ----- queue management -------------------------------------------------

    def add_request(self, request: Request, check_admission: bool = True) -> None:
        """Queue a request, with the default targets it lacks and its tenant's cache salt. RequestRefused if
        admission control turns it away (``check_admission`` False: the caller judged it already, as the
        server does before handing it over, or it belongs to a request already admitted)."""
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in the engine")
        check_prompt_length(request.num_tokens, self.config.max_model_len, request.pooling is not None)
        self.admission.prepare(request)
        if check_admission and self.admission.active and (refused := self.refusal(request)) is not None:
            raise refused
        request.arrival_order = self._num_added
        self._num_added += 1
        self.requests[request.request_id] = request
        self._enqueue_waiting(request)
        self.policy.on_arrival(request)

    def admission_view(self) -> AdmissionView:
        """What admission control reads of the queue and the step times now, as a frozen copy (the server's
        thread judges newcomers by the latest one while the loop runs the next step)."""
        times = self.step_times
        rates, keyed = (times.drain_rate, times.request_drain_rate), self.policy.queue_keys()
        queue = (len(self.waiting), self.num_queued_tokens, len(self.running), times.line(), *rates)
        if keyed is None:
            return AdmissionView(*queue)
        keys, sums = keyed
        spare = margins(keys, sums, self.clock(), *rates) if self.admission.check_deadlines else (math.inf,) * len(sums)
        return AdmissionView(*queue, keys, sums, spare)

    def refusal(self, request: Request, view: AdmissionView | None = None,
                pending: tuple[int, int] = (0, 0)) -> RequestRefused | None:
        """Why admission control would turn ``request`` away now (None: it would not), judged on ``view`` (the
        queue as it is when None). With a view, any thread may ask: nothing of the scheduler's is read but its
        immutable rules, the clock and the policy's pure ``admission_key``."""
        view = self.admission_view() if view is None else view
        self.admission.apply_targets(request)  # the defaults count: the request is not shared yet
        key = self.policy.admission_key(request, view.step_line)
        return self.admission.refusal(request, view, self.clock(), key, pending)

    def _enqueue_waiting(self, request: Request) -> None:
        bisect.insort(self.waiting, request, key=self._order)
        self.num_queued_tokens += request.num_tokens

    def _dequeue_waiting(self, request: Request) -> None:
        self.waiting.remove(request)
        self.num_queued_tokens -= request.num_tokens

    def abort_request(self, request_id: str, reason: FinishReason = FinishReason.ABORT) -> Request | None:
        """End a request wherever it is; its blocks return to the pool at once."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        queue = {RequestStatus.RUNNING: self.running, RequestStatus.SWAPPED: self.swapped}.get(
            request.status, self.waiting
        )
        if queue is self.waiting:
            self._dequeue_waiting(request)
        else:
            queue.remove(request)
        if queue is not self.running:
            self.policy.on_dequeued(request, queue is self.swapped, first_admission=False)
        self._finish(request, reason)
        return request

    def fail_step(self, output: SchedulerOutput, message: str) -> list[Request]:
        """The executor raised while carrying out ``output``: end, with an error, every request whose KV the
        step may have left half written (those it computed or swapped in, and those it swapped out); the
        others never took part and go on. Returns the requests ended."""
        self.num_failed_steps += 1
        ids = [s.request_id for s in output.scheduled]
        if output.blocks_to_swap_out:  # their CPU copies may be incomplete
            ids += [i for i in output.preempted_request_ids if i in self.requests and
                    self.requests[i].status is RequestStatus.SWAPPED]
        failed = []
        for request_id in ids:
            request = self.requests.get(request_id)
            if request is not None:
                request.error = message
                failed.append(self.abort_request(request_id, FinishReason.ERROR))
        return failed

    def finish_request(self, request_id: str, reason: FinishReason, stop_reason: str | int | None = None,
                       num_output_tokens: int | None = None) -> None:
        """End a running request for a reason found outside the scheduler (a stop string in its text);
        ``num_output_tokens``: the output ends there (a step that accepted drafts may have added tokens past
        the one that completed the stop string)."""
        request = self.requests.get(request_id)
        if request is None or request.status is not RequestStatus.RUNNING:
            raise ValueError(f"request {request_id!r} is not running")
        if num_output_tokens is not None:
            self.num_generation_tokens -= request.cut_output(num_output_tokens)
        self.running.remove(request)
        self._finish(request, reason, stop_reason)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def slot_holders(self) -> list[str]:
        """Requests that occupy a batch slot now (running ones); the trace draws them."""
        return [r.request_id for r in self.running]

    def stats(self) -> EngineStats:
        """The queues, the KV pools and the counters, as a frozen snapshot."""
        kv = self.kv_manager
        return EngineStats(
            step=self.step_index,
            num_waiting=len(self.waiting),
            num_running=len(self.running),
            num_swapped=len(self.swapped),
            num_kv_blocks=kv.num_blocks,
            num_free_kv_blocks=kv.num_free_blocks,
            kv_usage=kv.usage,
            num_cpu_blocks=kv.num_cpu_blocks,
            num_free_cpu_blocks=kv.num_free_cpu_blocks,
            num_preemptions=self.num_preemptions,
            num_swaps_out=self.num_swaps_out,
            num_swap_fallbacks=self.num_swap_fallbacks,
            num_cached_free_kv_blocks=kv.num_cached_free_blocks,
            prefix_cache_queries=kv.num_queries,
            prefix_cache_hits=kv.num_hits,
            prompt_tokens=self.num_prompt_tokens,
            generation_tokens=self.num_generation_tokens,
            num_failed_steps=self.num_failed_steps,
            tenants=self.policy.tenant_report(),
            **(self.speculator.stats.engine_stats_fields() if self.speculator is not None else {}),
        )

    # ----- one step ---------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        self._preempted_this_step = preempted = []
        self._swap_out = []
        self._admitted_tokens = self._admitted_requests = 0
        swap_in: list[tuple[int, int]] = []
        budget = self.config.max_num_batched_tokens
        drafts = self.speculator.drafts(self.running, budget) if self.speculator is not None and self.running else None
        scheduled, budget = self._schedule_running(budget, drafts)

        # vLLM's rule: admit nobody in a step that had to preempt for memory, or
        # the newcomer would take the blocks just freed and cause the next preemption.
        if not preempted:
            self.policy.start_admission()
            self._deferred = set()
            if self.prefills is not None:
                self.prefills.count_under_way(self.running, {s.request_id: s.num_scheduled_tokens for s in scheduled})
            # The policy may hold some of the budget back (slo: to keep the step short for the running).
            allowed = self.policy.admission_tokens(budget, self.config.max_num_batched_tokens - budget, self.running)
            self._resume_or_admit(allowed, scheduled, swap_in)
        if self.kv_manager.num_groups > 1:
            self._add_group_tables(scheduled)

        self.step_index += 1
        output = SchedulerOutput(
            step=self.step_index,
            scheduled=scheduled,
            preempted_request_ids=preempted,
            finished_request_ids=self._finished_since_last_step,
            blocks_to_swap_in=swap_in,
            blocks_to_swap_out=self._swap_out,
            num_waiting=len(self.waiting),
            num_running=len(self.running),
            num_swapped=len(self.swapped),
            kv_usage=self.kv_manager.usage,
            memory=self._memory_report(),
            cached_tokens=self._cached_this_step,
            num_draft_tokens=sum(s.num_draft_tokens for s in scheduled) if drafts else 0,
        )
        self._finished_since_last_step = []
        self._cached_this_step = {}
        return output

    def _memory_report(self) -> MemoryReport:
        """The KV pool as this step's allocations left it (the fast-forward adds its group's tokens)."""
        return self.kv_manager.memory_report()

    def listed(self, output: SchedulerOutput) -> SchedulerOutput:
        """The step with every request it serves listed, as a trace records it (call right after ``schedule``):
        ``output`` itself here; the simulator's fast-forward expands its group of decodes (fast_forward.py)."""
        return output

    def _add_group_tables(self, scheduled: list[ScheduledRequest]) -> None:
        """Hand the executor every KV group's table of each scheduled request, as this step left them (a table
        is replaced, never changed, so these are the step's own)."""
        group_block_ids = self.kv_manager.group_block_ids
        for item in scheduled:
            item.group_block_ids = group_block_ids(item.request_id)

    def _schedule_running(self, budget: int, drafts: dict[str, list[int]] | None = None,
                          ) -> tuple[list[ScheduledRequest], int]:
        """Serve the running requests, oldest first, each with the tokens it lacks; the budget left.

        The one loop over every running request in every step, so a visit costs little: most are
        decodes that need one token and no new block, for which ``grow_table`` only checks a length.
        Where victims come from the back of the running queue and no prefill share caps a request's
        tokens (the defaults), the loop never meets a preempted request and never caps: it runs without
        either check (the simulator's long runs spend a third of their time here).

        ``drafts``: speculative decoding's, by request: a decode carries its drafts where the budget and the
        pool allow them (they never preempt anyone: a request the pool cannot give their blocks decodes
        without them).
        """
        if not drafts and self._victims_from_back and self._chunk_cap >= self.config.max_num_batched_tokens:
            return self._schedule_running_plain(budget)
        scheduled: list[ScheduledRequest] = []
        grow_table = self.kv_manager.grow_table
        cap = self._chunk_cap
        running = RequestStatus.RUNNING
        # A policy that preempts elsewhere than the back needs the loop over a copy, whose victims it skips.
        for request in self.running if self._victims_from_back else list(self.running):
            if budget <= 0:
                break
            if request.status is not running:
                continue  # preempted earlier in this loop
            allowed = budget if budget < cap else cap
            num_new = num_new_tokens(request, allowed)
            if drafts and num_new == 1 and (item := with_drafts(request, drafts, allowed, grow_table)) is not None:
                scheduled.append(item)
                budget -= item.num_scheduled_tokens
                continue
            end = request.num_computed_tokens + num_new
            block_ids = grow_table(request.request_id, end)
            if block_ids is None:  # the pool is short
                block_ids, refund = self._make_room(request, end, scheduled)
                budget += refund
                if block_ids is None:
                    continue  # the request preempted itself
            scheduled.append(scheduled_request(request, num_new, block_ids))
            budget -= num_new
        return scheduled, budget

    def _schedule_running_plain(self, budget: int) -> tuple[list[ScheduledRequest], int]:
        """_schedule_running where preemption takes from the back and nothing caps a request's tokens."""
        scheduled: list[ScheduledRequest] = []
        grow_table = self.kv_manager.grow_table
        for request in self.running:
            if budget <= 0:
                break
            num_new = num_new_tokens(request, budget)
            end = request.num_computed_tokens + num_new
            block_ids = grow_table(request.request_id, end)
            if block_ids is None:  # the pool is short
                block_ids, refund = self._make_room(request, end, scheduled)
                budget += refund
                if block_ids is None:
                    break  # the request preempted itself: it was the back of the queue
            scheduled.append(scheduled_request(request, num_new, block_ids))
            budget -= num_new
        return scheduled, budget

    def _make_room(self, request: Request, num_tokens: int,
                   scheduled: list[ScheduledRequest]) -> tuple[list[int] | None, int]:
        """Grow the request's block table, preempting the policy's victims (for most, later arrivals) until it
        fits; the table (None if the request had to preempt itself), and the tokens of this step that victims
        already scheduled give back to the budget."""
        refund = 0
        while (block_ids := self.kv_manager.grow_table(request.request_id, num_tokens)) is None:
            victim = self.policy.memory_victim(self.running, request)
            refund += unschedule(victim, scheduled)
            self._preempt(victim)
            if victim is request:
                return None, refund
        return block_ids, refund

    def _resume_or_admit(self, budget: int, scheduled: list[ScheduledRequest], swap_in: list[tuple[int, int]]) -> int:
        """Swapped and waiting requests as the policy ranks them (by its order: a swapped request ahead of the
        next waiting one resumes first, a more important waiting one is admitted first); the first that cannot
        go on stops both (nobody overtakes)."""
        while budget > 0:
            request = self._next_to_admit()
            resuming = self.policy.next_to_resume(self.swapped) if self.swapped else None
            if resuming is not None and self.policy.resumes_before(resuming, request):
                taken = self._resume(resuming, budget, scheduled, swap_in)
            elif request is not None:
                taken = self._admit_next(request, budget, scheduled)
            else:
                break
            if taken is None:
                break
            budget -= taken
        return budget

    def _resume(
        self, request: Request, budget: int, scheduled: list[ScheduledRequest], swap_in: list[tuple[int, int]]
    ) -> int | None:
        """Swap the request back in; the tokens it takes from the budget, or None if it must wait.

        It waits until it and the running batch have room to go on (see ``_blocks_to_go_on``): resumed without
        that room, it would be the first victim of a coming step, swapped out and in again for nothing.
        """
        if len(self.running) >= self.config.max_num_seqs:
            return None
        lacking = request.num_tokens - request.num_computed_tokens
        num_new = num_new_tokens(request, budget if budget < self._chunk_cap else self._chunk_cap)
        if self.prefills is not None and not self.prefills.has_place(request, lacking, num_new):
            return None
        end = request.num_computed_tokens + num_new
        kv = self.kv_manager
        # Room to go on: the rest of its prompt if it is still computing it, and one more token, for it and for
        # each running request.
        headroom = self._blocks_to_go_on()
        if not kv.can_swap_in(request.request_id, request.num_tokens + 1, bool(self.running), headroom=headroom):
            return None
        swap_in.extend(kv.swap_in(request.request_id))
        block_ids = kv.grow_table(request.request_id, end)
        self.swapped.remove(request)
        self.policy.on_dequeued(request, swapped=True, first_admission=False)
        if self.prefills is not None:
            self.prefills.started(request, lacking, num_new)
        request.status = RequestStatus.RUNNING
        bisect.insort(self.running, request, key=self._order)
        scheduled.append(scheduled_request(request, num_new, block_ids))
        return num_new

    def _blocks_to_go_on(self) -> int:
        """Blocks the running requests still need to finish their prompts and take one more token each."""
        blocks_to_grow = self.kv_manager.blocks_to_grow  # every KV group's
        return sum(blocks_to_grow(r.request_id, r.num_tokens + 1) for r in self.running)

    def _next_to_admit(self) -> Request | None:
        """The waiting request admission considers next: the policy's choice (the static scheduler's own)."""
        return self.policy.next_to_admit(self.waiting, self._deferred)

    def _admit_next(self, request: Request, budget: int, scheduled: list[ScheduledRequest]) -> int | None:
        """Admit the waiting request (the priority policy may preempt for it); the tokens it takes from the
        budget (less those given back by its victims), or None if it must wait."""
        prefix = self.kv_manager.cached_prefix(request)  # its leading blocks already in the prefix cache
        if self.kv_manager.prefix_in_flight(request, prefix):
            # Another request computes more of this prompt's prefix right now: wait until it is cached rather
            # than compute it twice. Later requests may be admitted meanwhile.
            self._deferred.add(request.request_id)
            return 0
        lacking = request.num_tokens - prefix.num_tokens
        num_new = min(lacking, budget, self._chunk_cap)
        if self.prefills is not None and not self.prefills.has_place(request, lacking, num_new):
            return self._wait_for_a_prefill_place(request)
        end = prefix.num_tokens + num_new
        refund = 0
        if not self._fits(request, end, prefix):
            victims = self._victims_for(request, end, prefix)
            if victims is None:
                return None  # nobody overtakes the head of the queue
            refund = self._preempt_for(request, victims, scheduled)
            if not self._fits(request, end, prefix):  # _victims_for said it would: a bug, but never a crash
                logger.error("preempted %s for %s, which still does not fit", victims, request.request_id)
                return None
        block_ids = self._admit(request, end, prefix)
        if self.prefills is not None:
            self.prefills.started(request, lacking, num_new)
        scheduled.append(scheduled_request(request, num_new, block_ids))
        return num_new - refund

    def _wait_for_a_prefill_place(self, request: Request) -> int | None:
        """The partial-prefill caps are full: later requests may overtake this one (0: passed over this step)
        until it has aged, and then nobody does (None: admission stops at it)."""
        if self.prefills is not None and self.prefills.pass_over(request):
            self._deferred.add(request.request_id)
            return 0
        return None

    def _fits(self, request: Request, num_slots: int, prefix: CachedPrefix) -> bool:
        if len(self.running) >= self.config.max_num_seqs:
            return False
        # The watermark only matters when someone else could be preempted for it.
        return self.kv_manager.can_admit(request.request_id, num_slots, bool(self.running), prefix)

    def _admit(self, request: Request, num_tokens: int, prefix: CachedPrefix) -> list[int]:
        """Move a waiting request to running with slots for ``num_tokens`` tokens, the cached ``prefix`` first."""
        block_ids = self.kv_manager.admit(request, num_tokens, prefix)
        request.num_computed_tokens = prefix.num_tokens
        first_admission = request.first_scheduled_time is None
        if first_admission:
            request.first_scheduled_time = self.clock()
            request.num_cached_tokens = prefix.num_tokens
        if prefix.num_tokens:
            self._cached_this_step[request.request_id] = prefix.num_tokens
        self._dequeue_waiting(request)
        self._admitted_tokens += request.num_tokens
        self._admitted_requests += 1
        self.policy.on_dequeued(request, swapped=False, first_admission=first_admission)
        request.status = RequestStatus.RUNNING
        bisect.insort(self.running, request, key=self._order)
        return block_ids

    def _victims_for(self, request: Request, num_slots: int, prefix: CachedPrefix) -> list[Request] | None:
        """The running requests the policy would preempt for ``request``, each set checked here against memory
        and ``max_num_seqs``; None when the policy preempts nobody for it."""

        def frees_enough(victims: list[Request]) -> bool:
            remaining = len(self.running) - len(victims)
            return remaining < self.config.max_num_seqs and self.kv_manager.can_admit_after_freeing(
                [v.request_id for v in victims], request.request_id, num_slots, remaining > 0, prefix
            )

        return self.policy.victims_for(request, self.running, self.step_index, frees_enough)

    def _preempt_for(self, request: Request, victims: list[Request], scheduled: list[ScheduledRequest]) -> int:
        """Preempt ``victims`` for ``request``; the tokens they had been given this step (back to the budget)."""
        refund = 0
        for victim in victims:
            refund += unschedule(victim, scheduled)
            self._preempt(victim)
            victim.last_preempted_by = (request.request_id, self.step_index)
        return refund

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._preempted_this_step.append(request.request_id)
        pairs = self.preemption.swap_out(self.kv_manager, request)
        if pairs is not None:
            self._swap_out.extend(pairs)
            self.num_swaps_out += 1
            request.status = RequestStatus.SWAPPED
            bisect.insort(self.swapped, request, key=self._order)
            self.policy.on_queued(request, swapped=True)
            return
        request.status = RequestStatus.PREEMPTED  # before its blocks go: prefix caching asks who comes back
        self.kv_manager.free(request.request_id)
        request.num_computed_tokens = 0
        self._enqueue_waiting(request)
        self.policy.on_queued(request, swapped=False)

    # ----- after the executor ran the step ----------------------------------

    def update(self, output: SchedulerOutput, sampled_token_ids: dict[str, int],
               accepted_drafts: Mapping[str, int] | None = None) -> list[Request]:
        """Record computed tokens and the token drawn for each sampling request; end the requests that are done.
        ``accepted_drafts``: for each request that carried drafts, how many the executor accepted (they come
        before its drawn token).

        Returns the requests that received a token this step, finished or not.
        """
        updated: list[Request] = []
        drafts = output.num_draft_tokens
        self._update_items([s for s in output.scheduled if not s.num_draft_tokens] if drafts else output.scheduled,
                           sampled_token_ids, updated)
        if drafts:  # after the others: the requests that carried drafts
            self._update_drafted(output.scheduled, sampled_token_ids, accepted_drafts or {}, updated)
        self.policy.on_tokens(updated)
        return updated

    def _update_items(self, items: list[ScheduledRequest], sampled_token_ids: dict[str, int],
                      updated: list[Request]) -> None:
        """``update`` for these of the step's requests, in their order; those that got a token join ``updated``."""
        now = self.clock()
        requests, running = self.requests, RequestStatus.RUNNING
        kv = self.kv_manager
        # Prefix caching indexes the blocks a step filled; most decodes fill none, so only a chunk that
        # crosses a block boundary calls it.
        commit, block_size = (kv.commit_computed, kv.block_size) if kv.caches_prefixes else (None, 0)
        windowed = kv.windowed  # its groups give back the blocks their windows have passed
        for item in items:
            request = requests.get(item.request_id)
            if request is None or request.status is not running:
                continue  # aborted while the step ran
            start = request.num_computed_tokens
            request.num_computed_tokens = end = start + len(item.token_ids)
            if commit is not None and end // block_size != start // block_size:
                commit(request)
            if windowed:
                kv.release_behind_window(request)
            if not item.samples_token:
                continue
            if request.first_token_time is None:
                request.first_token_time = now
                self.num_prompt_tokens += len(request.prompt_token_ids)
            updated.append(request)
            if request.pooling is not None:  # its prompt is computed: the executor pooled it, nothing is drawn
                self.running.remove(request)
                self._finish(request, FinishReason.STOP)
                continue
            self.num_generation_tokens += 1
            token = sampled_token_ids[item.request_id]
            request.output_token_ids.append(token)
            reason, stop_reason = self._check_stop(request, token)
            if reason is not None:
                self.running.remove(request)
                self._finish(request, reason, stop_reason)

    def _update_drafted(self, items: list[ScheduledRequest], sampled_token_ids: dict[str, int],
                        accepted_drafts: Mapping[str, int], updated: list[Request]) -> None:
        """``update`` for the requests that carried drafts: the accepted ones and the drawn token join the
        output one by one, each checked for a stop (the first ends the request; the rest are dropped). The KV
        of the rejected drafts is not counted as computed, and the blocks that held only rejected drafts
        go back to the pool; the prefix cache indexes computed blocks only, so never a rejected draft's."""
        now = self.clock()
        kv = self.kv_manager
        for item in items:
            num_drafts = item.num_draft_tokens
            request = self.requests.get(item.request_id)
            if not num_drafts or request is None or request.status is not RequestStatus.RUNNING:
                continue
            num_accepted = accepted_drafts.get(item.request_id, 0)
            start = request.num_computed_tokens
            request.num_computed_tokens = end = start + 1 + num_accepted
            kv.trim_table(request.request_id, end)
            if kv.caches_prefixes and end // kv.block_size != start // kv.block_size:
                kv.commit_computed(request)
            self.speculator.verified(request.request_id, num_drafts, num_accepted)
            if request.first_token_time is None:
                request.first_token_time = now
                self.num_prompt_tokens += len(request.prompt_token_ids)
            updated.append(request)
            for token in [*item.token_ids[1:1 + num_accepted], sampled_token_ids[item.request_id]]:
                self.num_generation_tokens += 1
                request.output_token_ids.append(token)
                reason, stop_reason = self._check_stop(request, token)
                if reason is not None:
                    self.running.remove(request)
                    self._finish(request, reason, stop_reason)
                    break

    def record_step(self, output: SchedulerOutput, seconds: float) -> None:
        """The step ``output`` took ``seconds``, schedule to update: the measured step times learn from it
        (only where a policy or admission control reads them), and speculative decoding's step costs."""
        if self.speculator is not None:
            self.speculator.record_step(output.num_batched_tokens, seconds)
        if self.times_steps:
            self.step_times.record(output.num_batched_tokens, seconds, self._admitted_tokens,
                                   self.policy.has_backlog(self.waiting), self._admitted_requests)

    def _check_stop(self, request: Request, token: int) -> tuple[FinishReason | None, int | None]:
        params = request.sampling_params
        if token == request.eos_token_id and not params.ignore_eos:
            return FinishReason.STOP, None
        if token in params.stop_token_ids:
            return FinishReason.STOP, token
        if request.tokens_left(self.config.max_model_len) <= 0:
            return FinishReason.LENGTH, None
        return None, None

    def _finish(self, request: Request, reason: FinishReason, stop_reason: str | int | None = None) -> None:
        self.kv_manager.free(request.request_id)
        if self.prefills is not None:
            self.prefills.forget(request.request_id)
        self.policy.on_finished(request)
        if self.speculator is not None:
            self.speculator.finished(request)
        request.finish(reason, self.clock(), stop_reason)
        del self.requests[request.request_id]
        self._finished_since_last_step.append(request.request_id)
