"""Ollama's answers to ``/api/chat`` and ``/api/generate``, made from the OpenAI chat answer's (ChatShape: the
text, its reasoning split off, its tool calls read, its logprobs), so the two APIs read one reply alike.

Streamed, each object carries what the reply adds (``message.content`` or ``response``, ``thinking``, whole tool
calls), ``done: false``; a closing object then carries ``done: true``, the ``done_reason`` (``stop`` or
``length``) and the timings. Whole, one object carries both. Timings are nanoseconds: ``total_duration`` from the
request's arrival to its answer, ``load_duration`` the wait for the model to load, ``prompt_eval_duration`` the
prompt's computing (its first step to the first token), ``eval_duration`` the output's (first token to last);
``prompt_eval_count`` counts the prompt's tokens, cached ones too.
"""

from __future__ import annotations

import datetime
import json
import time
from typing import Any

from conveyor.engine import RequestOutput
from conveyor.entrypoints.openai.response_shapes import ChatShape, timings


def created_at() -> str:
    """Now, in RFC 3339 (UTC), as Ollama stamps each object."""
    return datetime.datetime.now(datetime.UTC).isoformat().replace("+00:00", "Z")


def rfc3339(seconds: float | None) -> str | None:
    """A time (seconds since the epoch) in RFC 3339, None where unknown."""
    if seconds is None:
        return None
    return datetime.datetime.fromtimestamp(seconds, datetime.UTC).isoformat().replace("+00:00", "Z")


def loaded(model: str, chat: bool) -> dict[str, Any]:
    """The answer to a request with nothing to say (an empty prompt, no messages): Ollama's way to load a model."""
    return {"model": model, "created_at": created_at(), **_text(chat, {"content": ""}), "done": True,
            "done_reason": "load"}


class Reply:
    """One request's answer in Ollama's shapes, for chat (``message``) or generate (``response``, ``context``)."""

    def __init__(self, shape: ChatShape, chat: bool, started_ns: int, load_ns: int) -> None:
        """``started_ns``: when the request arrived (time.monotonic_ns); ``load_ns``: how long it waited for its
        model to load."""
        self.shape, self.chat, self.started_ns, self.load_ns = shape, chat, started_ns, load_ns

    def piece(self, output: RequestOutput, is_first: bool) -> dict[str, Any] | None:
        """A streamed object: what ``output`` adds to the reply; None where it adds nothing yet (a reasoning
        parser or a tool-call reader may hold text back)."""
        choice = self.shape.chunk(output, is_first)["choices"][0]
        text = _text(self.chat, choice["delta"])
        logprobs = (choice.get("logprobs") or {}).get("content") or []
        if not any(text.values()) and not logprobs:
            return None
        return self._head() | text | ({"logprobs": logprobs} if logprobs else {}) | {"done": False}

    def closing(self, output: RequestOutput) -> dict[str, Any]:
        """A stream's last object: done, why, and the timings."""
        return self._head() | _text(self.chat, {"content": ""}) | self._done(output)

    def whole(self, output: RequestOutput) -> dict[str, Any]:
        """The whole answer, from the request's final output."""
        choice = self.shape.full([output])["choices"][0]
        logprobs = (choice.get("logprobs") or {}).get("content")
        return (self._head() | _text(self.chat, choice["message"]) | ({"logprobs": logprobs} if logprobs else {})
                | self._done(output))

    def _head(self) -> dict[str, Any]:
        return {"model": self.shape.model, "created_at": created_at()}

    def _done(self, output: RequestOutput) -> dict[str, Any]:
        done = {"done": True, "done_reason": "length" if output.finish_reason == "length" else "stop",
                "total_duration": time.monotonic_ns() - self.started_ns, "load_duration": self.load_ns,
                "prompt_eval_count": len(output.prompt_token_ids), "eval_count": len(output.token_ids)}
        spent = timings([output]).get("timings")
        if spent is not None:
            done |= {"prompt_eval_duration": round(spent["prompt_ms"] * 1e6),
                     "eval_duration": round(spent["predicted_ms"] * 1e6)}
        if not self.chat:  # Ollama's context: the conversation so far, for the next request's context
            done["context"] = [*output.prompt_token_ids, *output.token_ids]
        return done


def _text(chat: bool, message: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI message (or delta) as Ollama's: chat's ``message`` with ``thinking`` and ``tool_calls`` (their
    arguments an object), or generate's ``response`` and ``thinking``."""
    content, thinking = message.get("content") or "", message.get("reasoning_content")
    if not chat:
        return {"response": content} | ({"thinking": thinking} if thinking else {})
    out: dict[str, Any] = {"role": "assistant", "content": content}
    if thinking:
        out["thinking"] = thinking
    if message.get("tool_calls"):
        out["tool_calls"] = [_tool_call(call, i) for i, call in enumerate(message["tool_calls"])]
    return {"message": out}


def _tool_call(call: dict[str, Any], position: int) -> dict[str, Any]:
    """An OpenAI tool call (arguments as JSON text) as Ollama's (arguments as an object; as the model wrote them
    where that is no JSON object, rather than lose them)."""
    function = call["function"]
    try:
        arguments = json.loads(function["arguments"] or "{}")
    except json.JSONDecodeError:
        arguments = function["arguments"]
    return {"id": call["id"], "function": {"index": call.get("index", position), "name": function["name"],
                                           "arguments": arguments}}
