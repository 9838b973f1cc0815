"""The step loop: schedule, execute, update, and turn tokens into text.

The loop itself is :class:`conveyor.core.engine_core.EngineCore`, which the
simulator runs too; everything here is building the parts, checking what
callers hand in (so that a bad request is refused before it can disturb the
others), and text.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from conveyor.core.config import EngineConfig
from conveyor.core.engine_core import EngineCore, KVCachePlan, plan_kv_cache
from conveyor.core.model_config import ModelConfig
from conveyor.core.request import FinishReason, Request
from conveyor.core.sampling import SamplingParams
from conveyor.core.stats import EngineStats
from conveyor.engine.output import LogprobState, RequestMetrics, RequestOutput, TextState
from conveyor.engine.request_builder import RequestBuilder, check_logit_bias
from conveyor.engine.tokenizer import Tokenizer
from conveyor.model.weights.paths import resolve_model
from conveyor.observe.live import LiveRecorder, start_live
from conveyor.observe.trace import Trace, start_trace
from conveyor.platform.cpu import available_memory_bytes, release_freed_memory, resident_bytes

if TYPE_CHECKING:
    from conveyor.model.runner import RunnerPlan

logger = logging.getLogger("conveyor.engine")


@dataclasses.dataclass(slots=True)
class _SampleGroup:
    """A request with n > 1 (parallel sampling): sequence 0 runs first; the others are added when its prompt is
    computed, so they find the prompt's blocks in the prefix cache (the last partial block is computed again,
    which is how each gets a copy it may write)."""

    parent: Request
    started: bool = False  # sequences 1..n-1 added
    num_finished: int = 0


class Engine:
    runner: RunnerPlan  # how the model runs: device, dtypes, kernels, weight format (conveyor.model.runner)
    _trace: Trace | None = None  # set by start_trace
    _live: LiveRecorder | None = None  # set while a dashboard watches

    def __init__(self, config: EngineConfig, clock: Callable[[], float] = time.monotonic) -> None:
        # The model runner (torch) is imported here, not at module level, so that the engine's pure-Python
        # parts stay importable without it.
        from conveyor.executor.faults import with_injected_faults
        from conveyor.executor.grammar import LazyGrammarBackend
        from conveyor.executor.torch_executor import TorchExecutor
        from conveyor.model import runner

        self.config = config
        self.clock = clock
        folder = resolve_model(config.model)
        self.model_path = folder
        self.tokenizer = Tokenizer(folder, config.chat_template_text())
        self.model_config = ModelConfig.from_folder(folder)
        plan = runner.build_runner(config, self.model_config, folder)  # refuses an architecture before loading
        self.tokenizer.check_model_vocabulary(self.model_config.vocab_size)  # before the weights load: at once
        self.weight_file_bytes = plan.weight_file_bytes
        self.kv_token_bytes = self.model_config.kv_bytes_per_token * plan.kv_itemsize  # all layers, K and V
        kv = self._plan_kv_cache()
        self.kv_layout = kv.layout  # KV groups, where windowed layers give back blocks; None: one group
        self.kv_block_bytes = kv.block_bytes
        self.kv_pool_bytes = kv.num_blocks * kv.block_bytes
        self.max_model_len = kv.max_model_len
        model, self.runner = runner.load(plan, self.max_model_len, config.kernels)
        vocab_size = self.model_config.vocab_size
        self.grammars = LazyGrammarBackend(self.tokenizer.hf_tokenizer, vocab_size, self.tokenizer.eos_token_id,
                                           config.grammar_compile_timeout_ms / 1000)
        self.executor = TorchExecutor(
            model, kv.num_blocks, config.block_size, config.seed, kv.num_cpu_blocks,
            constrain=self.grammars.constrain, forget=self.grammars.forget, kv_layout=kv.layout,
            kv_dtype=runner.kv_torch_dtype(self.runner),
        )
        # The torch-free loop (scheduler, KV manager, trace) that the simulator runs too; the executor it runs
        # fails on purpose only where a test asked for it (see conveyor.executor.faults).
        self.core = EngineCore(config, kv, with_injected_faults(self.executor), clock)
        self._text: dict[str, TextState] = {}  # per sequence in the core
        self._logprobs: dict[str, LogprobState] = {}  # per sequence that asked for logprobs or prompt_logprobs
        self._caller: dict[str, tuple[str, int]] = {}  # sequence id -> (the caller's request id, index)
        self._sample_groups: dict[str, _SampleGroup] = {}  # requests with n > 1, by the caller's id
        self.requests = RequestBuilder(self.tokenizer, self.model_config.vocab_size, self.max_model_len, clock)
        release_freed_memory()  # what reading, packing and the first steps freed goes back to the system

    def _plan_kv_cache(self) -> KVCachePlan:
        """The pools, sized in the cache's own dtype, and the KV groups where windowed layers have their own."""
        available = available_memory_bytes()
        plan = plan_kv_cache(
            self.config, self.kv_token_bytes, self.model_config.max_position_embeddings,
            self.model_config.layer_windows,
            None if available is None else max(available - self.weight_file_bytes, 0),
        )
        if plan.layout is not None:
            logger.info("KV cache: %d groups of %d layers (windows %s): windowed groups give back the blocks "
                        "behind their window", plan.layout.num_groups, plan.layout.layers_per_group,
                        sorted({w for w in plan.layout.windows if w is not None}))
        return plan

    def memory_report(self) -> str:
        """Where the process's resident memory goes, in MiB: the weights' file, the KV pool (and the tokens it
        holds), and the rest (the runtime: Python, torch, the kernels, buffers)."""
        mib = 2**20
        resident = resident_bytes()
        tokens = self.kv_pool_bytes // self.kv_token_bytes
        parts = (f"weights {self.weight_file_bytes / mib:,.0f} MiB (the file), KV pool {self.kv_pool_bytes / mib:,.0f} "
                 f"MiB ({tokens:,} tokens in {self.runner.kv_cache_dtype})")
        if resident is None:
            return parts
        rest = resident - self.weight_file_bytes - self.kv_pool_bytes
        return f"resident {resident / mib:,.0f} MiB: {parts}, runtime and the rest {rest / mib:,.0f} MiB"

    @property
    def trace(self) -> Trace | None:
        """The trace ``start_trace`` began, if any."""
        return self._trace

    def start_trace(self) -> Trace:
        """Record every step from now on (see :mod:`conveyor.observe.trace`)."""
        self._trace = start_trace(self.core)
        return self._trace

    def start_live(self, show_text: bool = False) -> LiveRecorder:
        """Keep what a live dashboard shows from now on (see :mod:`conveyor.observe.live`), until ``stop_live``."""
        self.stop_live()
        self._live = start_live(self.core, show_text)
        return self._live

    def stop_live(self) -> None:
        if self._live is not None:
            self.core.unwatch(self._live)
            self._live = None

    # ----- requests ---------------------------------------------------------

    def make_request(
        self,
        prompt: str | list[int],
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> Request:
        """Tokenize and check a request without touching the engine (see RequestBuilder), and compile its
        constraint; raises FieldError naming the field."""
        request = self.requests.build(prompt, sampling_params, request_id, arrival_time, priority)
        self._check_params(request.sampling_params)
        return request

    def _check_params(self, params: SamplingParams) -> None:
        """What a request made elsewhere (a replicas front end) may still lack: token ids against the vocabulary,
        and that a constraint compiles (compiled here, once per constraint, so a bad one is refused before it
        reaches the engine)."""
        check_logit_bias(params, self.model_config.vocab_size)
        if params.structured_output is not None:
            self.grammars.compile(params.structured_output)

    def add_request(
        self,
        prompt: str | list[int] | Request,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        check_admission: bool = True,
    ) -> str:
        """Queue a request (a prompt, or one made by ``make_request`` or a front end); its id. FieldError for a bad
        one; RequestRefused where admission control turns it away, unless ``check_admission`` is False (the
        server's thread judged it already, on the latest view of the queue)."""
        if isinstance(prompt, Request):  # made elsewhere (a replicas front end holds only the tokenizer): check
            request = prompt  # what needs this engine (compiles are cached: no second cost for our own)
            self._check_params(request.sampling_params)
        else:
            request = self.make_request(prompt, sampling_params, request_id, arrival_time, priority)
        if request.request_id in self._sample_groups:
            raise ValueError(f"request_id {request.request_id!r} is already in the engine")
        if request.sampling_params.n == 1:
            self._add_sequence(request, request.request_id, 0, check_admission)
        else:
            self._add_sequence(self._sequence(request, 0), request.request_id, 0, check_admission)
            self._sample_groups[request.request_id] = _SampleGroup(request)
        return request.request_id

    def _add_sequence(self, request: Request, caller_id: str, index: int, check_admission: bool = False) -> None:
        """Queue one sequence; only the first of a request is judged by admission control (the others join an
        admitted request)."""
        params = request.sampling_params
        if params.prompt_logprobs is not None:
            # Every prompt token must be computed to have its logprobs: a salt of its own keeps the
            # sequence from finding its prompt in the prefix cache.
            request.cache_salt = f"prompt-logprobs:{request.request_id}"
        self.core.add_request(request, check_admission)  # first: a refused request leaves nothing behind
        if params.logprobs is not None or params.prompt_logprobs is not None:
            self._logprobs[request.request_id] = LogprobState([] if params.logprobs is not None else None)
        self._text[request.request_id] = TextState(request, self.tokenizer)
        self._caller[request.request_id] = (caller_id, index)

    @staticmethod
    def _sequence(request: Request, index: int) -> Request:
        """Sequence ``index`` of a request with n > 1: one draw of its own, seeded ``seed + index`` when seeded."""
        params = request.sampling_params
        seed = None if params.seed is None else params.seed + index
        return dataclasses.replace(
            request, request_id=f"{request.request_id}#{index}", output_token_ids=[],
            sampling_params=dataclasses.replace(params, n=1, seed=seed),
        )

    def _start_group(self, caller_id: str, group: _SampleGroup) -> None:
        """Sequence 0's prompt is computed (its blocks are in the prefix cache now): the others join, and find
        the prompt there instead of each computing it."""
        group.started = True
        for index in range(1, group.parent.sampling_params.n):
            self._add_sequence(self._sequence(group.parent, index), caller_id, index)

    def _sequence_finished(self, caller_id: str, group: _SampleGroup | None) -> None:
        if group is not None:
            group.num_finished += 1
            if group.num_finished == group.parent.sampling_params.n:
                del self._sample_groups[caller_id]

    def abort_request(self, request_id: str) -> bool:
        """End a request (every sequence of it, with n > 1); False if it is not in the engine."""
        group = self._sample_groups.pop(request_id, None)
        ids = [request_id] if group is None else [f"{request_id}#{i}" for i in range(group.parent.sampling_params.n)]
        found = False
        for sequence_id in ids:
            self._text.pop(sequence_id, None)
            self._logprobs.pop(sequence_id, None)
            self._caller.pop(sequence_id, None)
            found |= self.core.abort_request(sequence_id)
        return found

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def stats(self) -> EngineStats:
        """The queues, KV pools and counters after the latest step (see :class:`conveyor.core.stats.EngineStats`)."""
        return self.core.stats()

    # ----- the loop ---------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One iteration: every running request advances; finished ones leave; waiting ones join.

        A request the engine failed on (its step raised, or its text could not be made) comes back finished
        with ``finish_reason`` "error" and ``error`` set; with n > 1 its other sequences end with it.
        """
        return self.core.step(self._outputs)

    def _outputs(self, updated: list[Request]) -> list[RequestOutput]:
        if self._logprobs:
            self._collect_logprobs()
        outputs = []
        for request in updated:
            caller = self._caller.get(request.request_id)
            if caller is None:
                continue  # its request ended with an error earlier in this step (another sequence of it failed)
            try:
                outputs.append(self._output(request) if request.error is None else self._failed(request, *caller))
            except Exception as error:  # one request's text failed: end that request alone
                logger.exception("request %s: making its output failed", request.request_id)
                request.error = f"the engine failed while making the request's output ({type(error).__name__})"
                self.core.abort_request(request.request_id, FinishReason.ERROR)
                outputs.append(self._failed(request, *caller))
        return outputs

    def _failed(self, request: Request, caller_id: str, index: int) -> RequestOutput:
        """The last output of a request the engine failed on; a request with n > 1 ends whole."""
        self._caller.pop(request.request_id, None)
        state = self._text.pop(request.request_id, None)
        if self._sample_groups.get(caller_id) is not None:
            self.abort_request(caller_id)  # its other sequences: the caller gets one error for the request
        return RequestOutput(
            request_id=caller_id,
            prompt=request.prompt_text,
            prompt_token_ids=request.prompt_token_ids,
            text=state.text if state is not None else "",
            token_ids=list(request.output_token_ids),
            delta_text="",
            finished=True,
            finish_reason=FinishReason.ERROR.value,
            stop_reason=None,
            metrics=self._metrics(request),
            num_cached_tokens=request.num_cached_tokens,
            index=index,
            error=request.error,
        )

    @staticmethod
    def _metrics(request: Request) -> RequestMetrics:
        return RequestMetrics(
            request.arrival_time,
            request.first_scheduled_time,
            request.first_token_time,
            request.finish_time,
            request.num_preemptions,
        )

    def _collect_logprobs(self) -> None:
        """The executor's logprobs of the step that just ran, added to each sequence's."""
        for request_id, (first, found) in self.executor.last_prompt_logprobs.items():
            state = self._logprobs.get(request_id)
            if state is not None:
                state.prompt.update(zip(range(first, first + len(found)), found))
        for request_id, found in self.executor.last_logprobs.items():
            state = self._logprobs.get(request_id)
            if state is not None and state.sampled is not None:
                state.sampled.append(found)

    def _output(self, request: Request) -> RequestOutput:
        caller_id, index = self._caller[request.request_id]
        group = self._sample_groups.get(caller_id)
        if group is not None and not group.started:
            self._start_group(caller_id, group)
        state = self._text[request.request_id]
        finish_reason = request.finish_reason.value if request.finish_reason else None
        stop_reason = request.stop_reason
        if state.add_tokens(request.output_token_ids):
            # A stop string ends the request, and the output after the token that completed it (drafts accepted
            # past it) is dropped; when the same token also reached a length limit, or the core had ended the
            # request at a later token of the same step, the stop string wins.
            if not request.is_finished:
                self.core.finish_request(request.request_id, FinishReason.STOP, state.stop_string, state.num_tokens)
            del request.output_token_ids[state.num_tokens:]
            finish_reason, stop_reason = FinishReason.STOP.value, state.stop_string
        finished = request.is_finished
        logprobs = self._logprobs.get(request.request_id)
        if finished:
            self._logprobs.pop(request.request_id, None)
            del self._text[request.request_id]
            del self._caller[request.request_id]
            self._sequence_finished(caller_id, group)
        return RequestOutput(
            request_id=caller_id,
            prompt=state.prompt,
            prompt_token_ids=request.prompt_token_ids,
            text=state.text,
            token_ids=list(request.output_token_ids),
            delta_text=state.delta(finished),
            finished=finished,
            finish_reason=finish_reason,
            stop_reason=stop_reason,
            metrics=self._metrics(request),
            num_cached_tokens=request.num_cached_tokens,
            index=index,
            logprobs=None if logprobs is None or logprobs.sampled is None else list(logprobs.sampled),
            prompt_logprobs=None if logprobs is None else logprobs.prompt_list(request.num_prompt_tokens),
            embedding=self.executor.last_embeddings.get(request.request_id) if request.pooling else None,
        )

