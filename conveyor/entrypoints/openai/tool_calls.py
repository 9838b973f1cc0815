"""Tool calls on chat, forced by structured output: ``tool_choice`` ``required`` or a named function.

The grammar holds the model to its tools' parameter schemas (vLLM's way, which works with any model whatever
its chat template; the tools also go to the template, for the models whose template shows them): for a named
function the model writes the arguments object itself, for ``required`` a JSON list of ``{"name",
"parameters"}`` objects, one per call. The text is read back as OpenAI's ``tool_calls``: whole, or, when
streaming, each call as soon as its JSON is complete (a named call's arguments as they come). ``auto`` would
reads the model's own tool-call format instead, with the parser the server was started with (tool_parsers.py).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from conveyor.core.structured import StructuredOutput

_DECODER = json.JSONDecoder()


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def whole_call(name: str, arguments: str) -> dict[str, Any]:
    """One call of a whole message's tool_calls, with an id of its own."""
    return {"id": _call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}


def call_delta(index: int, name: str, arguments: str) -> dict[str, Any]:
    """One call of a streamed delta: a whole call, with its index among the choice's calls."""
    return {"index": index} | whole_call(name, arguments)


@dataclass(frozen=True, slots=True)
class ForcedToolCalls:
    """The calls one chat request must make: ``parameters`` maps each tool's name to its parameter schema
    (an object of any shape where the tool gave none); ``named`` is the one function every choice calls, or
    None for ``required`` (one or more calls, of any of the tools)."""

    parameters: dict[str, dict[str, Any]]
    named: str | None
    parallel: bool = True  # OpenAI's parallel_tool_calls: false holds ``required`` to exactly one call

    def structured_output(self) -> StructuredOutput:
        if self.named is not None:
            return StructuredOutput(json=self.parameters[self.named])
        each = [{"type": "object", "properties": {"name": {"const": name}, "parameters": schema},
                 "required": ["name", "parameters"], "additionalProperties": False}
                for name, schema in self.parameters.items()]
        most = {} if self.parallel else {"maxItems": 1}
        return StructuredOutput(json={"type": "array", "minItems": 1, "items": {"anyOf": each}} | most)

    def calls(self, text: str) -> list[dict[str, Any]]:
        """A whole choice's text as OpenAI's tool_calls: what a stream of it would have sent, whole (text cut
        by max_tokens keeps a named call's partial arguments, and a list's complete calls only)."""
        return [{key: value for key, value in call.items() if key != "index"} for call in self.stream().feed(text)]

    def stream(self) -> ToolCallStream:
        return ToolCallStream(self)


def finish_reason(made_calls: bool, finish_reason: str | None) -> str | None:
    """OpenAI's finish_reason for a choice that made tool calls and ended of itself; a cut one keeps its own."""
    return "tool_calls" if made_calls and finish_reason == "stop" else finish_reason


def _arguments(call: dict[str, Any]) -> str:
    return json.dumps(call["parameters"], ensure_ascii=False)


class ToolCallStream:
    """One streamed choice's text turned into tool_call deltas, piece by piece."""

    def __init__(self, forced: ForcedToolCalls) -> None:
        self._named = forced.named
        self._text = ""
        self._read = 1  # where the next call of a "required" list may start: past its "["
        self.num_calls = 0

    def feed(self, delta: str) -> list[dict[str, Any]]:
        """The deltas this much more text makes: a named call's arguments as they come; a listed call once
        its JSON object is complete."""
        self._text += delta
        if self._named is not None:
            return self._named_delta(delta)
        found = []
        while (call := self._next_listed()) is not None:
            found.append(call_delta(self.num_calls, call["name"], _arguments(call)))
            self.num_calls += 1
        return found

    def _named_delta(self, delta: str) -> list[dict[str, Any]]:
        if self.num_calls == 0:
            self.num_calls = 1
            return [call_delta(0, self._named, delta)]
        return [{"index": 0, "function": {"arguments": delta}}] if delta else []

    def _next_listed(self) -> dict[str, Any] | None:
        start = self._read
        while start < len(self._text) and self._text[start] in " \n\r\t,":
            start += 1
        if start >= len(self._text) or self._text[start] == "]":
            return None
        try:
            call, self._read = _DECODER.raw_decode(self._text, start)
        except json.JSONDecodeError:  # not complete yet
            return None
        return call
