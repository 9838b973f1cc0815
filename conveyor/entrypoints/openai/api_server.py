"""An OpenAI-compatible HTTP server over the background engine (FastAPI + uvicorn).

Every error leaves in OpenAI's shape, ``{"error": {"message", "type", "param",
"code"}}``; a stack trace is logged, never sent. Streams are server-sent
events: chunks ending with ``data: [DONE]``, or the Responses API's named
events; a client that disconnects aborts its
request, streamed or not, queued or running. With an API key, every route
but ``/health``, the chat page at ``/`` (whose own calls carry the key) and
``/metrics`` where the operator says so needs it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import generate_latest
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

import conveyor
from conveyor.core.errors import FieldError, RequestRefused
from conveyor.engine import (
    CompilesOverloaded,
    EngineClient,
    EngineDead,
    EngineOverloaded,
    OutputStream,
    RequestFailed,
)
from conveyor.engine.model_pool import ModelPool
from conveyor.engine.tokenizer import Tokenizer
from conveyor.entrypoints.chat_page import CHAT_PAGE_PATHS, add_chat_page_route
from conveyor.entrypoints.dashboard import DASHBOARD_PATHS, add_dashboard_routes
from conveyor.entrypoints.metrics import ModelsMetrics, ServerMetrics
from conveyor.entrypoints.openai.choices import open_streams
from conveyor.entrypoints.openai.embeddings import EmbeddingRequest, embedding_response
from conveyor.entrypoints.openai.logprob_format import LogprobFormatter
from conveyor.entrypoints.openai.middleware import APIKeyAuth, BodyLimit, HostAllowList, carries_key, error_body
from conveyor.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    field_error_of,
    message_dicts,
)
from conveyor.entrypoints.openai.response_shapes import ChatShape, CompletionShape
from conveyor.entrypoints.openai.responses_api import (
    MAX_STORED_RESPONSES,
    ResponsesRequest,
    ResponsesShape,
    ResponseStore,
    error_frame,
    responses_field,
    sse_events,
)
from conveyor.entrypoints.openai.serving import (
    APIError,
    ModelView,
    ServerSettings,
    Serving,
    bad_field,
    engine_error,
    refusal,
)

logger = logging.getLogger("conveyor.server")
AddRoutes = Callable[[FastAPI, Serving], None]  # adds an API family's routes over the served models


def _error_response(error: APIError, headers: dict[str, str] | None = None) -> JSONResponse:
    body = error_body(error.message, error.kind, error.param, error.code)
    return JSONResponse(body, status_code=error.status, headers=headers)


def build_app(engine: EngineClient | ModelPool, settings: ServerSettings,
              metrics: ServerMetrics | ModelsMetrics, more_apis: Sequence[AddRoutes] = ()) -> FastAPI:
    """The FastAPI app: error shapes, auth, and the routes, each group added by its own function.

    ``engine`` is one engine (served as ``settings.model_names``) or a pool of several models, and ``metrics``
    that engine's figures or every model's. ``more_apis``: further API families over the same models, each
    adding its routes (Ollama's: conveyor.entrypoints.ollama.add_ollama_routes); a package of its own, beside
    this one, which it builds on."""
    models = engine if isinstance(engine, ModelPool) else ModelPool.single(settings.model_names, engine)
    if not isinstance(metrics, ModelsMetrics):
        metrics = ModelsMetrics({models.default_name(): metrics})
    app = FastAPI(title="Conveyor", version=conveyor.__version__)
    app.add_middleware(BodyLimit, limit=settings.max_request_bytes, read_timeout=settings.body_read_timeout)
    if settings.api_key is not None:
        # The dashboard's two routes check the key themselves: also from ``?api_key=``, since a browser that
        # opens a page cannot send a header (see conveyor.entrypoints.dashboard). The chat page holds nothing of
        # the server's, and its calls carry the key (see conveyor.entrypoints.chat_page).
        open_paths = frozenset({"/health", *DASHBOARD_PATHS, *CHAT_PAGE_PATHS,
                                *(("/metrics",) if settings.metrics_without_auth else ())})
        app.add_middleware(APIKeyAuth, api_key=settings.api_key, open_paths=open_paths,
                           drain_limit=settings.max_request_bytes)
    _add_outer_layers(app, settings)
    _add_error_handlers(app)
    serving = Serving(models, settings)
    models.on_unload.append(serving.forget)
    models.on_unload.append(metrics.on_unload)
    _add_info_routes(app, serving, metrics)
    _add_token_routes(app, serving)
    _add_generation_routes(app, serving)
    _add_responses_routes(app, serving)
    _add_embedding_routes(app, serving)
    for add_routes in more_apis:
        add_routes(app, serving)
    add_dashboard_routes(app, models, settings.api_key)
    add_chat_page_route(app)
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

    async def answer(_: Request, error: Exception) -> JSONResponse:
        return _error_response(*as_api_error(error))

    # FieldError by name: left to the catch-all, Starlette answers it but raises it on as a server error.
    for kind in (APIError, FieldError, RequestValidationError, StarletteHTTPException, EngineOverloaded,
                 RequestRefused, EngineDead, RequestFailed, Exception):
        app.add_exception_handler(kind, answer)


def as_api_error(error: Exception) -> tuple[APIError, dict[str, str]]:
    """What an error raised while serving a request is answered with, and the headers that go with it, whichever
    API the client called (OpenAI's shape is made of it here, Ollama's in conveyor.entrypoints.ollama).

    Too many requests now (429: a queue cap, a deadline the wait already misses, the grammar compilers busy) and
    a server overloaded or stopping (503) say with Retry-After when to come back; an unexpected error is logged
    and answered without its trace."""
    if isinstance(error, APIError):
        return error, {}
    if isinstance(error, FieldError):  # a bad field, under the name the client knows it by
        return bad_field(error), {}
    if isinstance(error, RequestValidationError):
        return _invalid_body(error), {}
    if isinstance(error, StarletteHTTPException):
        kind = "not_found_error" if error.status_code == 404 else "invalid_request_error"
        return APIError(error.status_code, str(error.detail), kind), {}
    if isinstance(error, CompilesOverloaded):
        return APIError(429, f"too many constraints compiling: {error}; retry later", "rate_limit_error",
                        code="grammar_compilers_busy"), {"Retry-After": "1"}
    if isinstance(error, EngineOverloaded):
        return APIError(503, f"server overloaded: {error}; retry later", "server_overloaded",
                        code="server_overloaded"), {"Retry-After": "1"}
    if isinstance(error, RequestRefused):
        return APIError(429, f"request refused: {error}; retry later", "rate_limit_error",
                        code=error.reason), {"Retry-After": str(int(error.retry_after))}
    if isinstance(error, EngineDead):
        return engine_error(error), {"Retry-After": "1"}
    if isinstance(error, RequestFailed):
        return engine_error(error), {}
    logger.error("unhandled error", exc_info=error)
    return APIError(500, "internal server error", "internal_server_error"), {}


def _invalid_body(error: RequestValidationError) -> APIError:
    """Pydantic's first complaint, naming the field; a body that is not JSON says what the parser found, where."""
    first = error.errors()[0] if error.errors() else {}
    location = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(location) or None
    message = first.get("msg", "invalid request")
    if first.get("type") == "json_invalid":
        reason, where = first.get("ctx", {}).get("error", message), param or "0"
        return APIError(400, f"the body is not JSON: {reason} at character {where}", "invalid_request_error")
    return APIError(400, f"{param}: {message}" if param else message, "invalid_request_error", param)


def public_health(report: dict) -> dict:
    """What /health shows a caller without the key (it is open to all): each replica's state, not its process
    ids, host name or load (the open /health once showed every replica's PID and the machine's name)."""
    return {"replicas": [{"replica": r["replica"], "healthy": r["healthy"]} for r in report["replicas"]]}


def _add_info_routes(app: FastAPI, serving: Serving, metrics: ServerMetrics) -> None:
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


def _add_token_routes(app: FastAPI, serving: Serving) -> None:
    def tokens_of(tokenizer: Tokenizer, body: TokenizeRequest) -> list[int]:
        try:
            if body.prompt is not None:
                return tokenizer.encode(body.prompt)
            return tokenizer.apply_chat_template(message_dicts(body.messages), **body.template_options())
        except ValueError as error:
            raise bad_field(error) from None

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


def _add_generation_routes(app: FastAPI, serving: Serving) -> None:
    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request):
        try:
            prompts = body.prompts()
        except FieldError as error:
            raise bad_field(error) from None
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
                raise refusal(body, error) from None
            await serving.compile_grammar(model, body)
            request = await serving.off_loop(serving.make_chat_request, model, body)
            fmt = ChatShape(request.request_id, model.name, LogprobFormatter(model.tokenizer), body.echoed(),
                            body.forced_tool_calls(), prompt_logprobs=body.prompt_logprobs is not None,
                            auto_tools=auto_tools, return_token_ids=body.return_token_ids,
                            reasoning=serving.reasoning(body))
            return await serving.respond(model, body, [request], fmt, raw)


def _add_embedding_routes(app: FastAPI, serving: Serving) -> None:
    """/v1/embeddings (see conveyor.entrypoints.openai.embeddings)."""

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest, raw: Request):
        inputs = body.inputs()  # a FieldError is a 400 naming the field (as_api_error)
        async with serving.model(body.model) as model:
            outputs = await serving.embed(model, inputs, body.user, raw)
            if outputs is None:
                return Response(status_code=499)  # the client left (nginx's code); nobody reads this
            return embedding_response(outputs, model.name, body.encoding_format)


def _add_responses_routes(app: FastAPI, serving: Serving) -> None:
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
            invalid = field_error_of(error)
            raise bad_field(invalid.renamed(responses_field(invalid.field))) from None
        except ValueError as error:  # the input itself (named as the Responses API names it)
            raise bad_field(error) from None
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


async def _create_response(serving: Serving, model: ModelView, body: ResponsesRequest, chat: ChatCompletionRequest,
                           history: list[dict[str, Any]], store: ResponseStore, raw: Request):
    """A Responses API request on ``model``, its chat body checked: answered whole, or streamed as events."""
    try:
        auto_tools = chat.auto_tool_parser(model.tool_parser)
        await serving.compile_grammar(model, chat)
        request = await serving.off_loop(serving.make_chat_request, model, chat)
    except ValueError as error:  # errors that name a field are in the Responses API's names already
        raise refusal(chat, error) from None
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


async def _responses_sse(shape: ResponsesShape, stream: OutputStream, keep: Callable[[dict[str, Any]], None]):
    try:
        async for frame in sse_events(shape, stream, keep):
            yield frame
    except (EngineDead, RequestFailed) as error:
        failure = engine_error(error)
        yield error_frame(failure.message, failure.code)
    finally:
        stream.close()  # a client gone mid-stream lands here too: abort
