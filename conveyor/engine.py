"""The step loop: schedule, execute, update, and turn tokens into text.

``Engine.step`` is the whole of continuous batching in four lines; everything
else here is building the parts and checking what callers hand in, so that
a bad request is refused before it can disturb the others.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from conveyor.config import EngineConfig
from conveyor.kv import ContiguousKVCacheManager, PagedKVCacheManager
from conveyor.model.config import ModelConfig
from conveyor.request import FinishReason, Request
from conveyor.sampling import SamplingParams
from conveyor.scheduler import SCHEDULERS, SchedulerConfig, SchedulerOutput
from conveyor.tokenizer import IncrementalDetokenizer, Tokenizer
from conveyor.trace import Trace

logger = logging.getLogger("conveyor")


@dataclass(slots=True)
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finish_time: float | None
    num_preemptions: int

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def latency(self) -> float | None:
        return None if self.finish_time is None else self.finish_time - self.arrival_time


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    delta_text: str  # text added by this step, for streaming
    finished: bool
    finish_reason: str | None
    stop_reason: str | int | None
    metrics: RequestMetrics


@dataclass(slots=True)
class _TextState:
    prompt: str | None
    detokenizer: IncrementalDetokenizer
    text: str = ""
    num_sent: int = 0  # characters already handed out as deltas


class Engine:
    def __init__(self, config: EngineConfig, clock: Callable[[], float] = time.monotonic) -> None:
        # torch is imported here, not at module level, so that the engine's pure-Python
        # parts stay importable without it.
        import torch

        from conveyor.executor.torch_executor import TorchExecutor
        from conveyor.model.loader import DTYPES, load_model, resolve_model

        self.config = config
        self.clock = clock
        folder = resolve_model(config.model)
        self.model_path = folder
        self.tokenizer = Tokenizer(folder)
        self.model_config = ModelConfig.from_folder(folder)
        if config.device == "auto":
            device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        else:
            device = torch.device(config.device)
        dtype = DTYPES[config.dtype]
        self.kv_block_bytes = config.block_size * self.model_config.kv_bytes_per_token * dtype.itemsize
        num_blocks = self._num_kv_blocks()
        self.max_model_len = self._max_model_len(num_blocks * config.block_size)
        model = load_model(folder, dtype, device, self.max_model_len)
        num_cpu_blocks = config.swap_space // self.kv_block_bytes if config.preemption_mode == "swap" else 0
        self.kv_manager = self._kv_manager(num_blocks, num_cpu_blocks)
        self.scheduler = SCHEDULERS[config.scheduler](
            SchedulerConfig(
                config.max_num_seqs,
                config.max_num_batched_tokens,
                self.max_model_len,
                config.scheduling_policy,
                config.preemption_mode,
            ),
            self.kv_manager,
            clock,
        )
        self.executor = TorchExecutor(model, num_blocks, config.block_size, config.seed, num_cpu_blocks)
        self._text: dict[str, _TextState] = {}
        self._ids = itertools.count()
        self.trace: Trace | None = None

    def start_trace(self) -> Trace:
        """Record every step from now on (see :mod:`conveyor.trace`)."""
        config = self.config
        header = {
            "scheduler": config.scheduler,
            "scheduling_policy": config.scheduling_policy,
            "preemption_mode": config.preemption_mode,
            "kv_layout": config.kv_layout,
            "block_size": config.block_size,
            "max_model_len": self.max_model_len,
            "max_num_seqs": config.max_num_seqs,
            "max_num_batched_tokens": config.max_num_batched_tokens,
        }
        self.trace = Trace(header, self.clock())
        return self.trace

    def _kv_manager(self, num_blocks: int, num_cpu_blocks: int) -> PagedKVCacheManager:
        if self.config.kv_layout == "contiguous":
            return ContiguousKVCacheManager(num_blocks, self.config.block_size, self.max_model_len, num_cpu_blocks)
        return PagedKVCacheManager(num_blocks, self.config.block_size, num_cpu_blocks=num_cpu_blocks)

    def _num_kv_blocks(self) -> int:
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        if self.config.kv_cache_memory < self.kv_block_bytes:
            raise ValueError(
                f"kv_cache_memory: {self.config.kv_cache_memory} bytes hold no block of {self.kv_block_bytes} bytes"
            )
        return self.config.kv_cache_memory // self.kv_block_bytes

    def _max_model_len(self, capacity: int) -> int:
        wanted = self.config.max_model_len
        model_limit = self.model_config.max_position_embeddings
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

    # ----- requests ---------------------------------------------------------

    def make_request(
        self,
        prompt: str | list[int],
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> Request:
        """Tokenize and check a request without touching the engine; raises ValueError naming the field."""
        params = sampling_params if sampling_params is not None else SamplingParams()
        token_ids = self._prompt_ids(prompt)
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt: {len(token_ids)} tokens, but max_model_len is {self.max_model_len}, "
                "which leaves no room for output"
            )
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        request = Request(
            request_id=request_id,
            prompt_token_ids=token_ids,
            sampling_params=params,
            arrival_time=self.clock() if arrival_time is None else arrival_time,
            eos_token_id=self.tokenizer.eos_token_id,
            priority=priority,
            prompt_text=prompt if isinstance(prompt, str) else None,
        )
        return request

    def _prompt_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt: empty prompt")
            return self.tokenizer.encode(prompt)
        token_ids = list(prompt)
        if not token_ids:
            raise ValueError("prompt: empty list of token ids")
        vocab = self.model_config.vocab_size
        bad = [t for t in token_ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt: token ids must be integers in [0, {vocab}), got {bad[:5]}")
        return token_ids

    def add_request(
        self,
        prompt: str | list[int] | Request,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> str:
        request = prompt if isinstance(prompt, Request) else self.make_request(
            prompt, sampling_params, request_id, arrival_time, priority
        )
        self.scheduler.add_request(request)
        detokenizer = IncrementalDetokenizer(
            self.tokenizer, request.prompt_token_ids, request.sampling_params.skip_special_tokens
        )
        self._text[request.request_id] = _TextState(request.prompt_text, detokenizer)
        return request.request_id

    def abort_request(self, request_id: str) -> bool:
        self._text.pop(request_id, None)
        return self.scheduler.abort_request(request_id) is not None

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # ----- the loop ---------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One iteration: every running request advances; finished ones leave; waiting ones join."""
        start = self.clock()
        scheduler_output: SchedulerOutput = self.scheduler.schedule()
        slots = self.scheduler.slot_holders() if self.trace is not None else []
        sampled = self.executor.execute(scheduler_output)
        touched = self.scheduler.update(scheduler_output, sampled)
        outputs = [self._output(request) for request in touched]
        if self.trace is not None:
            finished = [o.request_id for o in outputs if o.finished]
            self.trace.record(scheduler_output, slots, finished, start, self.clock())
        return outputs

    def _output(self, request: Request) -> RequestOutput:
        state = self._text[request.request_id]
        before = len(state.text)
        state.text += state.detokenizer.add(request.output_token_ids[-1])
        stop = request.sampling_params.stop
        if stop:
            self._check_stop_strings(request, state, before)
        if request.is_finished:
            del self._text[request.request_id]
            sendable = len(state.text)
        else:
            # Hold back a tail that may be the start of a stop string, so a stream never shows one.
            sendable = max(len(state.text) - max((len(s) for s in stop), default=1) + 1, state.num_sent)
        delta, state.num_sent = state.text[state.num_sent : sendable], sendable
        return RequestOutput(
            request_id=request.request_id,
            prompt=state.prompt,
            prompt_token_ids=request.prompt_token_ids,
            text=state.text,
            token_ids=list(request.output_token_ids),
            delta_text=delta,
            finished=request.is_finished,
            finish_reason=request.finish_reason.value if request.finish_reason else None,
            stop_reason=request.stop_reason,
            metrics=RequestMetrics(
                request.arrival_time,
                request.first_scheduled_time,
                request.first_token_time,
                request.finish_time,
                request.num_preemptions,
            ),
        )

    def _check_stop_strings(self, request: Request, state: _TextState, before: int) -> None:
        """End the request at the first stop string; the text keeps what came before it."""
        longest = max(len(s) for s in request.sampling_params.stop)
        search_from = max(before - longest + 1, 0)
        hits = [(state.text.find(s, search_from), s) for s in request.sampling_params.stop]
        hits = [(at, s) for at, s in hits if at >= 0]
        if not hits:
            return
        at, stop = min(hits)
        state.text = state.text[:at]
        if request.is_finished:  # the same token also reached a length limit: the stop string wins
            request.finish_reason, request.stop_reason = FinishReason.STOP, stop
        else:
            self.scheduler.finish_request(request.request_id, FinishReason.STOP, stop)
