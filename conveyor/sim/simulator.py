"""Run a workload through the real scheduler on a virtual clock, and report the benchmark's figures.

The loop is the engine's own (:class:`conveyor.core.engine_core.EngineCore`); the
simulator only adds requests when the clock passes their arrival time, jumps
the clock over idle gaps (to where the server's loop would take its first step:
the end of the arriving burst, conveyor.core.burst), and keeps a few running sums instead of every
request, so that 100,000 requests fit in memory and in a minute.
"""

from __future__ import annotations

import bisect
import functools
import math
import time
from array import array
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from conveyor.core.burst import burst_end
from conveyor.core.config import EngineConfig
from conveyor.core.engine_core import EngineCore, plan_kv_cache
from conveyor.core.errors import RequestRefused
from conveyor.core.request import Request, RequestStatus
from conveyor.core.sampling import SamplingParams
from conveyor.core.scheduler.fast_forward import FastForwardScheduler
from conveyor.observe.figures import config_figures, met_targets, percentile, request_figures
from conveyor.observe.trace import Trace, start_trace
from conveyor.sim.cost import CostModel
from conveyor.sim.executor import SimulatedExecutor, VirtualClock
from conveyor.sim.speculative import AcceptanceProfile, speculative_parts
from conveyor.sim.workload import ConversationShape, SenderShape, WorkloadRequest

FINISHED = RequestStatus.FINISHED
SHARED_PREFIX_TOKEN = 1 << 40  # stand-in ids of shared prefixes, far from any request's own
SYSTEM_PROMPT_TOKEN = 1 << 41  # stand-in ids of multi-turn conversations' shared system prompts
SENDER_TOKEN = 1 << 42  # stand-in ids of closed-loop senders' prompts, one id per request
# Stand-in ids of a workload request's own tokens, one id per request, below those of conversations (negative, of
# at most a few million): no other request sends them (Request.private_after).
OWN_TOKEN = -(1 << 43)
MAX_IDLE_STEPS = 1000  # steps in a row that schedule nothing: the scheduler is stuck


def device_kv_cache_memory(cost: CostModel, memory_utilization: float = 0.9) -> int:
    """KV bytes per device, as vLLM sizes it: the usable share of device memory, less the weights."""
    hardware = cost.hardware
    free = hardware.memory_capacity * memory_utilization - cost.weight_bytes
    if free < cost.kv_bytes_per_token:
        raise ValueError(
            f"the weights need {cost.weight_bytes / 1e9:.1f} GB per device, and {hardware.name} has "
            f"{hardware.memory_capacity * memory_utilization / 1e9:.1f} GB to use: "
            "raise --tensor-parallel-size or --gpu-memory-utilization"
        )
    return int(free)


@dataclass(slots=True)
class FinishedSums:
    """What the figures need of a finished request, and nothing else: numbers in typed arrays (8 bytes each, where
    a list of floats takes 32), so that a million requests keep under 50 MB here."""

    prompt_lens: array = field(default_factory=lambda: array("q"))
    output_lens: array = field(default_factory=lambda: array("q"))
    ttft: array = field(default_factory=lambda: array("d"))
    latency: array = field(default_factory=lambda: array("d"))
    arrivals: array = field(default_factory=lambda: array("d"))
    finishes: array = field(default_factory=lambda: array("d"))
    preemptions: int = 0
    cached_tokens: int = 0
    num_good: int = 0  # met their latency targets (goodput counts them)
    tenant_ttft: dict[str, array] = field(default_factory=dict)  # of the requests that named their tenant
    serving_latency: float = 0.0  # seconds serving adds to each TTFT and latency (CostModel.serving_s_per_request)

    def add(self, request: Request) -> None:
        self.prompt_lens.append(request.num_prompt_tokens)
        self.output_lens.append(request.num_output_tokens)
        self.ttft.append(request.first_token_time - request.arrival_time + self.serving_latency)
        self.latency.append(request.finish_time - request.arrival_time + self.serving_latency)
        self.arrivals.append(request.arrival_time)
        self.finishes.append(request.finish_time)
        self.preemptions += request.num_preemptions
        self.cached_tokens += request.num_cached_tokens
        ttft, n = self.ttft[-1], request.num_output_tokens
        tpot = (self.latency[-1] - ttft) / (n - 1) if n > 1 else None
        self.num_good += met_targets(ttft, tpot, request.ttft_slo, request.tpot_slo)
        if request.tenant:
            waits = self.tenant_ttft.get(request.tenant)
            if waits is None:
                waits = self.tenant_ttft[request.tenant] = array("d")
            waits.append(ttft)


@dataclass(slots=True)
class _StepSums:
    steps: int = 0
    peak_running: int = 0
    waste_sum: float = 0.0
    waste_steps: int = 0

    def add(self, num_running: int, reserved_slots: int, used_slots: int) -> None:
        self.steps += 1
        if num_running > self.peak_running:
            self.peak_running = num_running
        if reserved_slots:
            self.waste_sum += 1 - used_slots / reserved_slots
            self.waste_steps += 1


class Simulation:
    """One workload on one configuration: the engine core on a virtual clock, run once with :meth:`run`.

    The KV pool is ``config``'s (``kv_cache_memory`` or ``num_kv_blocks``, per device). A prompt
    longer than the pool or the model allows is cut to fit, as a client would have to.
    """

    def __init__(
        self,
        config: EngineConfig,
        cost: CostModel,
        workload: list[WorkloadRequest],
        record_trace: bool = False,
        conversations: list[ConversationShape] | None = None,
        fast_forward: bool = True,
        acceptance: AcceptanceProfile | None = None,
        senders: list[SenderShape] | None = None,
    ) -> None:
        """``fast_forward``: advance determined decodes as a group (:mod:`conveyor.core.scheduler.fast_forward`),
        with the same results as one request at a time, faster. ``acceptance``: what drafts look like, with
        ``config.speculative_config`` (see :mod:`conveyor.sim.speculative`). ``conversations`` and ``senders``
        are closed loops: their requests arrive as earlier ones finish."""
        self.config = config
        self.cost = cost
        self.clock = VirtualClock()
        self.plan = plan_kv_cache(config, cost.kv_bytes_per_token, cost.model.max_position_embeddings,
                                  cost.model.layer_windows)
        drafts = speculative_parts(config, acceptance)
        self.executor = SimulatedExecutor(cost, self.clock, config.block_size, acceptance=drafts[1])
        token = self.executor.token_id if fast_forward else None
        self.core = EngineCore(config, self.plan, self.executor, self.clock, fast_forward_token=token,
                               proposer=drafts[0])
        self.executor.listed = self.core.scheduler.listed
        self.trace = start_trace(self.core) if record_trace else None
        self.arrivals = sorted(workload, key=lambda r: r.arrival_time)
        self.feeds = closed_loop_feeds(conversations, senders, self.plan.max_model_len)
        # Every finished request's figures, in the order they finished.
        self.finished = FinishedSums(serving_latency=cost.serving_s_per_request)

    def run(self) -> dict[str, Any]:
        """Run to the last finish; the figures of ``conveyor bench throughput`` and a few more."""
        wall_start = time.perf_counter()
        clock, core, arrivals = self.clock, self.core, self.arrivals
        finished, sums, refused = self.finished, _StepSums(), Counter()
        next_index, idle_steps = 0, 0
        arrival_times, wait_s = array("d", (r.arrival_time for r in arrivals)), self.config.burst_wait_ms / 1000
        group = fast_forward_group(core, traced=self.trace is not None)
        for feed in self.feeds:
            for request in feed.first_requests():
                _add(core, request, refused)
        if core.has_unfinished_requests():  # the closed loops' first requests wake the engine
            clock.now = burst_end(clock.now, arrival_times, 0, wait_s)
        while next_index < len(arrivals) or core.has_unfinished_requests():
            if not core.has_unfinished_requests() and arrival_times[next_index] >= clock.now:
                # idle since its last step: the first step waits for the rest of the next burst
                clock.now = burst_end(arrival_times[next_index], arrival_times, next_index + 1, wait_s)
            while next_index < len(arrivals) and arrival_times[next_index] <= clock.now:
                _add(core, workload_request(arrivals[next_index], next_index, self.plan.max_model_len), refused)
                next_index += 1
            if not core.has_unfinished_requests():  # every arrival refused
                continue
            updated, num_running, reserved, used, empty = run_step(core, self.executor, group)
            if self._finished(updated, refused) and (next_index == len(arrivals)
                                                     or arrival_times[next_index] >= clock.now):
                clock.now = burst_end(clock.now, arrival_times, next_index, wait_s)  # follow-ups woke it
            sums.add(num_running, reserved, used)
            idle_steps = idle_steps + 1 if empty else 0
            if idle_steps > MAX_IDLE_STEPS:
                raise RuntimeError(f"the scheduler scheduled nothing for {MAX_IDLE_STEPS} steps in a row")
        figures = _figures(self.config, self.cost, finished, sums, self.executor, clock.now, core)
        figures.update(_shedding_figures(finished, refused, figures["elapsed_s"]))
        figures.update(_fast_forward_figures(core))
        figures.update(_draft_figures(core))
        figures.update(tenant_figures(finished))
        figures["simulation_wall_s"] = time.perf_counter() - wall_start
        return figures


    def _finished(self, updated: list[Request], refused: Counter[str]) -> bool:
        """Count the step's finished requests; a closed loop's next request (a conversation's next turn, a
        sender's next request) arrives as its last one completes. Whether such requests woke an engine the
        step had left idle."""
        feeds, core = self.feeds, self.core
        idle = not core.has_unfinished_requests()
        for request in updated:
            if request.status is FINISHED:  # is_finished, without a property call per request and step
                self.finished.add(request)
                for feed in feeds:
                    if (follow_up := feed.follow_up(request, self.clock.now)) is not None:
                        _add(core, follow_up, refused)
        return idle and core.has_unfinished_requests()


def fast_forward_group(core: EngineCore, traced: bool = False) -> FastForwardScheduler | None:
    """The core's scheduler where it advances a group of decodes (see ``run_step``); None where it does not, or
    where a trace is recorded (a trace lists every step's requests, so each step builds its output)."""
    scheduler = core.scheduler
    if traced or not isinstance(scheduler, FastForwardScheduler) or not scheduler.fast_forward:
        return None
    return scheduler


def run_step(core: EngineCore, executor: SimulatedExecutor,
             group: FastForwardScheduler | None) -> tuple[list[Request], int, int, int, bool]:
    """One step of a simulated engine: a step of the fast-forward's group alone where there is one (priced from
    the group's size and context, no output built), else the core's full step. Returns the requests that got a
    token (those of the group only if they finished), the requests running in the step, the KV slots reserved
    and used after its allocations, and whether it scheduled nothing."""
    if group is not None and group.group_step_ready():
        step = group.advance_group()
        executor.execute_group(step.num_decodes, step.context, step.shared_blocks)
        return group.finish_group_step(), step.num_decodes, step.reserved_slots, step.used_slots, False
    updated = core.step()
    output = core.last_output
    memory = output.memory
    reserved, used = (memory.reserved_slots, memory.used_slots) if memory is not None else (0, 0)
    return updated, output.num_running, reserved, used, output.is_empty


def _add(core: EngineCore, request: Request, refused: Counter[str]) -> None:
    """Queue a request, or count it refused by admission control (its client was told at once: a 429)."""
    try:
        core.add_request(request)
    except RequestRefused as refusal:
        refused[refusal.reason] += 1


def _fast_forward_figures(core: EngineCore) -> dict[str, Any]:
    """How much of the run the fast-forward advanced as a group: decodes (one request's step each) grouped, of
    all the decodes the running loops served, and the steps that held the group alone (run without listing
    anyone)."""
    scheduler = core.scheduler
    if not isinstance(scheduler, FastForwardScheduler):
        return {"fast_forward": False, "decodes_fast_forwarded": 0.0, "steps_fast_forwarded": 0}
    grouped, listed = scheduler.num_grouped_decodes, scheduler.num_listed_decodes
    return {"fast_forward": scheduler.fast_forward,
            "decodes_fast_forwarded": grouped / (grouped + listed) if grouped + listed else 0.0,
            "steps_fast_forwarded": scheduler.num_group_steps}


def _draft_figures(core: EngineCore) -> dict[str, Any]:
    """Speculative decoding's, where drafts were simulated: drafts carried, the share accepted, and the tokens a
    drafted request gained per step."""
    speculator = core.scheduler.speculator
    if speculator is None:
        return {}
    stats = speculator.stats
    return {"spec_decode_num_draft_tokens": stats.num_draft_tokens, "spec_decode_acceptance_rate":
            stats.acceptance_rate, "spec_decode_tokens_per_drafted_step": stats.mean_acceptance_length}


def tenant_figures(finished: FinishedSums) -> dict[str, Any]:
    """Each named tenant's requests and time to first token (mean, p50, p99), where requests named one."""
    if not finished.tenant_ttft:
        return {}
    return {"tenants": {tenant: {"requests": len(waits), "ttft_mean_s": sum(waits) / len(waits),
                                 "ttft_p50_s": percentile(waits, 50), "ttft_p99_s": percentile(waits, 99)}
                        for tenant, waits in sorted(finished.tenant_ttft.items())}}


def _shedding_figures(finished: FinishedSums, refused: Counter[str], elapsed: float) -> dict[str, Any]:
    """Goodput (finished requests that met their targets, per second) and the requests admission refused."""
    return {
        "goodput_requests_per_s": finished.num_good / elapsed if elapsed > 0 else math.nan,
        "met_targets_fraction": finished.num_good / max(len(finished.ttft) + sum(refused.values()), 1),
        "refused": sum(refused.values()),
        "refused_queue_full": refused["queue_full"],
        "refused_deadline": refused["deadline_unattainable"],
    }


def simulate(
    config: EngineConfig,
    cost: CostModel,
    workload: list[WorkloadRequest],
    record_trace: bool = False,
    conversations: list[ConversationShape] | None = None,
    fast_forward: bool = True,
    acceptance: AcceptanceProfile | None = None,
    senders: list[SenderShape] | None = None,
) -> tuple[dict[str, Any], Trace | None]:
    """Run ``workload`` (and ``conversations``, ``senders``) to the end; its figures, and its trace if asked for."""
    simulation = Simulation(config, cost, workload, record_trace, conversations, fast_forward, acceptance, senders)
    return simulation.run(), simulation.trace


def closed_loop_feeds(conversations: list[ConversationShape] | None, senders: list[SenderShape] | None,
                      max_model_len: int) -> list[ConversationFeed | SenderFeed]:
    """The closed loops of a run (conversations, senders), those that have any: a simulation adds their first
    requests at the start and asks each for a follow-up as a request finishes."""
    feeds = (ConversationFeed(conversations or [], max_model_len), SenderFeed(senders or [], max_model_len))
    return [feed for feed in feeds if feed]


class ConversationFeed:
    """Multi-turn conversations, closed loop: a conversation's next turn arrives when its answer is complete.

    A turn's prompt is the conversation's history (system prompt, earlier questions, and the answers as the
    simulated engine produced them) and its new question, so the prefix cache sees what a chat client sends.
    Stand-in ids: the questions of conversation ``c`` use ids no other conversation uses, and so does its system
    prompt unless the shape shares one (``system_id``).
    """

    def __init__(self, shapes: list[ConversationShape], max_model_len: int) -> None:
        self.shapes = shapes
        self.max_model_len = max_model_len
        self.histories: list[list[int]] = [[] for _ in shapes]  # prompt + answer of the latest turn
        self.turns = [0] * len(shapes)
        self._conversation_of: dict[str, int] = {}  # request id of a turn -> its conversation

    def __bool__(self) -> bool:
        return bool(self.shapes)

    def first_requests(self) -> list[Request]:
        return [self._turn(index, shape.arrival_time) for index, shape in enumerate(self.shapes)]

    def follow_up(self, finished: Request, now: float) -> Request | None:
        """The next turn of the conversation ``finished`` belongs to, arriving ``now``; None when it is over."""
        index = self._conversation_of.pop(finished.request_id, None)
        if index is None:
            return None
        self.histories[index] = finished.prompt_token_ids + finished.output_token_ids
        self.turns[index] += 1
        if self.turns[index] == len(self.shapes[index].question_lens):
            return None
        return self._turn(index, now)

    def system_token(self, index: int) -> int:
        """A shared system prompt's stand-in id is the same in every conversation that opens with it."""
        system_id = self.shapes[index].system_id
        return -(index * 1000 + 1) if system_id is None else SYSTEM_PROMPT_TOKEN + system_id

    def _turn(self, index: int, now: float) -> Request:
        shape, turn = self.shapes[index], self.turns[index]
        system = [] if turn else [self.system_token(index)] * shape.system_len
        prompt = self.histories[index] + system + [-(index * 1000 + turn + 2)] * shape.question_lens[turn]
        prompt = prompt[: self.max_model_len - 1]
        self._conversation_of[f"conv-{index}-{turn}"] = index
        return Request(
            request_id=f"conv-{index}-{turn}",
            prompt_token_ids=prompt,
            sampling_params=SamplingParams(max_tokens=shape.output_len, ignore_eos=True),
            arrival_time=now,
        )


class SenderFeed:
    """Closed-loop senders (:class:`~conveyor.sim.workload.SenderShape`): each sender's requests one after
    another, the next arriving the moment the last finishes, until its shape's end. Each request's prompt is a
    stand-in id of its own, so none finds another's in the prefix cache (the benchmark sends random tokens)."""

    def __init__(self, shapes: list[SenderShape], max_model_len: int) -> None:
        for shape in shapes:
            if shape.senders < 1 or shape.prompt_len < 1 or shape.output_len < 1:
                raise ValueError(f"senders of {shape.tenant!r}: senders, prompt_len and output_len must be >= 1, "
                                 f"got {shape.senders}, {shape.prompt_len}, {shape.output_len}")
        self.shapes = shapes
        self.max_model_len = max_model_len
        self.num_sent = 0
        self._shape_of: dict[str, int] = {}  # request id -> the index of its sender's shape

    def __bool__(self) -> bool:
        return bool(self.shapes)

    def first_requests(self) -> list[Request]:
        """Every sender's first request, at time 0."""
        return [self._request(index, 0.0) for index, shape in enumerate(self.shapes) for _ in range(shape.senders)]

    def follow_up(self, finished: Request, now: float) -> Request | None:
        """The next request of the sender whose request ``finished``, arriving ``now``; None past its end (or when
        ``finished`` is no sender's)."""
        index = self._shape_of.pop(finished.request_id, None)
        if index is None or now >= self.shapes[index].until:
            return None
        return self._request(index, now)

    def _request(self, index: int, now: float) -> Request:
        shape = self.shapes[index]
        request_id = f"sender-{self.num_sent}"
        self._shape_of[request_id] = index
        prompt = [SENDER_TOKEN + self.num_sent] * min(shape.prompt_len, self.max_model_len - 1)
        self.num_sent += 1
        return Request(request_id=request_id, prompt_token_ids=prompt,
                       sampling_params=_sampling_params(shape.output_len), arrival_time=now, tenant=shape.tenant)


@functools.lru_cache(maxsize=4096)
def _sampling_params(output_len: int) -> SamplingParams:
    """One (frozen) SamplingParams per output length: checked once, shared by every request of that length."""
    return SamplingParams(max_tokens=output_len, ignore_eos=True)


def workload_request(item: WorkloadRequest, index: int, max_model_len: int) -> Request:
    """The request of a workload's item: its own tokens (and the answer after them) no other request sends, so
    prefix caching need not index their blocks unless it is preempted (``private_after``); a prompt all of a
    shared prefix has none of its own, and another such request's answer would hold the same ids."""
    prompt_len = min(item.prompt_len, max_model_len - 1)
    shared = min(item.shared_prefix_len, prompt_len)
    return Request(
        request_id=f"sim-{index}",
        prompt_token_ids=prompt_token_ids(item, index, prompt_len),
        sampling_params=_sampling_params(item.output_len),
        arrival_time=item.arrival_time,
        priority=item.priority,
        tenant=item.tenant,
        private_after=shared if shared < prompt_len else None,
    )


def prompt_token_ids(item: WorkloadRequest, index: int, prompt_len: int) -> list[int]:
    """Stand-in token ids that the prefix cache sees as the workload means them: a shared prefix is the same
    ids in every request that shares it, the rest is the request's own (no model reads these ids)."""
    shared = min(item.shared_prefix_len, prompt_len)
    return [SHARED_PREFIX_TOKEN + item.shared_prefix_id] * shared + [OWN_TOKEN - index] * (prompt_len - shared)


def _figures(
    config: EngineConfig,
    cost: CostModel,
    finished: FinishedSums,
    sums: _StepSums,
    executor: SimulatedExecutor,
    end: float,
    core: EngineCore,
) -> dict[str, Any]:
    start = min(finished.arrivals, default=0.0)
    stats = core.stats()
    slot_steps = config.max_num_seqs * executor.num_model_steps
    return {
        "hardware": cost.hardware.name,
        "dtype": cost.dtype,
        "tensor_parallel_size": cost.tensor_parallel_size,
        **config_figures(config),
        "num_kv_blocks": stats.num_kv_blocks,
        "max_model_len": core.max_model_len,
        **request_figures(
            finished.prompt_lens, finished.output_lens, finished.ttft, finished.latency, end - start, sums.steps
        ),
        "model_steps": executor.num_model_steps,
        "prompt_tokens_computed": sum(finished.prompt_lens) - finished.cached_tokens,
        "prefix_cache_hit_rate": finished.cached_tokens / max(sum(finished.prompt_lens), 1),
        "preemptions": finished.preemptions,
        "swaps_out": stats.num_swaps_out,
        "swap_fallbacks_to_recompute": stats.num_swap_fallbacks,
        "peak_running": sums.peak_running,
        "kv_waste_fraction": sums.waste_sum / sums.waste_steps if sums.waste_steps else 0.0,
        "idle_slot_fraction": 1 - executor.num_busy_slot_steps / slot_steps if slot_steps else 0.0,
        "busy_fraction": executor.busy_time / (end - start) if end > start else 0.0,
        **dict(zip(("offered_rate", "completion_rate"), mid_run_rates(finished.arrivals, finished.finishes))),
    }


def mid_run_rates(arrivals: list[float], finishes: list[float]) -> tuple[float, float]:
    """Arrivals and completions per second over the middle half of the arrivals.

    The interval runs from the arrival of the request a quarter of the way in to
    that of the request three quarters in: past the start-up, before the drain.
    Whether the engine keeps up is then a comparison of two counts over the
    same interval, which the latency of a few very long requests barely moves.
    """
    ordered = sorted(arrivals)
    if len(ordered) < 4:
        return math.nan, math.nan
    first, last = len(ordered) // 4, 3 * len(ordered) // 4
    start, end = ordered[first], ordered[last]
    if end <= start:
        return math.inf, math.nan  # all at once: no rate is kept up with
    done = sorted(finishes)
    completed = bisect.bisect_right(done, end) - bisect.bisect_right(done, start)
    return (last - first) / (end - start), completed / (end - start)
