"""The step loop without a model or a tokenizer: schedule, execute, update, record.

``Engine`` wraps it with tokenization and text; the simulator drives it with
a cost model on a virtual clock. Both therefore run the same scheduler, KV
manager and loop, and any difference in their figures comes from the
executor alone. Nothing here imports torch.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, TypeVar

from conveyor.config import EngineConfig
from conveyor.kv import ContiguousKVCacheManager, PagedKVCacheManager
from conveyor.request import Request
from conveyor.scheduler import SCHEDULERS, ScheduledRequest, Scheduler, SchedulerConfig, SchedulerOutput
from conveyor.trace import Trace

logger = logging.getLogger("conveyor")
T = TypeVar("T")


class Executor(Protocol):
    """Carries out a SchedulerOutput: a token per sampling request, or a list of them with ``num_steps`` > 1."""

    def execute(self, output: SchedulerOutput) -> dict[str, int] | dict[str, list[int]]: ...


@dataclass(frozen=True, slots=True)
class KVCachePlan:
    """How big the KV pools are, and the longest sequence they let a request reach."""

    num_blocks: int
    num_cpu_blocks: int
    block_bytes: int
    max_model_len: int


def plan_kv_cache(config: EngineConfig, kv_bytes_per_token: int, model_max_len: int) -> KVCachePlan:
    """Size the pools from the config; ``kv_bytes_per_token`` counts all layers, K and V, in the model's dtype."""
    block_bytes = config.block_size * kv_bytes_per_token
    if config.num_kv_blocks is not None:
        num_blocks = config.num_kv_blocks
    elif config.kv_cache_memory < block_bytes:
        raise ValueError(f"kv_cache_memory: {config.kv_cache_memory} bytes hold no block of {block_bytes} bytes")
    else:
        num_blocks = config.kv_cache_memory // block_bytes
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


def build_scheduler(config: EngineConfig, plan: KVCachePlan, clock: Callable[[], float]) -> Scheduler:
    """The KV manager the config's layout names, and the scheduler over it (``scheduler.kv``)."""
    if config.kv_layout == "contiguous":
        kv: PagedKVCacheManager = ContiguousKVCacheManager(
            plan.num_blocks, config.block_size, plan.max_model_len, plan.num_cpu_blocks
        )
    else:
        kv = PagedKVCacheManager(plan.num_blocks, config.block_size, num_cpu_blocks=plan.num_cpu_blocks)
    scheduler_config = SchedulerConfig(
        config.max_num_seqs,
        config.max_num_batched_tokens,
        plan.max_model_len,
        config.scheduling_policy,
        config.preemption_mode,
        config.num_scheduler_steps,
    )
    return SCHEDULERS[config.scheduler](scheduler_config, kv, clock)


class EngineCore:
    """One scheduler, one executor, and the loop between them."""

    def __init__(
        self,
        config: EngineConfig,
        plan: KVCachePlan,
        executor: Executor,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.plan = plan
        self.clock = clock
        self.scheduler = build_scheduler(config, plan, clock)
        self.kv_manager = self.scheduler.kv
        self.executor = executor
        # An executor that runs one model step per call gets multi-step outputs one step at a time.
        self._runs_multi_step = getattr(executor, "runs_multi_step", False)
        self.trace: Trace | None = None
        self.last_output: SchedulerOutput | None = None  # the latest step's decision, for running figures

    def start_trace(self) -> Trace:
        """Record every step from now on (see :mod:`conveyor.trace`)."""
        config = self.config
        header = {
            "scheduler": config.scheduler,
            "scheduling_policy": config.scheduling_policy,
            "preemption_mode": config.preemption_mode,
            "kv_layout": config.kv_layout,
            "block_size": config.block_size,
            "max_model_len": self.plan.max_model_len,
            "max_num_seqs": config.max_num_seqs,
            "max_num_batched_tokens": config.max_num_batched_tokens,
            "num_scheduler_steps": config.num_scheduler_steps,
        }
        self.trace = Trace(header, self.clock())
        return self.trace

    def step(self, postprocess: Callable[[list[Request]], T] | None = None) -> T | list[Request]:
        """One scheduler step; returns ``postprocess`` of the requests that got tokens (or those requests).

        ``postprocess`` runs before the step is recorded, so a request it ends (a stop string) is
        recorded as finished in this step.
        """
        start = self.clock()
        output = self.last_output = self.scheduler.schedule()
        slots = self.scheduler.slot_holders() if self.trace is not None else []
        if self._runs_multi_step or self.config.num_scheduler_steps == 1:
            sampled = self.executor.execute(output)
        else:
            sampled = execute_step_by_step(self.executor, output)
        touched = self.scheduler.update(output, sampled)
        result = postprocess(touched) if postprocess is not None else touched
        if self.trace is not None:
            finished = [r.request_id for r in touched if r.is_finished]
            self.trace.record(output, slots, finished, start, self.clock())
        return result


def execute_step_by_step(executor: Executor, output: SchedulerOutput) -> dict[str, int | list[int]]:
    """Carry out a multi-step output on an executor that runs one model step per call.

    The first call runs the output as scheduled; each later call is a decode
    step that feeds every continuing request the token it has just drawn, in
    the slots the scheduler allocated ahead for it.
    """
    sampled: dict[str, int | list[int]] = dict(executor.execute(output))
    continuing = [s for s in output.scheduled if s.sample and s.num_steps > 1]
    tokens = {s.request_id: [sampled[s.request_id]] for s in continuing}
    for index in range(1, max((s.num_steps for s in continuing), default=1)):
        decodes = [
            ScheduledRequest(
                request_id=s.request_id,
                start_position=s.context_len + index - 1,
                token_ids=[tokens[s.request_id][-1]],
                block_ids=s.block_ids,
                sampling_params=s.sampling_params,
                sample=True,
                num_output_tokens=s.num_output_tokens + index,
            )
            for s in continuing
            if s.num_steps > index
        ]
        for request_id, token in executor.execute(SchedulerOutput(step=output.step, scheduled=decodes)).items():
            tokens[request_id].append(token)
    sampled.update(tokens)
    return sampled
