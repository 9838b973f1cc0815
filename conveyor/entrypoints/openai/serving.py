"""What the server's routes share: its settings, the served models as a request sees them, turning a body into
engine requests (tokenizing off the event loop, compiling grammars in their own pool), submitting them and
waiting for their answers, and the error every route raises for a bad request (APIError)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import logging
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from conveyor.core.errors import FieldError
from conveyor.core.pooling import DEFAULT_POOLING, PoolingParams
from conveyor.core.request import Request as EngineRequest
from conveyor.engine import EngineClient, EngineDead, OutputStream, RequestFailed, RequestOutput
from conveyor.engine.model_pool import ModelPool
from conveyor.engine.request_builder import MaxTokensRule
from conveyor.engine.tokenizer import Tokenizer
from conveyor.entrypoints.openai.choices import open_streams
from conveyor.entrypoints.openai.middleware import error_body
from conveyor.entrypoints.openai.protocol import ChatCompletionRequest, SamplingRequest
from conveyor.entrypoints.openai.reasoning import ReasoningParser, reasoning_parser
from conveyor.entrypoints.openai.response_shapes import ResponseShape, usage
from conveyor.entrypoints.openai.tool_parsers import PARSERS as TOOL_PARSERS
from conveyor.entrypoints.openai.tool_parsers import parser_for_template

logger = logging.getLogger("conveyor.server")
T = TypeVar("T")
GRAMMAR_WAITERS = 8  # requests waiting at once for a compiled grammar (more wait for a thread)


class APIError(Exception):
    def __init__(self, status: int, message: str, kind: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code


def bad_field(error: ValueError) -> APIError:
    """A 400 for a bad field: the param is the field a FieldError carries (None for any other ValueError)."""
    param = error.field if isinstance(error, FieldError) else None
    return APIError(400, str(error), "invalid_request_error", param)


def refusal(body: SamplingRequest, error: ValueError) -> APIError:
    """A 400 for a bad field of ``body``, under the name the client used for it."""
    return bad_field(body.in_client_terms(error) if isinstance(error, FieldError) else error)


@dataclass(slots=True)
class ServerSettings:
    model_name: str
    api_key: str | None = None
    max_request_bytes: int = 1 << 20
    default_max_tokens: int | None = None  # a request without max_tokens: None = the rest of the context
    metrics_without_auth: bool = False  # /metrics open to anyone who can reach the port, as /health is
    tokenizer_threads: int = 2  # the pool that tokenizes and templates, off the event loop
    # Work one request may ask for: its prompts x n sequences, each a batch slot (64 prompts x n=64, 4,096
    # sequences from 1 KB, once took 41 s of engine time at max_tokens 1).
    max_sequences_per_request: int = 64
    body_read_timeout: float = 30.0  # seconds a client has to send its body whole (408 and closed past it)
    allowed_origins: list[str] = dataclasses.field(default_factory=list)  # CORS: none unless asked
    allowed_methods: list[str] = dataclasses.field(default_factory=lambda: ["*"])
    allowed_headers: list[str] = dataclasses.field(default_factory=lambda: ["*"])
    allowed_hosts: list[str] = dataclasses.field(default_factory=lambda: ["*"])  # the Host names answered
    tenant_header: str | None = None  # the header naming a request's tenant; None: the body's ``user``
    # tool_choice auto (--enable-auto-tool-choice): the parser of the model's tool-call format, or "template"
    # for the one its chat template shows (tool_parsers.parser_for_template); None: auto is refused.
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None  # --reasoning-parser: reasoning.py's parser of <think> blocks; None: none
    # Further names the model answers to (--served-model-name a b c: b and c); responses report model_name.
    model_aliases: tuple[str, ...] = ()
    pooling: PoolingParams = DEFAULT_POOLING  # --pooling: how /v1/embeddings makes a prompt one vector

    @property
    def model_names(self) -> tuple[str, ...]:
        return (self.model_name, *self.model_aliases)

    def __post_init__(self) -> None:
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("--api-key / CONVEYOR_API_KEY is empty, which would leave the server open; "
                             "give a key, or unset it to serve without authentication")


def engine_error(error: EngineDead | RequestFailed) -> APIError:
    """The engine stopped (503: retry, the process is being restarted) or failed on this request (500)."""
    if isinstance(error, EngineDead):
        return APIError(503, str(error), "internal_server_error", code="engine_unavailable")
    return APIError(500, str(error), "internal_server_error", code="engine_error")


def _tool_parser(asked: str | None, template: str | None) -> str | None:
    """The parser tool_choice auto reads replies with: the one asked for, or with "template" the one the chat
    template's own format needs; a template that shows none is refused at start, naming the flag."""
    if asked != "template":
        return asked
    found = parser_for_template(template)
    if found is None:
        raise ValueError("--enable-auto-tool-choice: this model's chat template shows no tool-call format Conveyor "
                         f"reads; name one with --tool-call-parser ({', '.join(TOOL_PARSERS)})")
    return found


@dataclass(frozen=True, slots=True)
class ModelView:
    """One served model as a request sees it: its engine, and what the server reads of that engine (tokenizer,
    limits, the parser of its tool calls), which differ from one model to another."""

    name: str  # what its responses and metrics report
    engine: EngineClient
    tool_parser: str | None

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len


class Serving:
    """What the routes share: the served models, the settings, and turning a body into a request.

    Tokenizing and chat templating run in a small thread pool, never on the event loop: a 1 MiB prompt
    would otherwise hold up every open stream while it is tokenized.
    """

    def __init__(self, models: ModelPool, settings: ServerSettings) -> None:
        self.models = models
        self.settings = settings
        # The server's rule, as OpenAI's: a request without max_tokens gets --default-max-tokens (or the rest of
        # the context), and one asking past the context is refused.
        self.max_tokens = MaxTokensRule(settings.default_max_tokens, fit_context=True)
        if settings.reasoning_parser is not None:
            reasoning_parser(settings.reasoning_parser)  # an unknown name: refused at start
        self._views: dict[str, ModelView] = {}  # the running models' views, dropped when a model is stopped
        self._max_model_lens: dict[str, int] = {}  # each model's, once loaded: /v1/models shows it after
        for name, engine in models.loaded().items():
            self._view(name, engine, at_start=True)  # what the flags ask of a model loaded at start: checked now
        self._pool = ThreadPoolExecutor(settings.tokenizer_threads, thread_name_prefix="conveyor-tokenize")
        # Grammar compiles wait here, not in the tokenizer's pool: a schema that takes seconds to compile must not
        # hold up a plain request's tokenizing. The threads only wait (the compile runs in a compiler process);
        # the compilers themselves are bounded, and a compile past its budget is abandoned (see
        # conveyor.executor.grammar_compilers).
        self._grammar_pool = ThreadPoolExecutor(GRAMMAR_WAITERS, thread_name_prefix="conveyor-grammar")

    @contextlib.asynccontextmanager
    async def model(self, requested: str | None) -> AsyncIterator[ModelView]:
        """The model a body names (the first served where it names none), loaded first if it is not; it stays
        loaded while the block builds and submits the request (then the engine's open request holds it)."""
        name = self.check_model(requested)
        async with self.models.use(name) as engine:
            yield self._view(name, engine)

    def _view(self, name: str, engine: EngineClient, at_start: bool = False) -> ModelView:
        view = self._views.get(name)
        if view is not None and view.engine is engine:
            return view
        template = engine.tokenizer.chat_template
        try:
            tool_parser = _tool_parser(self.settings.tool_call_parser, template)
        except ValueError:
            if at_start:
                raise
            logger.warning("model %s: its chat template shows no tool-call format; tool_choice auto is refused for "
                           "it (name one with --tool-call-parser)", name)
            tool_parser = None
        if not template:
            which = f"model {name}" if self.models.several else "this model"
            logger.warning("%s has no chat template: chat requests (and the Responses API) are refused "
                           "until one is given with --chat-template FILE|TEMPLATE; /v1/completions works", which)
        self._views[name] = view = ModelView(name, engine, tool_parser)
        self._max_model_lens[name] = engine.max_model_len
        return view

    def view_if_loaded(self, name: str) -> ModelView | None:
        """The view of the model ``name`` (a reported name) if it is running now; None, loading nothing, if not."""
        engine = self.models.loaded().get(name)
        return None if engine is None else self._view(name, engine)

    def forget(self, name: str, engine: EngineClient) -> None:
        """A model's engine is stopping: hold no reference that would keep its memory."""
        self._views.pop(name, None)

    def max_model_len_of(self, name: str) -> int | None:
        """A model's context length, known once it has loaded (None before)."""
        return self._max_model_lens.get(name)

    async def off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` in the tokenizer pool; the event loop serves others meanwhile."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, functools.partial(fn, *args))

    async def compile_grammar(self, model: ModelView, body: SamplingRequest) -> None:
        """Compile the body's constraint, if it has one, in the grammar pool (into the engine's cache, where
        ``make_request`` finds it); a 400 naming the client's field if it cannot be compiled."""
        try:
            structured = body.structured_output()
            if structured is not None:
                loop = asyncio.get_running_loop()
                await loop.run_in_executor(self._grammar_pool, model.engine.compile_grammar, structured[1])
        except ValueError as error:
            raise refusal(body, error) from None

    def check_sequences(self, num_prompts: int, n: int) -> None:
        """Refuse a request for more sequences (prompts x n) than ``--max-sequences-per-request``."""
        limit = self.settings.max_sequences_per_request
        if num_prompts * n > limit:
            raise APIError(400, f"n: {num_prompts} prompt(s) x n={n} is {num_prompts * n} sequences, over the "
                                f"server's --max-sequences-per-request of {limit}", "invalid_request_error", "n")

    def check_model(self, name: str | None) -> str:
        """The reported name of the model ``name`` names (None: the first model's); a 404 where none is served."""
        reported = self.models.default_name() if name is None else self.models.reported_name(name)
        if reported is None:
            raise APIError(404, self.models.not_served(name), "not_found_error", "model", "model_not_found")
        return reported

    def make_request(self, model: ModelView, body: SamplingRequest, prompt: str | list[int], kind: str,
                     max_tokens: MaxTokensRule | None = None) -> EngineRequest:
        """Check and tokenize (call through ``off_loop``); ``max_tokens``: how it is settled, where another API
        settles it otherwise than OpenAI's (the server's rule)."""
        try:
            body.check_supported()
            return model.engine.requests.build(prompt, body.sampling_params(), f"{kind}-{uuid.uuid4().hex}",
                                              priority=body.priority, max_tokens=max_tokens or self.max_tokens)
        except ValueError as error:
            raise refusal(body, error) from None

    async def embed(self, model: ModelView, inputs: list[str | list[int]], user: str | None, raw: Request,
                    pooling: PoolingParams | None = None) -> list[RequestOutput] | None:
        """The pooled vector of each input (its final output, in the inputs' order), computed by the engine
        beside everything else it runs, pooled as ``pooling`` says (None: the server's --pooling); None where the
        client left first (its requests are then aborted)."""
        requests = await self.off_loop(self._pooled_requests, model, inputs, pooling or self.settings.pooling)
        self.assign_tenant(requests, user, raw)
        stream = open_streams(model.engine, requests, final_only=True)  # a FieldError is a 400 (as_api_error)
        return await self.finals(stream, raw, len(requests))

    @staticmethod
    def _pooled_requests(model: ModelView, inputs: list[str | list[int]],
                         pooling: PoolingParams) -> list[EngineRequest]:
        """Each input built (in the tokenizer pool); a bad one is a FieldError naming ``input``, a 400."""
        build = model.engine.requests.build_pooled
        return [build(given, pooling, f"embd-{uuid.uuid4().hex}") for given in inputs]

    def reasoning(self, body: ChatCompletionRequest) -> Callable[[], ReasoningParser] | None:
        """What makes the parser that splits the reply's reasoning off (--reasoning-parser), or None: without
        one, or where tool_choice forces calls (a grammar holds the reply to them from its first token)."""
        name = self.settings.reasoning_parser
        if name is None or body.forced_tool_calls() is not None:
            return None
        return reasoning_parser(name, constrained=body.structured_output() is not None)

    def make_chat_request(self, model: ModelView, body: ChatCompletionRequest,
                          max_tokens: MaxTokensRule | None = None) -> EngineRequest:
        """Template, tokenize and check a chat request (call through ``off_loop``)."""
        return self.make_request(model, body, self.chat_prompt(model, body), "chatcmpl", max_tokens)

    def chat_prompt(self, model: ModelView, body: ChatCompletionRequest) -> list[int]:
        """A chat request's messages through the model's chat template, as token ids (call through ``off_loop``)."""
        try:
            prompt = model.tokenizer.apply_chat_template(body.message_dicts(), **body.template_options())
        except ValueError as error:
            raise refusal(body, error) from None
        if not prompt:  # a template may show only some roles: nothing to compute, no logits to sample from
            raise refusal(body, FieldError("messages", "messages: the chat template renders these messages as "
                                                       "no tokens"))
        return prompt

    async def respond(self, model: ModelView, body: SamplingRequest, requests: list[EngineRequest],
                      fmt: ResponseShape, raw: Request):
        """Stream the requests' outputs as server-sent events, or wait for the last and answer it whole.

        Either way a client that disconnects aborts its requests at once, queued or running: their queue
        slots and KV blocks return to the others.
        """
        self.assign_service(requests, body, raw)
        try:  # refused (429), overloaded or dead (503): at once, from the handlers above
            stream = open_streams(model.engine, requests, final_only=not body.stream)
        except FieldError as error:  # more tokens than the queue cap could ever hold
            raise refusal(body, error) from None
        if body.stream:  # the headers go out now; the tokens follow, and a disconnect cancels the stream
            return StreamingResponse(sse(stream, fmt, *body.usage_in_stream()), media_type="text/event-stream")
        outputs = await self.finals(stream, raw, len(requests) * requests[0].sampling_params.n)
        if outputs is None:
            return Response(status_code=499)  # the client left (nginx's code); nobody reads this
        return fmt.full(outputs)

    def assign_service(self, requests: list[EngineRequest], body: SamplingRequest, raw: Request) -> None:
        """What the body asks of the engine beyond sampling: its tenant, cache salt and latency targets."""
        self.assign_tenant(requests, body.user, raw)
        ttft, tpot = (None if ms is None else ms / 1000 for ms in (body.ttft_slo_ms, body.tpot_slo_ms))
        for request in requests:
            request.cache_salt, request.ttft_slo, request.tpot_slo = body.cache_salt, ttft, tpot

    def assign_tenant(self, requests: list[EngineRequest], user: str | None, raw: Request) -> None:
        """Whom the requests are served for: the header ``--tenant-header`` names when the call has it (a
        gateway sets it), else OpenAI's ``user``; the fair policy shares by it, the metrics count by it (and
        ``--tenant-cache-salt`` salts the prefix cache by it)."""
        header = self.settings.tenant_header
        tenant = (raw.headers.get(header) if header else None) or user or ""
        for request in requests:
            request.tenant = tenant

    async def finals(self, stream: OutputStream, raw: Request, expected: int) -> list[RequestOutput] | None:
        """Each of the ``expected`` choices' final output, by index; None where the client left first (its
        requests are then aborted)."""
        finals: dict[int, RequestOutput] = {}  # the latest output of each choice (n > 1 or several prompts)
        watcher = asyncio.create_task(_close_on_disconnect(raw, stream))
        try:
            async for output in stream:
                finals[output.index] = output
        finally:
            watcher.cancel()
            stream.close()
        if len(finals) < expected or not all(o.finished for o in finals.values()):
            return None
        return [finals[index] for index in sorted(finals)]


async def _close_on_disconnect(raw: Request, stream: OutputStream) -> None:
    """Wait for the client to disconnect, then close (abort) its request."""
    while (await raw.receive())["type"] != "http.disconnect":
        pass
    stream.close()


async def sse(stream: OutputStream, fmt: ResponseShape, include_usage: bool, usage_every_chunk: bool):
    def event(payload: dict) -> str:
        return f"data: {json.dumps(payload)}\n\n"

    latest: dict[int, RequestOutput] = {}  # per sequence (n > 1: several), for the usage chunk
    try:
        async for output in stream:
            is_first = output.index not in latest
            latest[output.index] = output
            chunk = fmt.chunk(output, is_first)
            yield event(chunk | {"usage": usage(list(latest.values()))} if usage_every_chunk else chunk)
        if include_usage and latest:
            yield event(fmt.usage_chunk(list(latest.values())))
    except (EngineDead, RequestFailed) as error:
        failure = engine_error(error)
        yield event(error_body(failure.message, failure.kind, code=failure.code))
    finally:
        stream.close()  # a client gone mid-stream lands here too (the response's task is cancelled): abort
    yield "data: [DONE]\n\n"
