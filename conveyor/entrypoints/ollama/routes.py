"""Ollama's API on the server's port: ``/api/chat``, ``/api/generate``, ``/api/tags``, ``/api/show``, ``/api/ps``,
``/api/version``, and ``/api/embed`` and ``/api/embeddings`` (embed.py), over the same served models as the
OpenAI routes (conveyor.entrypoints.openai.serving's Serving: the model pool, request building, grammars, the
tokenizer threads).

Streams are Ollama's: one JSON object a line (``application/x-ndjson``), on by default; an error mid-stream is a
line ``{"error": ...}``. Every error is ``{"error": message}``, with the status the OpenAI routes give the same
failure (404 for an unknown model, 400 naming a bad field, 429 and 503 with Retry-After); a body is read as JSON
whatever its Content-Type says, as Ollama reads it (``curl -d`` sends a form's).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.routing import APIRoute
from pydantic import ValidationError

import conveyor
from conveyor.core.errors import FieldError
from conveyor.core.request import Request as EngineRequest
from conveyor.engine import EngineDead, OutputStream, RequestFailed
from conveyor.engine.request_builder import MaxTokensRule
from conveyor.entrypoints.ollama import listing
from conveyor.entrypoints.ollama.embed import add_embed_routes
from conveyor.entrypoints.ollama.protocol import ChatRequest, GenerateRequest, OllamaRequest, ShowRequest
from conveyor.entrypoints.ollama.replies import Reply, loaded
from conveyor.entrypoints.openai.api_server import as_api_error
from conveyor.entrypoints.openai.choices import open_streams
from conveyor.entrypoints.openai.logprob_format import LogprobFormatter
from conveyor.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, field_error_of
from conveyor.entrypoints.openai.reasoning import ReasoningParser
from conveyor.entrypoints.openai.response_shapes import ChatShape
from conveyor.entrypoints.openai.serving import APIError, ModelView, Serving

NDJSON = "application/x-ndjson"
LATEST = ":latest"  # Ollama's default tag: "tiny:latest" names the model served as "tiny"


def error_response(error: Exception) -> JSONResponse:
    """Any error as Ollama answers it, with the status and headers the OpenAI routes give it."""
    api_error, headers = as_api_error(error)
    return JSONResponse({"error": api_error.message}, status_code=api_error.status, headers=headers)


class OllamaRoute(APIRoute):
    """A route of Ollama's API: its body read as JSON whatever the Content-Type, its errors in Ollama's shape."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            headers = [(k, v) for k, v in request.scope["headers"] if k != b"content-type"]
            as_json = request.scope | {"headers": [*headers, (b"content-type", b"application/json")]}
            try:
                return await handler(Request(as_json, request.receive))
            except Exception as error:  # every error is answered; as_api_error logs an unexpected one
                return error_response(error)

        return route


def add_ollama_routes(app: FastAPI, serving: Serving) -> None:
    """Ollama's routes on ``app``, over ``serving``'s models."""
    router = APIRouter(route_class=OllamaRoute, tags=["ollama"])
    _add_generation_routes(router, serving)
    _add_model_routes(router, serving)
    add_embed_routes(router, serving, _model_name)
    app.include_router(router)


def _model_name(serving: Serving, requested: str) -> str:
    """The reported name of the model ``requested`` names (with or without Ollama's ``:latest``); a 404 in
    Ollama's words where none is served."""
    for name in (requested, requested.removesuffix(LATEST)):
        reported = serving.models.reported_name(name)
        if reported is not None:
            return reported
    served = ", ".join(f'"{name}"' for name in serving.models.served_names)
    raise APIError(404, f'model "{requested}" not found; this server serves {served} (it pulls no models)',
                   "not_found_error", "model", "model_not_found")


def _as_openai(kind: type[ChatCompletionRequest | CompletionRequest], fields: dict[str, Any],
               client_field: Callable[[str], str]) -> ChatCompletionRequest | CompletionRequest:
    """The OpenAI body an Ollama request runs as, its errors named as the Ollama client sent the fields."""
    try:
        return kind.model_validate(fields).speaking_for(client_field)
    except ValidationError as error:
        invalid = field_error_of(error)
        raise invalid.renamed(client_field(invalid.field)) from None


def _reasoning(serving: Serving, body: OllamaRequest,
               chat: ChatCompletionRequest) -> Callable[[], ReasoningParser] | None:
    """The reply's reasoning is split off (into ``thinking``) where the server has a reasoning parser, unless
    ``think`` is false; ``think`` true where it has none is refused, as Ollama refuses it for a model that does
    not think."""
    thinks = body.thinks()
    if thinks is False:
        return None
    if thinks and serving.settings.reasoning_parser is None:
        raise FieldError("think", "think: this server splits no reasoning off a reply; start it with "
                                  "--reasoning-parser (deepseek_r1, qwen3) to serve a model that thinks")
    return serving.reasoning(chat)


def _add_generation_routes(router: APIRouter, serving: Serving) -> None:
    @router.post("/api/chat")
    async def chat(body: ChatRequest, raw: Request):
        started = time.monotonic_ns()
        body.log_ignored()
        name = _model_name(serving, body.model)
        if not body.messages:
            return await _load(serving, name, chat=True)
        openai = _as_openai(ChatCompletionRequest, body.openai_body(), body.client_field)
        async with serving.model(name) as model:
            load_ns = time.monotonic_ns() - started
            body.options.check_context(model.max_model_len)
            if openai.tools and model.tool_parser is None:
                raise FieldError("tools", "tools: calling tools needs a reader of this model's tool-call format: "
                                 "start the server with --enable-auto-tool-choice (and --tool-call-parser where the "
                                 "chat template shows no format it reads)")
            auto_tools = openai.auto_tool_parser(model.tool_parser)
            reasoning = _reasoning(serving, body, openai)
            await serving.compile_grammar(model, openai)
            rule = body.options.max_tokens_rule(serving.settings.default_max_tokens)
            request = await serving.off_loop(serving.make_chat_request, model, openai, rule)
            shape = ChatShape(request.request_id, model.name, LogprobFormatter(model.tokenizer), auto_tools=auto_tools,
                              reasoning=reasoning)
            return await _answer(serving, model, openai, request, Reply(shape, True, started, load_ns), raw)

    @router.post("/api/generate")
    async def generate(body: GenerateRequest, raw: Request):
        started = time.monotonic_ns()
        body.log_ignored()
        name = _model_name(serving, body.model)
        if not body.prompt:
            return await _load(serving, name, chat=False)
        async with serving.model(name) as model:
            load_ns = time.monotonic_ns() - started
            templated = not body.raw and bool(model.tokenizer.chat_template)  # without one: as Ollama's {{ .Prompt }}
            body.check_supported(templated)
            body.options.check_context(model.max_model_len)
            rule = body.options.max_tokens_rule(serving.settings.default_max_tokens)
            if templated:
                openai = _as_openai(ChatCompletionRequest, body.chat_body(), body.client_field)
                reasoning = _reasoning(serving, body, openai)
            else:
                openai, reasoning = _as_openai(CompletionRequest, body.completion_body(), body.client_field), None
            await serving.compile_grammar(model, openai)
            request = await serving.off_loop(_generate_request, serving, model, body, openai, rule)
            shape = ChatShape(request.request_id, model.name, LogprobFormatter(model.tokenizer), reasoning=reasoning)
            return await _answer(serving, model, openai, request, Reply(shape, False, started, load_ns), raw)


def _generate_request(serving: Serving, model: ModelView, body: GenerateRequest,
                      openai: ChatCompletionRequest | CompletionRequest, rule: MaxTokensRule) -> EngineRequest:
    """A generate request built (in the tokenizer pool): its prompt templated as a chat's, or raw, after the
    ``context`` an earlier reply returned."""
    if isinstance(openai, ChatCompletionRequest):
        prompt = serving.chat_prompt(model, openai)
        kind = "chatcmpl"
    else:
        prompt = model.tokenizer.encode(body.prompt) if body.context else body.prompt
        kind = "cmpl"
    if body.context:
        prompt = [*body.context, *prompt]
    return serving.make_request(model, openai, prompt, kind, rule)


async def _load(serving: Serving, name: str, chat: bool) -> JSONResponse:
    """Nothing to generate: load the model (Ollama's clients send an empty request for this) and say done."""
    async with serving.model(name):
        return JSONResponse(loaded(name, chat))


async def _answer(serving: Serving, model: ModelView, body: ChatCompletionRequest | CompletionRequest,
                  request: EngineRequest, reply: Reply, raw: Request) -> Response:
    """Submit the request; stream its objects, or wait for its end and answer whole. A client that disconnects
    aborts it, as on the OpenAI routes."""
    serving.assign_service([request], body, raw)
    stream = open_streams(model.engine, [request], final_only=not body.stream)
    if body.stream:
        return StreamingResponse(_ndjson(stream, reply), media_type=NDJSON)
    outputs = await serving.finals(stream, raw, 1)
    if outputs is None:
        return Response(status_code=499)  # the client left; nobody reads this
    return JSONResponse(reply.whole(outputs[0]))


async def _ndjson(stream: OutputStream, reply: Reply) -> AsyncIterator[str]:
    def line(payload: dict[str, Any]) -> str:
        return json.dumps(payload, ensure_ascii=False, separators=(",", ":")) + "\n"

    is_first = True
    try:
        async for output in stream:
            piece = reply.piece(output, is_first)
            is_first = False
            if piece is not None:
                yield line(piece)
            if output.finished:
                yield line(reply.closing(output))
    except (EngineDead, RequestFailed) as error:
        yield line({"error": as_api_error(error)[0].message})
    finally:
        stream.close()  # a client gone mid-stream lands here too: abort


def _add_model_routes(router: APIRouter, serving: Serving) -> None:
    models = serving.models

    @router.get("/api/version")
    async def version() -> dict:
        """Conveyor's version: this is not Ollama, and a client that gates a feature on Ollama's version should
        not be told it is."""
        return {"version": conveyor.__version__}

    @router.get("/api/tags")
    async def tags() -> dict:
        """Every name served, loaded or not (as /v1/models)."""
        facts = {name: await serving.off_loop(models.facts, name)
                 for name in dict.fromkeys(map(models.reported_name, models.served_names))}
        return {"models": [listing.tag(name, facts[models.reported_name(name)]) for name in models.served_names]}

    @router.post("/api/show")
    async def show(body: ShowRequest) -> dict:
        name = _model_name(serving, body.model_name())
        facts = await serving.off_loop(models.facts, name)
        view = serving.view_if_loaded(name)
        return listing.show(facts, view.tokenizer.chat_template or "" if view else "",
                            _capabilities(serving, view))

    @router.get("/api/ps")
    async def ps() -> dict:
        held = models.held_bytes()
        return {"models": [listing.running(name, await serving.off_loop(models.facts, name), held.get(name),
                                           engine.max_model_len) for name, engine in models.loaded().items()]}


def _capabilities(serving: Serving, view: ModelView | None) -> list[str]:
    """What a model does here, in Ollama's words: completion always; tools where its calls are read (known once
    it has loaded, unless the parser is named by flag); thinking where the server splits reasoning off."""
    asked = serving.settings.tool_call_parser
    reads_calls = view.tool_parser is not None if view is not None else asked not in (None, "template")
    return ["completion", "embedding", *(["tools"] if reads_calls else []),
            *(["thinking"] if serving.settings.reasoning_parser else [])]
