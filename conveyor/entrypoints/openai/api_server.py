"""An OpenAI-compatible HTTP server over the background engine (FastAPI + uvicorn).

Every error leaves in OpenAI's shape, ``{"error": {"message", "type", "param",
"code"}}``; a stack trace is logged, never sent. Streams are server-sent
events: chunks ending with ``data: [DONE]``, or the Responses API's named
events; a client that disconnects aborts its
request, streamed or not, queued or running. With an API key, every route
but ``/health`` (and ``/metrics`` where the operator says so) needs it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import generate_latest
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

import conveyor
from conveyor.core.errors import FieldError, RequestRefused
from conveyor.core.request import Request as EngineRequest
from conveyor.engine import (
    CompilesOverloaded,
    EngineClient,
    EngineDead,
    EngineOverloaded,
    OutputStream,
    RequestFailed,
    RequestOutput,
)
from conveyor.engine.model_pool import ModelPool
from conveyor.engine.request_builder import MaxTokensRule
from conveyor.engine.tokenizer import Tokenizer
from conveyor.entrypoints.dashboard import DASHBOARD_PATHS, add_dashboard_routes
from conveyor.entrypoints.metrics import ModelsMetrics, ServerMetrics
from conveyor.entrypoints.openai.choices import open_streams
from conveyor.entrypoints.openai.logprob_format import LogprobFormatter
from conveyor.entrypoints.openai.middleware import APIKeyAuth, BodyLimit, HostAllowList, carries_key, error_body
from conveyor.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    SamplingRequest,
    TokenizeRequest,
    message_dicts,
)
from conveyor.entrypoints.openai.reasoning import ReasoningParser, reasoning_parser
from conveyor.entrypoints.openai.response_shapes import ChatShape, CompletionShape, ResponseShape, usage
from conveyor.entrypoints.openai.responses_api import (
    MAX_STORED_RESPONSES,
    ResponsesRequest,
    ResponsesShape,
    ResponseStore,
    error_frame,
    responses_field,
    sse_events,
)
from conveyor.entrypoints.openai.tool_parsers import PARSERS as TOOL_PARSERS
from conveyor.entrypoints.openai.tool_parsers import parser_for_template

logger = logging.getLogger("conveyor.server")
T = TypeVar("T")
GRAMMAR_WAITERS = 8  # requests waiting at once for a compiled grammar (more wait for a thread)


class APIError(Exception):
    def __init__(self, status: int, message: str, kind: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code


def _bad_field(error: ValueError) -> APIError:
    """A 400 for a bad field: the param is the field a FieldError carries (None for any other ValueError)."""
    param = error.field if isinstance(error, FieldError) else None
    return APIError(400, str(error), "invalid_request_error", param)


def _refusal(body: SamplingRequest, error: ValueError) -> APIError:
    """A 400 for a bad field of ``body``, under the name the client used for it."""
    return _bad_field(body.in_client_terms(error) if isinstance(error, FieldError) else error)


def _error_response(error: APIError, headers: dict[str, str] | None = None) -> JSONResponse:
    body = error_body(error.message, error.kind, error.param, error.code)
    return JSONResponse(body, status_code=error.status, headers=headers)


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

    @property
    def model_names(self) -> tuple[str, ...]:
        return (self.model_name, *self.model_aliases)

    def __post_init__(self) -> None:
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("--api-key / CONVEYOR_API_KEY is empty, which would leave the server open; "
                             "give a key, or unset it to serve without authentication")


def build_app(engine: EngineClient | ModelPool, settings: ServerSettings,
              metrics: ServerMetrics | ModelsMetrics) -> FastAPI:
    """The FastAPI app: error shapes, auth, and the routes, each group added by its own function.

    ``engine`` is one engine (served as ``settings.model_names``) or a pool of several models, and ``metrics``
    that engine's figures or every model's."""
    models = engine if isinstance(engine, ModelPool) else ModelPool.single(settings.model_names, engine)
    if not isinstance(metrics, ModelsMetrics):
        metrics = ModelsMetrics({models.default_name(): metrics})
    app = FastAPI(title="Conveyor", version=conveyor.__version__)
    app.add_middleware(BodyLimit, limit=settings.max_request_bytes, read_timeout=settings.body_read_timeout)
    if settings.api_key is not None:
        # The dashboard's two routes check the key themselves: also from ``?api_key=``, since a browser that
        # opens a page cannot send a header (see conveyor.entrypoints.dashboard).
        open_paths = frozenset({"/health", *DASHBOARD_PATHS, *(("/metrics",) if settings.metrics_without_auth else ())})
        app.add_middleware(APIKeyAuth, api_key=settings.api_key, open_paths=open_paths,
                           drain_limit=settings.max_request_bytes)
    _add_outer_layers(app, settings)
    _add_error_handlers(app)
    serving = _Serving(models, settings)
    models.on_unload.append(serving.forget)
    models.on_unload.append(metrics.on_unload)
    _add_info_routes(app, serving, metrics)
    _add_token_routes(app, serving)
    _add_generation_routes(app, serving)
    _add_responses_routes(app, serving)
    add_dashboard_routes(app, models, settings.api_key)
    return app


def _add_outer_layers(app: FastAPI, settings: ServerSettings) -> None:
    """CORS outside the key check (a browser's preflight carries no key), and the Host allow-list outermost."""
    if settings.allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=settings.allowed_origins,
                           allow_methods=settings.allowed_methods, allow_headers=settings.allowed_headers)
    if "*" not in settings.allowed_hosts:
        app.add_middleware(HostAllowList, allowed_hosts=frozenset(settings.allowed_hosts))


def _add_error_handlers(app: FastAPI) -> None:
    """Every error leaves in OpenAI's shape; an unexpected one is logged and answered without its trace."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, error: APIError) -> JSONResponse:
        return _error_response(error)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, error: RequestValidationError) -> JSONResponse:
        first = error.errors()[0] if error.errors() else {}
        location = [str(p) for p in first.get("loc", ()) if p != "body"]
        param = ".".join(location) or None
        message = f"{param}: {first.get('msg', 'invalid request')}" if param else first.get("msg", "invalid request")
        return JSONResponse(error_body(message, "invalid_request_error", param), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, error: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if error.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(str(error.detail), kind), status_code=error.status_code)

    @app.exception_handler(EngineOverloaded)
    async def _overloaded(_: Request, error: EngineOverloaded) -> JSONResponse:
        overloaded = APIError(503, f"server overloaded: {error}; retry later", "server_overloaded",
                              code="server_overloaded")
        return _error_response(overloaded, headers={"Retry-After": "1"})

    @app.exception_handler(CompilesOverloaded)
    async def _compiles_overloaded(_: Request, error: CompilesOverloaded) -> JSONResponse:
        busy = APIError(429, f"too many constraints compiling: {error}; retry later", "rate_limit_error",
                        code="grammar_compilers_busy")
        return _error_response(busy, headers={"Retry-After": "1"})

    @app.exception_handler(RequestRefused)
    async def _refused(_: Request, error: RequestRefused) -> JSONResponse:
        """A queue cap or a deadline the wait already misses: too many requests now (429), not a server down;
        Retry-After says when the engine expects room."""
        refused = APIError(429, f"request refused: {error}; retry later", "rate_limit_error", code=error.reason)
        return _error_response(refused, headers={"Retry-After": str(int(error.retry_after))})

    @app.exception_handler(EngineDead)
    async def _dead(_: Request, error: EngineDead) -> JSONResponse:
        return _error_response(_engine_error(error), headers={"Retry-After": "1"})

    @app.exception_handler(RequestFailed)
    async def _failed(_: Request, error: RequestFailed) -> JSONResponse:
        return _error_response(_engine_error(error))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, error: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        return JSONResponse(error_body("internal server error", "internal_server_error"), status_code=500)


def _engine_error(error: EngineDead | RequestFailed) -> APIError:
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
class _Model:
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


class _Serving:
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
        self._views: dict[str, _Model] = {}  # the running models' views, dropped when a model is stopped
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
    async def model(self, requested: str | None) -> AsyncIterator[_Model]:
        """The model a body names (the first served where it names none), loaded first if it is not; it stays
        loaded while the block builds and submits the request (then the engine's open request holds it)."""
        name = self.check_model(requested)
        async with self.models.use(name) as engine:
            yield self._view(name, engine)

    def _view(self, name: str, engine: EngineClient, at_start: bool = False) -> _Model:
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
        self._views[name] = view = _Model(name, engine, tool_parser)
        self._max_model_lens[name] = engine.max_model_len
        return view

    def forget(self, name: str, engine: EngineClient) -> None:
        """A model's engine is stopping: hold no reference that would keep its memory."""
        self._views.pop(name, None)

    def max_model_len_of(self, name: str) -> int | None:
        """A model's context length, known once it has loaded (None before)."""
        return self._max_model_lens.get(name)

    async def off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` in the tokenizer pool; the event loop serves others meanwhile."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, functools.partial(fn, *args))

    async def compile_grammar(self, model: _Model, body: SamplingRequest) -> None:
        """Compile the body's constraint, if it has one, in the grammar pool (into the engine's cache, where
        ``make_request`` finds it); a 400 naming the client's field if it cannot be compiled."""
        try:
            structured = body.structured_output()
            if structured is not None:
                loop = asyncio.get_running_loop()
                await loop.run_in_executor(self._grammar_pool, model.engine.compile_grammar, structured[1])
        except ValueError as error:
            raise _refusal(body, error) from None

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

    def make_request(self, model: _Model, body: SamplingRequest, prompt: str | list[int], kind: str) -> EngineRequest:
        """Check and tokenize (call through ``off_loop``)."""
        try:
            body.check_supported()
            return model.engine.requests.build(prompt, body.sampling_params(), f"{kind}-{uuid.uuid4().hex}",
                                              priority=body.priority, max_tokens=self.max_tokens)
        except ValueError as error:
            raise _refusal(body, error) from None

    def reasoning(self, body: ChatCompletionRequest) -> Callable[[], ReasoningParser] | None:
        """What makes the parser that splits the reply's reasoning off (--reasoning-parser), or None: without
        one, or where tool_choice forces calls (a grammar holds the reply to them from its first token)."""
        name = self.settings.reasoning_parser
        if name is None or body.forced_tool_calls() is not None:
            return None
        return reasoning_parser(name, constrained=body.structured_output() is not None)

    def make_chat_request(self, model: _Model, body: ChatCompletionRequest) -> EngineRequest:
        """Template, tokenize and check a chat request (call through ``off_loop``)."""
        try:
            prompt = model.tokenizer.apply_chat_template(body.message_dicts(), **body.template_options())
        except ValueError as error:
            raise _refusal(body, error) from None
        if not prompt:  # a template may show only some roles: nothing to compute, no logits to sample from
            raise _refusal(body, FieldError("messages", "messages: the chat template renders these messages as "
                                                        "no tokens"))
        return self.make_request(model, body, prompt, "chatcmpl")

    async def respond(self, model: _Model, body: SamplingRequest, requests: list[EngineRequest], fmt: ResponseShape,
                      raw: Request):
        """Stream the requests' outputs as server-sent events, or wait for the last and answer it whole.

        Either way a client that disconnects aborts its requests at once, queued or running: their queue
        slots and KV blocks return to the others.
        """
        self.assign_service(requests, body, raw)
        try:  # refused (429), overloaded or dead (503): at once, from the handlers above
            stream = open_streams(model.engine, requests, final_only=not body.stream)
        except FieldError as error:  # more tokens than the queue cap could ever hold
            raise _refusal(body, error) from None
        if body.stream:  # the headers go out now; the tokens follow, and a disconnect cancels the stream
            return StreamingResponse(_sse(stream, fmt, *body.usage_in_stream()), media_type="text/event-stream")
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


def public_health(report: dict) -> dict:
    """What /health shows a caller without the key (it is open to all): each replica's state, not its process
    ids, host name or load (the open /health once showed every replica's PID and the machine's name)."""
    return {"replicas": [{"replica": r["replica"], "healthy": r["healthy"]} for r in report["replicas"]]}


def _add_info_routes(app: FastAPI, serving: _Serving, metrics: ServerMetrics) -> None:
    @app.get("/health")
    async def health(request: Request) -> Response:
        replicas = serving.models.health_report()  # None for one engine; each replica's state behind a router
        if replicas is not None and not carries_key(request.scope.get("headers"), serving.settings.api_key):
            replicas = public_health(replicas)
        if serving.models.error is not None:
            body = error_body("engine stopped", "internal_server_error") | (replicas or {})
            return JSONResponse(body, status_code=503)
        return Response(status_code=200) if replicas is None else JSONResponse(replicas)

    @app.get("/version")
    async def version() -> dict:
        return {"version": conveyor.__version__}

    @app.get("/metrics")
    async def prometheus_metrics() -> PlainTextResponse:
        metrics.on_scrape(serving.models.loaded())
        return PlainTextResponse(generate_latest(metrics.registry).decode(),
                                 media_type="text/plain; version=0.0.4")

    def card(name: str) -> dict:
        """A served name's entry; with several models it says whether its model is loaded now (an extra field,
        which OpenAI's clients keep), and its context length once it has loaded."""
        reported = serving.check_model(name)
        card = {"id": name, "object": "model", "created": int(time.time()), "owned_by": "conveyor"}
        max_model_len = serving.max_model_len_of(reported)
        if max_model_len is not None:
            card["max_model_len"] = max_model_len
        if serving.models.several:
            card["loaded"] = reported in serving.models.loaded()
        return card

    @app.get("/v1/models")
    async def models() -> dict:  # every served name, loaded or not, each model's reported one first (as vLLM)
        return {"object": "list", "data": [card(name) for name in serving.models.served_names]}

    @app.get("/v1/models/{model:path}")  # OpenAI's client.models.retrieve; a served name may hold a "/"
    async def model(model: str) -> dict:
        return card(model)


def _add_token_routes(app: FastAPI, serving: _Serving) -> None:
    def tokens_of(tokenizer: Tokenizer, body: TokenizeRequest) -> list[int]:
        try:
            if body.prompt is not None:
                return tokenizer.encode(body.prompt)
            return tokenizer.apply_chat_template(message_dicts(body.messages), **body.template_options())
        except ValueError as error:
            raise _bad_field(error) from None

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict:
        serving.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of prompt or messages", "invalid_request_error", "prompt")
        async with serving.model(body.model) as model:
            tokens = await serving.off_loop(tokens_of, model.tokenizer, body)
            return {"tokens": tokens, "count": len(tokens), "max_model_len": model.max_model_len}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict:
        async with serving.model(body.model) as model:
            vocab = model.engine.vocab_size
            if any(not 0 <= t < vocab for t in body.tokens):
                raise APIError(400, f"tokens must be in [0, {vocab})", "invalid_request_error", "tokens")
            return {"prompt": await serving.off_loop(model.tokenizer.decode, body.tokens, False)}


def _add_generation_routes(app: FastAPI, serving: _Serving) -> None:
    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request):
        try:
            prompts = body.prompts()
        except FieldError as error:
            raise _bad_field(error) from None
        serving.check_sequences(len(prompts), body.n)
        async with serving.model(body.model) as model:
            await serving.compile_grammar(model, body)
            requests = [await serving.off_loop(serving.make_request, model, body, prompt, "cmpl")
                        for prompt in prompts]
            fmt = CompletionShape(requests[0].request_id, model.name, LogprobFormatter(model.tokenizer), body.echo,
                                  prompt_logprobs=body.prompt_logprobs is not None,
                                  return_token_ids=body.return_token_ids)
            return await serving.respond(model, body, requests, fmt, raw)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw: Request):
        serving.check_sequences(1, body.n)
        async with serving.model(body.model) as model:
            try:
                auto_tools = body.auto_tool_parser(model.tool_parser)
            except FieldError as error:
                raise _refusal(body, error) from None
            await serving.compile_grammar(model, body)
            request = await serving.off_loop(serving.make_chat_request, model, body)
            fmt = ChatShape(request.request_id, model.name, LogprobFormatter(model.tokenizer), body.echoed(),
                            body.forced_tool_calls(), prompt_logprobs=body.prompt_logprobs is not None,
                            auto_tools=auto_tools, return_token_ids=body.return_token_ids,
                            reasoning=serving.reasoning(body))
            return await serving.respond(model, body, [request], fmt, raw)


def _add_responses_routes(app: FastAPI, serving: _Serving) -> None:
    """OpenAI's Responses API on the chat path (see conveyor.entrypoints.openai.responses_api)."""
    store = ResponseStore()

    @app.post("/v1/responses")
    async def create_response(body: ResponsesRequest, raw: Request):
        history: list[dict[str, Any]] = []
        if body.previous_response_id is not None:
            stored = store.get(body.previous_response_id)
            if stored is None:
                raise APIError(404, f"previous_response_id: no stored response {body.previous_response_id!r} (the "
                               f"newest {MAX_STORED_RESPONSES} made with store are kept, until a restart)",
                               "not_found_error", "previous_response_id")
            history = stored[1]
        try:
            chat = ChatCompletionRequest.model_validate(body.chat_body(history)).speaking_for(responses_field)
        except ValidationError as error:  # a chat field the Responses body filled wrongly, in the client's names
            invalid = _first_field_error(error)
            raise _bad_field(invalid.renamed(responses_field(invalid.field))) from None
        except ValueError as error:  # the input itself (named as the Responses API names it)
            raise _bad_field(error) from None
        async with serving.model(chat.model) as model:
            return await _create_response(serving, model, body, chat, history, store, raw)

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str) -> dict:
        stored = store.get(response_id)
        if stored is None:
            raise APIError(404, f"no stored response {response_id!r}", "not_found_error", "response_id")
        return stored[0]

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str) -> dict:
        """OpenAI's delete: a stored answer goes now, not when 1,024 newer ones push it out."""
        if not store.delete(response_id):
            raise APIError(404, f"no stored response {response_id!r}", "not_found_error", "response_id")
        return {"id": response_id, "object": "response", "deleted": True}


async def _create_response(serving: _Serving, model: _Model, body: ResponsesRequest, chat: ChatCompletionRequest,
                           history: list[dict[str, Any]], store: ResponseStore, raw: Request):
    """A Responses API request on ``model``, its chat body checked: answered whole, or streamed as events."""
    try:
        auto_tools = chat.auto_tool_parser(model.tool_parser)
        await serving.compile_grammar(model, chat)
        request = await serving.off_loop(serving.make_chat_request, model, chat)
    except ValueError as error:  # errors that name a field are in the Responses API's names already
        raise _refusal(chat, error) from None
    shape = ResponsesShape(body, model.name, chat.forced_tool_calls(), LogprobFormatter(model.tokenizer),
                           auto_tools, serving.reasoning(chat))
    conversation = [*history, *body.input_messages()]

    def keep(response: dict[str, Any]) -> None:
        if body.store:
            store.put(response, [*conversation, *ResponsesShape.conversation_of(response)])

    serving.assign_tenant([request], body.user, raw)
    stream = open_streams(model.engine, [request], final_only=not body.stream)
    if body.stream:
        return StreamingResponse(_responses_sse(shape, stream, keep), media_type="text/event-stream")
    outputs = await serving.finals(stream, raw, 1)
    if outputs is None:
        return Response(status_code=499)
    response = shape.full(outputs[0])
    keep(response)
    return response


def _first_field_error(error: ValidationError) -> FieldError:
    """Pydantic's first complaint as a FieldError naming its field by its path (``messages.0.content``)."""
    first = error.errors()[0]
    field = ".".join(str(part) for part in first["loc"])
    return FieldError(field, f"{field}: {first['msg']}")


async def _responses_sse(shape: ResponsesShape, stream: OutputStream, keep: Callable[[dict[str, Any]], None]):
    try:
        async for frame in sse_events(shape, stream, keep):
            yield frame
    except (EngineDead, RequestFailed) as error:
        failure = _engine_error(error)
        yield error_frame(failure.message, failure.code)
    finally:
        stream.close()  # a client gone mid-stream lands here too: abort


async def _sse(stream: OutputStream, fmt: ResponseShape, include_usage: bool, usage_every_chunk: bool):
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
        failure = _engine_error(error)
        yield event(error_body(failure.message, failure.kind, code=failure.code))
    finally:
        stream.close()  # a client gone mid-stream lands here too (the response's task is cancelled): abort
    yield "data: [DONE]\n\n"
