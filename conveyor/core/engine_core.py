"""The step loop without a model or a tokenizer: schedule, execute, update, record.

``Engine`` wraps it with tokenization and text; the simulator drives it with
a cost model on a virtual clock. Both therefore run the same scheduler, KV
manager and loop, and any difference in their figures comes from the
executor alone. Nothing here imports torch.

A step whose execution raises ends the requests it held with an error (their
blocks return) and the loop goes on with the others; only when
``MAX_CONSECUTIVE_FAILED_STEPS`` steps in a row fail (the device itself is
gone, not one request's data) does the error leave ``step``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol, TypeVar

from conveyor.core.config import EngineConfig
from conveyor.core.kv import (
    ContiguousKVCacheManager,
    GroupedKVCacheManager,
    KVLayout,
    PagedKVCacheManager,
    PrefixCachingKVCacheManager,
    kv_layout,
)
from conveyor.core.request import FinishReason, Request
from conveyor.core.scheduler import SCHEDULERS, Scheduler, SchedulerConfig, SchedulerOutput
from conveyor.core.scheduler.fast_forward import FastForwardScheduler
from conveyor.core.spec import Proposer, Speculator
from conveyor.core.stats import EngineStats

logger = logging.getLogger("conveyor")
T = TypeVar("T")


class StepWatcher(Protocol):
    """What watches the core run (the step trace, the live dashboard's feed: see conveyor.observe). Called on
    the engine's thread: requests as they come and go, then each step with what it scheduled (a fast-forward's
    group expanded), the slots held, the requests it updated, its start and end on the core's clock, and the
    drafts accepted by request where it carried drafts."""

    def on_add(self, request_id: str) -> None: ...

    def on_abort(self, request_id: str) -> None: ...

    def after_step(self, output: SchedulerOutput, slots: list[str], updated: list[Request], start: float,
                   end: float, accepted: Mapping[str, int] | None) -> None: ...


W = TypeVar("W", bound=StepWatcher)

MAX_CONSECUTIVE_FAILED_STEPS = 3


class EngineBroken(RuntimeError):
    """Steps keep failing whatever they hold: the engine cannot serve anyone any more."""


class Executor(Protocol):
    """Carries out a SchedulerOutput (the real model, or a cost model on a virtual clock).

    Returns the token drawn for each scheduled request whose chunk samples (``samples_token``). An executor
    handed drafts (speculative decoding: ``SchedulerOutput.num_draft_tokens``) also sets ``accepted_drafts``:
    for each request that carried some, how many it accepted (the drawn token follows them).
    """

    def execute(self, output: SchedulerOutput) -> dict[str, int]: ...


@dataclass(frozen=True, slots=True)
class KVCachePlan:
    """How big the KV pools are, the longest sequence they let a request reach, and the KV groups a block
    belongs to (``layout`` None: one group of every layer)."""

    num_blocks: int
    num_cpu_blocks: int
    block_bytes: int
    max_model_len: int
    layout: KVLayout | None = None


# The default pool (no --kv-cache-memory, no --num-kv-blocks): room for a full batch of requests this long, as
# llama.cpp sizes its cache from -c rather than a fixed size whatever the model (2 GiB held 46,000 tokens of the
# default model but 32,768 of a Llama 3.2 1B shape and 8,192 of an 8B one) ...
DEFAULT_TOKENS_PER_SEQUENCE = 256
# ... and at most this share of the memory free once the weights are in, as vLLM takes a share of a device's.
DEFAULT_POOL_SHARE = 0.5


def default_pool_bytes(config: EngineConfig, kv_bytes_per_token: int, free_bytes: int | None) -> int:
    """The pool's bytes when the config gives none: ``max_num_seqs`` requests of DEFAULT_TOKENS_PER_SEQUENCE
    tokens, at most DEFAULT_POOL_SHARE of ``free_bytes`` (the machine's memory left after the weights; None
    where unknown, as in the simulator), at least one block."""
    wanted = config.max_num_seqs * DEFAULT_TOKENS_PER_SEQUENCE * kv_bytes_per_token
    if free_bytes is not None:
        wanted = min(wanted, int(DEFAULT_POOL_SHARE * free_bytes))
    return max(wanted, config.block_size * kv_bytes_per_token)


def plan_kv_cache(config: EngineConfig, kv_bytes_per_token: int, model_max_len: int,
                  layer_windows: tuple[int | None, ...] = (), free_bytes: int | None = None) -> KVCachePlan:
    """Size the pools from the config; ``kv_bytes_per_token`` counts all layers, K and V, in the model's dtype;
    ``free_bytes``: the memory left once the weights are in, which bounds the default pool.

    With windows that bind (``layer_windows``, per layer) on the paged layout without prefix caching, the
    layers form KV groups (:mod:`conveyor.core.kv.groups`): the pool keeps its bytes in blocks of one group
    each, so ``--num-kv-blocks`` still counts blocks of every layer, and the pool has that many times the
    number of groups."""
    plan = _plan_one_group(config, kv_bytes_per_token, model_max_len, free_bytes)
    if config.kv_layout != "paged" or config.prefix_caching:
        return plan
    layout = kv_layout(layer_windows, len(layer_windows), plan.max_model_len)
    if not layout.windowed:
        return plan
    groups = layout.num_groups
    return KVCachePlan(plan.num_blocks * groups, plan.num_cpu_blocks * groups, plan.block_bytes // groups,
                       plan.max_model_len, layout)


def _plan_one_group(config: EngineConfig, kv_bytes_per_token: int, model_max_len: int,
                    free_bytes: int | None) -> KVCachePlan:
    block_bytes = config.block_size * kv_bytes_per_token
    memory = config.kv_cache_memory
    if config.num_kv_blocks is not None:
        num_blocks = config.num_kv_blocks
    elif memory is not None and memory < block_bytes:
        raise ValueError(f"kv_cache_memory: {memory} bytes hold no block of {block_bytes} bytes")
    else:
        memory = default_pool_bytes(config, kv_bytes_per_token, free_bytes) if memory is None else memory
        num_blocks = memory // block_bytes
    num_cpu_blocks = config.swap_space // block_bytes if config.preemption_mode == "swap" else 0
    max_model_len = _max_model_len(config.max_model_len, model_max_len, num_blocks * config.block_size)
    return KVCachePlan(num_blocks, num_cpu_blocks, block_bytes, max_model_len)


def _max_model_len(wanted: int | None, model_limit: int, capacity: int) -> int:
    if wanted is not None and wanted > model_limit:
        raise ValueError(f"max_model_len {wanted} is more than the model's limit of {model_limit} positions")
    if wanted is None:
        if capacity < model_limit:
            logger.warning("max_model_len capped at %d tokens, all the KV cache can hold", capacity)
        return min(model_limit, capacity)
    if wanted > capacity:
        raise ValueError(
            f"max_model_len {wanted} is more than the KV cache holds ({capacity} tokens); "
            "raise --kv-cache-memory / --num-kv-blocks or lower --max-model-len"
        )
    return wanted


def build_scheduler(config: EngineConfig, plan: KVCachePlan, clock: Callable[[], float],
                    fast_forward_token: int | None = None, proposer: Proposer | None = None) -> Scheduler:
    """The KV manager the config's layout names, and the scheduler over it (``scheduler.kv_manager``).

    ``fast_forward_token``: every decode draws this token (a simulation), so the continuous scheduler may
    advance determined decodes as a group (:mod:`conveyor.core.scheduler.fast_forward`). ``proposer``: where
    speculative decoding's drafts come from, when not the config's method (the simulator's profiled one)."""
    if config.kv_layout == "contiguous":
        kv: PagedKVCacheManager = ContiguousKVCacheManager(
            plan.num_blocks, config.block_size, plan.max_model_len, plan.num_cpu_blocks
        )
    elif plan.layout is not None:
        kv = GroupedKVCacheManager(plan.num_blocks, config.block_size, plan.layout, num_cpu_blocks=plan.num_cpu_blocks)
    elif config.prefix_caching:
        kv = PrefixCachingKVCacheManager(plan.num_blocks, config.block_size, num_cpu_blocks=plan.num_cpu_blocks)
    else:
        kv = PagedKVCacheManager(plan.num_blocks, config.block_size, num_cpu_blocks=plan.num_cpu_blocks)
    ttft_slo, tpot_slo = config.slo_seconds()
    scheduler_config = SchedulerConfig(
        config.max_num_seqs,
        config.max_num_batched_tokens,
        plan.max_model_len,
        config.scheduling_policy,
        config.preemption_mode,
        config.tenant_weight_map(),
        config.max_num_partial_prefills,
        config.max_long_partial_prefills,
        config.long_prefill_token_threshold,
        max_num_queued_requests=config.max_num_queued_requests,
        max_num_queued_tokens=config.max_num_queued_tokens,
        admission_control=config.admission_control,
        ttft_slo=ttft_slo,
        tpot_slo=tpot_slo,
        tenant_cache_salt=config.tenant_cache_salt,
    )
    speculative = config.speculative()
    if speculative is not None:  # drafts make a decode's tokens per step unknown: no fast-forward
        return Scheduler(scheduler_config, kv, clock,
                         speculator=Speculator(speculative, plan.max_model_len, proposer))
    if fast_forward_token is not None and config.scheduler == "continuous":
        return FastForwardScheduler(scheduler_config, kv, clock, fast_forward_token)
    return SCHEDULERS[config.scheduler](scheduler_config, kv, clock)


class EngineCore:
    """One scheduler, one executor, and the loop between them."""

    def __init__(
        self,
        config: EngineConfig,
        plan: KVCachePlan,
        executor: Executor,
        clock: Callable[[], float] = time.monotonic,
        fast_forward_token: int | None = None,
        proposer: Proposer | None = None,
    ) -> None:
        """``fast_forward_token``: the executor draws this token for every request (a simulation's), which lets
        the scheduler advance determined decodes as a group, with the same results (see ``build_scheduler``)."""
        self.config = config
        self.plan = plan
        self.clock = clock
        self.scheduler = build_scheduler(config, plan, clock, fast_forward_token, proposer)
        self.executor = executor
        self.watchers: list[StepWatcher] = []  # a trace, a dashboard's feed: see conveyor.observe
        self.last_output: SchedulerOutput | None = None  # the latest step's decision, for running figures
        self._consecutive_failures = 0

    # ----- the public face of the core: requests in, stats and steps out -----

    def add_request(self, request: Request, check_admission: bool = True) -> None:
        """Queue a request; ValueError (naming the field) if it cannot be served, RequestRefused if admission
        control turns it away (not judged with ``check_admission`` False: see Scheduler.add_request)."""
        self.scheduler.add_request(request, check_admission)
        for watcher in self.watchers:
            watcher.on_add(request.request_id)

    def abort_request(self, request_id: str, reason: FinishReason = FinishReason.ABORT) -> bool:
        """End a request wherever it is (its blocks return at once); False if it is not in the engine."""
        found = self.scheduler.abort_request(request_id, reason) is not None
        if found:
            for watcher in self.watchers:
                watcher.on_abort(request_id)
        return found

    def finish_request(self, request_id: str, reason: FinishReason, stop_reason: str | int | None = None,
                       num_output_tokens: int | None = None) -> None:
        """End a running request for a reason found outside the core (a stop string in its text), its output
        cut to ``num_output_tokens`` where given (see Scheduler.finish_request)."""
        self.scheduler.finish_request(request_id, reason, stop_reason, num_output_tokens)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def stats(self) -> EngineStats:
        return self.scheduler.stats()

    @property
    def max_model_len(self) -> int:
        return self.plan.max_model_len

    def watch(self, watcher: W) -> W:
        """Tell ``watcher`` of every request added or aborted and every step from now on, until ``unwatch``."""
        self.watchers.append(watcher)
        return watcher

    def unwatch(self, watcher: StepWatcher) -> None:
        if watcher in self.watchers:
            self.watchers.remove(watcher)

    def trace_header(self) -> dict:
        """The policy and limits a trace's first line names."""
        config = self.config
        return {
            "scheduler": config.scheduler,
            "scheduling_policy": config.scheduling_policy,
            "preemption_mode": config.preemption_mode,
            "kv_layout": config.kv_layout,
            "enable_prefix_caching": config.prefix_caching,
            "block_size": config.block_size,
            "max_model_len": self.plan.max_model_len,
            "max_num_seqs": config.max_num_seqs,
            "max_num_batched_tokens": config.max_num_batched_tokens,
            "max_num_queued_requests": config.max_num_queued_requests,
            "max_num_queued_tokens": config.max_num_queued_tokens,
            "admission_control": config.admission_control,
            "ttft_slo_ms": config.ttft_slo_ms,
            "tpot_slo_ms": config.tpot_slo_ms,
            "num_kv_blocks": self.plan.num_blocks,
            "num_cpu_blocks": self.plan.num_cpu_blocks,
            "speculative_config": config.speculative_config,
        }

    def step(self, postprocess: Callable[[list[Request]], T] | None = None) -> T | list[Request]:
        """One scheduler step; returns ``postprocess`` of the requests that got tokens (or those requests).

        ``postprocess`` runs before the step is recorded, so a request it ends (a stop string) is
        recorded as finished in this step.
        """
        start = self.clock()
        output = self.last_output = self.scheduler.schedule()
        watchers = self.watchers
        watched = bool(watchers)
        slots = self.scheduler.slot_holders() if watched else []
        listed = self.scheduler.listed(output) if watched else output  # a fast-forward's group, expanded
        accepted = None
        try:
            sampled = self.executor.execute(output)
        except Exception as error:  # whatever it was, it ends this step's requests, not the engine
            updated = self._step_failed(output, error)
        else:
            self._consecutive_failures = 0
            accepted = self.executor.accepted_drafts if output.num_draft_tokens else None
            updated = self.scheduler.update(output, sampled, accepted)
            self.scheduler.record_step(output, self.clock() - start)
        result = postprocess(updated) if postprocess is not None else updated
        if watched:
            end = self.clock()
            for watcher in watchers:
                watcher.after_step(listed, slots, updated, start, end, accepted)
        return result


    def _step_failed(self, output: SchedulerOutput, error: Exception) -> list[Request]:
        """End the failed step's requests with an error that names the step, not the trace (that is logged)."""
        logger.error("step %d failed; its %d requests end with an error", output.step, len(output.scheduled),
                     exc_info=error)
        message = (f"the engine failed while computing step {output.step} ({type(error).__name__}); "
                   "the request was ended, the server goes on serving")
        failed = self.scheduler.fail_step(output, message)
        self._consecutive_failures += 1
        if self._consecutive_failures >= MAX_CONSECUTIVE_FAILED_STEPS:
            raise EngineBroken(f"{self._consecutive_failures} steps in a row failed") from error
        return failed
