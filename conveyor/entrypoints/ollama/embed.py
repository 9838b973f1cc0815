"""Ollama's embeddings: ``/api/embed`` (inputs in a batch, vectors scaled to unit length) and the older
``/api/embeddings`` (one prompt, its vector as the model gives it). Both run as the OpenAI route's pooled
requests (conveyor.entrypoints.openai.serving's ``embed``), pooled as the server's ``--pooling`` says, through
the same scheduler as everything else.

``truncate`` (on by default, as Ollama's) cuts an input longer than the model's context to its first tokens;
off, such an input is a 400. ``dimensions`` is refused as on the OpenAI route: a model not trained to shorten
its vectors loses their meaning when they are cut.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Request
from pydantic import ConfigDict, Field

from conveyor.core.errors import FieldError
from conveyor.entrypoints.openai.embeddings import MAX_INPUTS
from conveyor.entrypoints.openai.protocol import Body
from conveyor.entrypoints.openai.serving import APIError, ModelView, Serving


class EmbedRequest(Body):
    """``/api/embed``'s body; the loading options (``keep_alive``, ``options``) are accepted and left to the
    server's flags, as on the other routes."""

    model_config = ConfigDict(extra="allow")
    model: str
    input: str | list[str] = Field(default_factory=list)
    truncate: bool = True
    dimensions: int | None = None
    options: dict[str, Any] | None = None
    keep_alive: Any = None

    def inputs(self) -> list[str]:
        if self.dimensions is not None:
            raise FieldError("dimensions", "dimensions: this model's embeddings have one fixed size (it was not "
                                           "trained to be shortened); leave dimensions out")
        inputs = [self.input] if isinstance(self.input, str) else list(self.input)
        if len(inputs) > MAX_INPUTS:
            raise FieldError("input", f"input: at most {MAX_INPUTS} inputs in one request, got {len(inputs)}")
        return inputs


class EmbeddingsRequest(Body):
    """``/api/embeddings``' body (the older route): one ``prompt``."""

    model_config = ConfigDict(extra="allow")
    model: str
    prompt: str = ""
    options: dict[str, Any] | None = None
    keep_alive: Any = None


def add_embed_routes(router: APIRouter, serving: Serving, model_name: Callable[[Serving, str], str]) -> None:
    """The two embedding routes on ``router``; ``model_name`` turns a client's model name into the served one
    (or a 404 in Ollama's words)."""

    @router.post("/api/embed")
    async def embed(body: EmbedRequest, raw: Request) -> dict:
        started = time.monotonic_ns()
        inputs = body.inputs()
        name = model_name(serving, body.model)
        async with serving.model(name) as model:
            load_ns = time.monotonic_ns() - started
            if not inputs:  # Ollama's way to load a model for embedding
                return {"model": name, "embeddings": [], "total_duration": 0, "load_duration": load_ns,
                        "prompt_eval_count": 0}
            ids = await serving.off_loop(_token_ids, model, inputs, body.truncate)
            outputs = await _vectors(serving, model, ids, raw, normalize=True)
        return {"model": name, "embeddings": [o.embedding for o in outputs],
                "total_duration": time.monotonic_ns() - started, "load_duration": load_ns,
                "prompt_eval_count": sum(len(o.prompt_token_ids) for o in outputs)}

    @router.post("/api/embeddings")
    async def embeddings(body: EmbeddingsRequest, raw: Request) -> dict:
        name = model_name(serving, body.model)
        async with serving.model(name) as model:
            if not body.prompt:  # as Ollama answers an empty prompt here: no vector
                return {"embedding": []}
            ids = await serving.off_loop(_token_ids, model, [body.prompt], True)
            (output,) = await _vectors(serving, model, ids, raw, normalize=False)
        return {"embedding": output.embedding}


def _token_ids(model: ModelView, inputs: list[str], truncate: bool) -> list[list[int]]:
    """Each input tokenized, cut to the model's context where ``truncate`` (a longer one is refused otherwise,
    when its request is built)."""
    limit = model.max_model_len
    ids = [model.tokenizer.encode(text) if text else [] for text in inputs]
    return [tokens[:limit] for tokens in ids] if truncate else ids


async def _vectors(serving: Serving, model: ModelView, ids: list[list[int]], raw: Request, normalize: bool):
    pooling = dataclasses.replace(serving.settings.pooling, normalize=normalize)
    outputs = await serving.embed(model, ids, None, raw, pooling)
    if outputs is None:
        raise APIError(499, "the client left", "invalid_request_error")
    return outputs
