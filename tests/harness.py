"""The scheduler tests' shared harness: the engine loop without the model, and the checks it needs.

Every test that drives a scheduler imports from here, never from another test module:

* tokens: ``hashed_token`` and ``never_eos`` (a token fixed by request and position, so the output
  cannot depend on batching), ``reference_output`` (what a request yields run alone);
* the model's stand-ins: ``FakeClock``, ``FakeExecutor`` (checks each chunk continues the request's KV
  with its true token ids) and ``SwapAwareExecutor`` (the same, for swap preemption);
* building: ``make_scheduler``, ``make_request``, and ``Harness`` (a scheduler, an executor and an
  arrival counter) for hand-written step-by-step tests;
* random workloads: ``RequestSpec``, ``Abort``, ``Workload`` and the ``workloads`` strategy;
* KV checks: ``check_pool`` (one owner per block, none lost), ``KVShadow`` (what each block holds);
* ``StepDriver``: the one step loop the property tests run, with a hook around every call;
* ``hf_greedy``: transformers' greedy decode, the reference for the engine's output (torch imported lazily,
  so the scheduler tests stay torch-free).
"""

from __future__ import annotations

import dataclasses
import functools
import zlib
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from hypothesis import strategies as st

from conveyor.core.kv import BlockPool, ContiguousBlockPool, ContiguousKVCacheManager, PagedKVCacheManager
from conveyor.core.request import FinishReason, Request, RequestStatus
from conveyor.core.sampling import SamplingParams
from conveyor.core.scheduler import Scheduler, SchedulerConfig, SchedulerOutput

EOS = 0
TokenFn = Callable[[str, int], int]

# ----- Tokens ------------------------------------------------------------------


def hashed_token(request_id: str, position: int, vocab: int) -> int:
    """A token in ``[0, vocab)`` fixed by request and position (crc32: stable across processes)."""
    return zlib.crc32(f"{request_id}@{position}".encode()) % vocab


def never_eos(request_id: str, position: int) -> int:
    """Tokens in 1..1000, so no request ends before max_tokens unless a test says so."""
    return 1 + hashed_token(request_id, position, 1000)


def reference_output(
    request: Request, max_model_len: int, token_fn: TokenFn
) -> tuple[list[int], FinishReason, int | None]:
    """What the request yields run alone: the contract's stop rules, written independently of the scheduler."""
    params = request.sampling_params
    out: list[int] = []
    while True:
        token = token_fn(request.request_id, request.num_prompt_tokens + len(out))
        out.append(token)
        if token == request.eos_token_id and not params.ignore_eos:
            return out, FinishReason.STOP, None
        if token in params.stop_token_ids:
            return out, FinishReason.STOP, token
        if len(out) >= params.max_tokens or request.num_prompt_tokens + len(out) >= max_model_len:
            return out, FinishReason.LENGTH, None


# ----- The model's stand-ins ---------------------------------------------------


class FakeClock:
    """Strictly increasing time, so the order of clock reads (e.g. first_scheduled_time) is visible."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


class FakeExecutor:
    """Plays the model for the scheduler: checks what it is handed and samples deterministic tokens.

    It tracks how many positions of each request it holds KV for, as a real
    executor would, and drops that on preemption or finish; each chunk must
    start exactly there and carry the request's true token ids.
    """

    def __init__(self, token_fn: TokenFn = never_eos) -> None:
        self.token_fn = token_fn
        self.prompts: dict[str, list[int]] = {}
        self.cached: dict[str, int] = {}
        self.accepted_drafts: dict[str, int] = {}  # none here: it is handed no drafts (see test_speculative_*)

    def expected_tokens(self, request_id: str, start: int, end: int) -> list[int]:
        prompt = self.prompts[request_id]
        return [prompt[p] if p < len(prompt) else self.token_fn(request_id, p) for p in range(start, end)]

    def execute(self, output: SchedulerOutput) -> dict[str, int]:
        for request_id in [*output.finished_request_ids, *output.preempted_request_ids]:
            self.cached.pop(request_id, None)
        sampled: dict[str, int] = {}
        for item in output.scheduled:
            assert item.start_position == self.cached.get(item.request_id, 0), f"{item.request_id}: KV gap"
            expected = self.expected_tokens(item.request_id, item.start_position, item.context_len)
            assert item.token_ids == expected, f"{item.request_id}: wrong token ids"
            self.cached[item.request_id] = item.context_len
            if item.samples_token:
                # The token drawn after ``context_len`` tokens sits at position ``context_len``.
                sampled[item.request_id] = self.token_fn(item.request_id, item.context_len)
        return sampled


class SwapAwareExecutor(FakeExecutor):
    """The fake executor, except that a swapped-out request keeps its KV (the real one copies it).

    Also right for recompute: it forgets every victim that is not SWAPPED, i.e. all of them.
    """

    def __init__(self, scheduler: Scheduler, token_fn: TokenFn = never_eos) -> None:
        super().__init__(token_fn)
        self.scheduler = scheduler

    def execute(self, output: SchedulerOutput) -> dict[str, int]:
        requests = self.scheduler.requests
        dropped = [i for i in output.preempted_request_ids if requests[i].status is not RequestStatus.SWAPPED]
        return super().execute(dataclasses.replace(output, preempted_request_ids=dropped))


# ----- Building schedulers and requests ----------------------------------------


def make_scheduler(
    num_blocks: int,
    block_size: int,
    *,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 64,
    max_model_len: int | None = None,
    watermark: float = 0.0,
    num_cpu_blocks: int = 0,
    layout: str = "paged",
    scheduler_class: type[Scheduler] = Scheduler,
    policy: str = "fcfs",
    preemption_mode: str = "recompute",
) -> Scheduler:
    """A scheduler over a fresh pool; max_model_len defaults to the whole KV capacity.

    ``layout="contiguous"`` reserves a slab of max_model_len per request and has no watermark.
    """
    kv: PagedKVCacheManager
    if layout == "paged":
        kv = PagedKVCacheManager(num_blocks, block_size, watermark, num_cpu_blocks)
        max_model_len = max_model_len or kv.capacity_tokens
    else:
        assert layout == "contiguous" and max_model_len is not None, "a contiguous pool needs max_model_len"
        kv = ContiguousKVCacheManager(num_blocks, block_size, max_model_len, num_cpu_blocks)
    config = SchedulerConfig(
        max_num_seqs, max_num_batched_tokens, max_model_len, policy=policy, preemption_mode=preemption_mode
    )
    return scheduler_class(config, kv, clock=FakeClock())


def make_request(
    request_id: str,
    prompt_len: int,
    *,
    arrival: float,
    max_tokens: int = 16,
    eos: int | None = None,
    stop_token_ids: tuple[int, ...] = (),
    ignore_eos: bool = False,
    priority: int = 0,
) -> Request:
    """A request whose prompt tokens (2000..2999) are fixed by its id, so no two requests share a prompt."""
    params = SamplingParams(max_tokens=max_tokens, stop_token_ids=stop_token_ids, ignore_eos=ignore_eos)
    prompt = [2000 + (zlib.crc32(f"{request_id}:{i}".encode()) % 1000) for i in range(prompt_len)]
    return Request(request_id, prompt, params, arrival_time=arrival, eos_token_id=eos, priority=priority)


@dataclass
class Harness:
    """A scheduler, a fake executor and a monotonic arrival counter: the engine loop without the model."""

    scheduler: Scheduler
    executor: FakeExecutor = field(default_factory=FakeExecutor)
    arrivals: int = 0

    def add(
        self,
        request_id: str,
        prompt_len: int,
        *,
        arrival: float | None = None,
        max_tokens: int = 16,
        eos: int | None = None,
        stop_token_ids: tuple[int, ...] = (),
        ignore_eos: bool = False,
        priority: int = 0,
    ) -> Request:
        """Add a request; by default each arrives one time unit after the previous one."""
        arrival = float(self.arrivals) if arrival is None else arrival
        options = dict(eos=eos, stop_token_ids=stop_token_ids, ignore_eos=ignore_eos, priority=priority)
        request = make_request(request_id, prompt_len, arrival=arrival, max_tokens=max_tokens, **options)
        self.arrivals += 1
        self.scheduler.add_request(request)
        self.executor.prompts[request_id] = request.prompt_token_ids
        return request

    def step(self) -> SchedulerOutput:
        output = self.scheduler.schedule()
        self.scheduler.update(output, self.executor.execute(output))
        return output

    def run_to_end(self, max_steps: int = 1000) -> list[SchedulerOutput]:
        outputs = []
        while self.scheduler.has_unfinished_requests():
            outputs.append(self.step())
            assert len(outputs) <= max_steps, "scheduler did not drain"
        return outputs


# ----- Random workloads --------------------------------------------------------


@dataclass(frozen=True)
class RequestSpec:
    prompt_len: int
    max_tokens: int
    arrival_step: int
    use_eos: bool
    ignore_eos: bool
    stop_token_ids: tuple[int, ...]


@dataclass(frozen=True)
class Abort:
    step: int
    index: int  # into the workload's requests; it may not have arrived yet, or be finished already
    mid_step: bool  # between the executor and update(), as when a client hangs up during a step


@dataclass(frozen=True)
class Workload:
    num_blocks: int
    block_size: int
    watermark: float
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    vocab: int  # token 0 is EOS, so a small vocab makes EOS and stop-token finishes common
    requests: tuple[RequestSpec, ...]
    aborts: tuple[Abort, ...]


@st.composite
def workloads(
    draw: st.DrawFn,
    max_block_size: int = 16,
    max_blocks: int = 24,
    max_requests: int = 10,
    max_arrival_step: int = 12,
    max_prompt_len: int = 96,
    vocabs: tuple[int, ...] = (3, 16, 1000),
) -> Workload:
    """Random engine settings and requests; max_model_len always fits the pool, as the scheduler demands."""
    block_size = draw(st.integers(1, max_block_size))
    num_blocks = draw(st.integers(2 if block_size == 1 else 1, max_blocks))
    max_model_len = draw(st.integers(2, min(num_blocks * block_size, 96)))
    vocab = draw(st.sampled_from(vocabs))
    request_specs = draw(
        st.lists(
            st.builds(
                RequestSpec,
                prompt_len=st.integers(1, min(max_model_len - 1, max_prompt_len)),
                max_tokens=st.integers(1, 24),
                arrival_step=st.integers(0, max_arrival_step),
                use_eos=st.booleans(),
                ignore_eos=st.booleans(),
                stop_token_ids=st.lists(st.integers(0, vocab - 1), max_size=2).map(tuple),
            ),
            min_size=1,
            max_size=max_requests,
        )
    )
    abort = st.builds(
        Abort, step=st.integers(0, 30), index=st.integers(0, len(request_specs) - 1), mid_step=st.booleans()
    )
    aborts = draw(st.lists(abort, max_size=3))
    return Workload(
        num_blocks=num_blocks,
        block_size=block_size,
        watermark=draw(st.sampled_from([0.0, 0.01, 0.1, 0.3])),
        max_num_seqs=draw(st.integers(1, 8)),
        max_num_batched_tokens=draw(st.integers(1, 64)),
        max_model_len=max_model_len,
        vocab=vocab,
        requests=tuple(request_specs),
        aborts=tuple(aborts),
    )


def request_from_spec(spec: RequestSpec, request_id: str, arrival: float) -> Request:
    """The request a workload's spec describes, arriving at ``arrival``."""
    options = dict(eos=EOS if spec.use_eos else None, stop_token_ids=spec.stop_token_ids, ignore_eos=spec.ignore_eos)
    return make_request(request_id, spec.prompt_len, arrival=arrival, max_tokens=spec.max_tokens, **options)


# ----- KV checks ---------------------------------------------------------------


def check_pool(pool: BlockPool | ContiguousBlockPool | None, tables: Mapping[str, list[int]], name: str) -> None:
    """One owner per block, no block both free and owned, none lost or invented."""
    if pool is None:
        assert not tables, f"{name} blocks held without a {name} pool"
        return
    owned = [block for table in tables.values() for block in table]
    free = pool.free_block_ids()
    assert len(owned) == len(set(owned)), f"a {name} block is owned twice: {dict(tables)}"
    assert len(free) == len(set(free)) == pool.num_free, f"{name} free list is inconsistent"
    assert set(owned).isdisjoint(free), f"a {name} block is both free and owned"
    assert sorted(owned + free) == list(range(pool.num_blocks)), f"{name}: free + owned != total"


def copy_block(source: dict[int, tuple[str, int]], src: int, dest: dict[int, tuple[str, int]], dst: int) -> None:
    """Copy one block's label; a block nobody wrote (a slab's tail, a fresh victim's) copies as garbage."""
    if src in source:
        dest[dst] = source[src]
    else:
        dest.pop(dst, None)


class KVShadow:
    """What each device and CPU block holds, as (request, logical block) labels, moved as the executor moves KV.

    The fake executor trusts the block tables; this catches swap pairs that copy the right number of
    blocks to the wrong places (a swapped request that comes back with another block's KV).
    """

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.device: dict[int, tuple[str, int]] = {}
        self.cpu: dict[int, tuple[str, int]] = {}

    def run_step(self, output: SchedulerOutput) -> None:
        # The order the executor copies in: swap-ins first, then swap-outs.
        for cpu, device in output.blocks_to_swap_in:
            copy_block(self.cpu, cpu, self.device, device)
        for device, cpu in output.blocks_to_swap_out:
            copy_block(self.device, device, self.cpu, cpu)
        for item in output.scheduled:
            cached_blocks = -(-item.start_position // self.block_size)
            for index in range(cached_blocks):
                held = self.device.get(item.block_ids[index])
                assert held == (item.request_id, index), f"{item.request_id} block {index} holds {held}'s KV"
            for index in range(item.start_position // self.block_size, -(-item.context_len // self.block_size)):
                self.device[item.block_ids[index]] = (item.request_id, index)


# ----- The step driver ---------------------------------------------------------


class StepDriver:
    """Runs one ``Workload`` through a scheduler as the engine loop does, with a hook around every call.

    A step: the requests due arrive (``new_request``), the aborts due before the step, ``before_schedule``
    (whatever it returns is handed on), ``schedule``, ``after_schedule``, the executor, ``after_execute``,
    the aborts due mid-step (between the executor and ``update``, as when a client hangs up), ``update``,
    ``after_update``. Each abort is followed by ``after_abort``, and the workload's own aborts at a point by
    ``after_aborts``; once the scheduler drains, ``at_end``. The hooks do nothing here: subclasses check
    what their scheduler promises in them. The driver itself checks that an abort finds exactly the live
    requests and ends them, and that the workload drains within ``max_steps``.
    """

    def __init__(self, workload: Workload, scheduler: Scheduler, *, max_steps: int, swap_aware: bool = False) -> None:
        self.workload = workload
        self.scheduler = scheduler
        self.max_steps = max_steps
        self.token_fn: TokenFn = lambda rid, pos: hashed_token(rid, pos, workload.vocab)
        self.executor: FakeExecutor = (
            SwapAwareExecutor(scheduler, self.token_fn) if swap_aware else FakeExecutor(self.token_fn)
        )
        self.all_requests: dict[str, Request] = {}
        self.arrival_index: dict[str, int] = {}  # request id -> the order it arrived in
        self.aborted: set[str] = set()
        self.finished_reported: Counter[str] = Counter()  # finished_request_ids of the step outputs

    # ----- the loop ----------------------------------------------------------------

    def run(self) -> None:
        step = 0
        requests = self.workload.requests
        pending = sorted(range(len(requests)), key=lambda i: requests[i].arrival_step)
        while pending or self.scheduler.has_unfinished_requests():
            while pending and requests[pending[0]].arrival_step <= step:
                self.add(pending.pop(0))
            self.abort_at(step, mid_step=False)
            before = self.before_schedule()
            output = self.scheduler.schedule()
            self.after_schedule(output, before)
            sampled = self.executor.execute(output)
            self.after_execute(output)
            self.abort_at(step, mid_step=True)
            returned = self.scheduler.update(output, sampled, self.executor.accepted_drafts)
            self.after_update(output, returned)
            step += 1
            assert step <= self.max_steps, f"not drained after {self.max_steps} steps: the scheduler livelocks"
        self.at_end()

    def add(self, index: int) -> None:
        request = self.new_request(index)
        self.arrival_index[request.request_id] = len(self.arrival_index)
        self.all_requests[request.request_id] = request
        self.executor.prompts[request.request_id] = request.prompt_token_ids
        self.scheduler.add_request(request)

    def abort_at(self, step: int, mid_step: bool) -> None:
        for abort in self.workload.aborts:
            if abort.step == step and abort.mid_step == mid_step:
                self.abort(f"r{abort.index}")
        self.after_aborts(mid_step)

    def abort(self, request_id: str) -> None:
        live = request_id in self.scheduler.requests
        result = self.scheduler.abort_request(request_id)
        assert (result is not None) == live, "abort must find exactly the live requests"
        if result is not None:
            self.aborted.add(request_id)
            assert result.finish_reason is FinishReason.ABORT and result.is_finished
            kv = self.scheduler.kv_manager
            assert request_id not in kv.block_tables and request_id not in kv.cpu_block_tables
        self.after_abort(request_id)

    # ----- hooks -------------------------------------------------------------------

    def new_request(self, index: int) -> Request:
        """The workload's ``index``-th request, ``r{index}``, arriving one time unit after the previous one."""
        spec = self.workload.requests[index]
        return request_from_spec(spec, f"r{index}", arrival=float(len(self.all_requests)))

    def before_schedule(self) -> Any:
        """What to remember of the state before ``schedule``: it is handed to ``after_schedule``."""
        return None

    def after_schedule(self, output: SchedulerOutput, before: Any) -> None:
        pass

    def after_execute(self, output: SchedulerOutput) -> None:
        pass

    def after_update(self, output: SchedulerOutput, returned: list[Request]) -> None:
        pass

    def after_abort(self, request_id: str) -> None:
        pass

    def after_aborts(self, mid_step: bool) -> None:
        pass

    def at_end(self) -> None:
        pass

    # ----- checks the subclasses share ---------------------------------------------

    def collect_last_finishes(self) -> None:
        """One more ``schedule`` reports the requests that finished in the last step."""
        self.finished_reported.update(self.scheduler.schedule().finished_request_ids)

    def check_reported_once(self) -> None:
        assert dict(self.finished_reported) == dict.fromkeys(self.all_requests, 1), "not reported finished once"

    def check_output(self, request: Request) -> None:
        """The output a lone run gives: batching, chunking, preemption and swap must not change a token."""
        max_model_len = self.scheduler.config.max_model_len
        assert request.status is RequestStatus.FINISHED and request.finish_reason is not None
        assert request.num_output_tokens <= request.sampling_params.max_tokens
        assert request.num_tokens <= max_model_len
        expected, reason, stop_reason = reference_output(request, max_model_len, self.token_fn)
        if request.request_id in self.aborted:
            assert request.finish_reason is FinishReason.ABORT
            assert request.output_token_ids == expected[: request.num_output_tokens]
        else:
            assert request.output_token_ids == expected
            assert (request.finish_reason, request.stop_reason) == (reason, stop_reason)


# ----- The reference model -----------------------------------------------------


def hf_greedy(hf_model, prompt_token_ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy ``generate``: up to ``max_new_tokens`` tokens, EOS included if it comes."""
    import torch

    ids = torch.tensor([prompt_token_ids])
    with torch.no_grad():
        out = hf_model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0
        )
    return out[0, len(prompt_token_ids) :].tolist()


def read_gguf_once_per_file(monkeypatch) -> None:
    """gguf's reader and tensor-name map, memoized while ``monkeypatch`` holds. transformers' GGUF loader parses a
    file's metadata twice (the config, then the weights; the tokenizer a third time) and builds the name map again
    for every tensor (397 times for the default model): 10 of its 17 s there. Both are pure, so one reader per file
    (for the rest of the run: a file's bytes do not change under it) and one map per (architecture, layers) serve
    every call; what is read from them is unchanged."""
    import gguf

    monkeypatch.setattr(gguf, "GGUFReader", _one_gguf_reader)
    monkeypatch.setattr(gguf, "get_tensor_name_map", _tensor_name_map)


@functools.lru_cache(maxsize=4)
def _gguf_reader(path: str, mode: str):
    from gguf.gguf_reader import GGUFReader  # the class itself, where the patch does not reach

    return GGUFReader(path, mode)


def _one_gguf_reader(path, mode: str = "r"):
    return _gguf_reader(str(path), mode)


@functools.lru_cache(maxsize=16)
def _tensor_name_map(arch, n_blocks: int):
    from gguf.tensor_mapping import get_tensor_name_map

    return get_tensor_name_map(arch, n_blocks)


def write_gpt2_gguf(path) -> None:
    """A GGUF file of an architecture Conveyor does not run (gpt2): one tensor, enough for a refusal."""
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def cpu_flags() -> set[str]:
    """The words of /proc/cpuinfo, which hold its flags (empty where there is none: another OS): what the
    tests that follow the CPU's features check them against."""
    from pathlib import Path

    cpuinfo = Path("/proc/cpuinfo")
    return set(cpuinfo.read_text().split()) if cpuinfo.exists() else set()
