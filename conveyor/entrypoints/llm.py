"""The offline API: hand over a list of prompts, get the outputs back in the same order."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from tqdm import tqdm

from conveyor.core.config import EngineConfig, read_chat_template
from conveyor.core.errors import RequestRefused
from conveyor.core.pooling import DEFAULT_POOLING, PoolingParams
from conveyor.core.request import Request
from conveyor.core.sampling import SamplingParams
from conveyor.engine import Engine, RequestOutput
from conveyor.engine.tokenizer import Tokenizer

Prompt = str | list[int]
Messages = list[dict[str, Any]]


class LLM:
    """``LLM(model=None, **engine options)``; ``model=None`` loads the default model."""

    def __init__(self, model: str | None = None, **options: Any) -> None:
        self.engine = Engine(EngineConfig(model=model, **options))
        self.tokenizer = self.engine.tokenizer

    def get_tokenizer(self) -> Tokenizer:
        """The engine's tokenizer (vLLM's name): ``encode``, ``decode``, ``apply_chat_template``."""
        return self.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """One output per prompt, in order; with ``n`` > 1, n outputs per prompt (``index`` 0..n-1) in a row.

        ``priority``: one integer per prompt, lower first (with ``scheduling_policy="priority"``).
        Raises RequestRefused (and runs none of them) when admission control turns one away: more prompts than
        ``max_num_queued_requests`` or ``max_num_queued_tokens`` allow at once, say.
        """
        prompts = _as_prompt_list(prompts)
        params = _per_prompt(sampling_params, len(prompts))
        priorities = list(priority) if priority is not None else [0] * len(prompts)
        if len(priorities) != len(prompts) or not all(isinstance(p, int) for p in priorities):
            raise ValueError(f"priority: one integer per prompt is needed, got {priority!r}")
        # Build and check every request before adding any: one bad prompt refuses the call, not half of it.
        requests = [
            self.engine.make_request(p, sp, priority=pr) for p, sp, pr in zip(prompts, params, priorities)
        ]
        self._add_all(requests)
        return self._run([(r.request_id, r.sampling_params.n) for r in requests], use_tqdm)

    def embed(self, prompts: Prompt | Sequence[Prompt], pooling: PoolingParams = DEFAULT_POOLING,
              use_tqdm: bool = True) -> list[RequestOutput]:
        """One vector per prompt, in order (``output.embedding``): the prompt's final hidden states pooled as
        ``pooling`` says (the last position by default, scaled to unit length), as vLLM's ``LLM.embed``. The
        prompts run as prompt-only requests through the same scheduler as generation."""
        requests = [self.engine.requests.build_pooled(prompt, pooling) for prompt in _as_prompt_list(prompts)]
        self._add_all(requests)
        return self._run([(r.request_id, 1) for r in requests], use_tqdm)

    def _add_all(self, requests: list[Request]) -> None:
        """Queue every request, or none: a queue cap or a deadline refuses the call whole, as a bad prompt does."""
        added: list[str] = []
        try:
            for request in requests:
                self.engine.add_request(request)
                added.append(request.request_id)
        except (RequestRefused, ValueError):
            for request_id in added:
                self.engine.abort_request(request_id)
            raise

    def chat(
        self,
        messages: Messages | Sequence[Messages],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
        chat_template: str | None = None,
    ) -> list[RequestOutput]:
        """One conversation (a list of ``{"role", "content"}``) or a list of them, rendered by the model's chat
        template as vLLM's ``LLM.chat`` does: ending with the assistant's header, or, with
        ``continue_final_message`` (and ``add_generation_prompt=False``), leaving the final message open for the
        model to continue; ``chat_template_kwargs`` are further variables for the template, ``tools`` OpenAI's
        tool definitions for a template that shows them; ``chat_template`` a template (its text, or a Jinja file's
        path) for this call, in place of the engine's (``LLM(chat_template=...)``, else the model's own)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        template = read_chat_template(chat_template)
        prompts = [self.tokenizer.apply_chat_template(list(c), add_generation_prompt, continue_final_message,
                                                      chat_template_kwargs, tools, template) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, requests: list[tuple[str, int]], use_tqdm: bool) -> list[RequestOutput]:
        """Step until every (request id, n) has its n sequences finished; their outputs in order, index by index.

        A request the engine failed on comes back with ``finish_reason`` "error" and ``error`` set, for each of
        its sequences (they end together); the others are not affected.
        """
        done: dict[tuple[str, int], RequestOutput] = {}
        failed: dict[str, RequestOutput] = {}
        total = sum(n for _, n in requests)
        with tqdm(total=total, desc="sequences", disable=not use_tqdm, unit="seq") as bar:
            while self.engine.has_unfinished_requests():
                for output in self.engine.step():
                    if output.error is not None:
                        failed.setdefault(output.request_id, output)
                    if output.finished:
                        done[output.request_id, output.index] = output
                        bar.update(1)
        return [
            done.get((request_id, index)) or dataclasses.replace(failed[request_id], index=index)
            for request_id, n in requests for index in range(n)
        ]


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt given as token ids
    return prompts


def _per_prompt(params: SamplingParams | Sequence[SamplingParams] | None, n: int) -> list[SamplingParams]:
    if params is None or isinstance(params, SamplingParams):
        return [params or SamplingParams()] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(f"sampling_params: {len(params)} given for {n} prompts")
    return params
