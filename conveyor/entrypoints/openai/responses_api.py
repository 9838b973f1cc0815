"""OpenAI's Responses API (``POST /v1/responses``) over the chat path: a request becomes a chat request (its
input items as messages, ``instructions`` as the system message, ``text.format`` as ``response_format``, the
tools and tool_choice as chat's), and the chat request's output comes back as a Response: a message item, or
function_call items, after a reasoning item where a reasoning parser read the reply's reasoning; streamed as the
Responses events (``response.created`` ... ``response.completed``).

``store`` (OpenAI's default: true) keeps a response in this process's memory, the newest
``MAX_STORED_RESPONSES``, so that ``GET /v1/responses/{id}`` returns it and ``previous_response_id`` carries on
its conversation (its input and output, not its instructions, as OpenAI does); a restart forgets them.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from typing import Any, Literal

from pydantic import Field

from conveyor.core.errors import FieldError
from conveyor.core.sampling import MAX_LOGPROBS
from conveyor.engine import RequestOutput
from conveyor.entrypoints.openai.logprob_format import LogprobFormatter
from conveyor.entrypoints.openai.protocol import MAX_TOOLS, Body, FunctionDefinition, JsonSchemaFormat
from conveyor.entrypoints.openai.reasoning import Phase, ReasoningParser, count_reasoning_tokens, read
from conveyor.entrypoints.openai.tool_calls import ForcedToolCalls, whole_call
from conveyor.entrypoints.openai.tool_parsers import AutoToolStream, ParsedCall, parse

MAX_STORED_RESPONSES = 1024

# Chat's names for what the Responses API calls otherwise: an error the chat path raises names the field the
# client sent.
FIELD_NAMES = {"max_completion_tokens": "max_output_tokens", "messages": "input", "response_format": "text.format"}


def responses_field(chat_field: str) -> str:
    """A chat request's field under the Responses API's name: ``response_format.json_schema`` is
    ``text.format.json_schema``; any message is ``input`` (the chat request's index counts the instructions and
    the history first, so it would point the client at the wrong item)."""
    head = chat_field.split(".")[0]
    if head not in FIELD_NAMES:
        return chat_field
    return FIELD_NAMES[head] + ("" if head == "messages" else chat_field[len(head):])


class TextFormat(JsonSchemaFormat):
    """``text.format``: chat's json_schema fields, flattened beside the type."""

    type: Literal["text", "json_object", "json_schema"]


class TextOptions(Body):
    format: TextFormat | None = None


class FunctionTool(FunctionDefinition):
    """A function tool: chat's function definition, flattened beside the type."""

    type: Literal["function"]


class NamedFunction(Body):
    type: Literal["function"]
    name: str


class ResponsesRequest(Body):
    model: str | None = None
    input: str | list[dict[str, Any]] = Field(min_length=1)
    instructions: str | None = None
    previous_response_id: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    stream: bool = False
    store: bool = True
    text: TextOptions | None = None
    tools: list[FunctionTool] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool = True
    truncation: Literal["disabled"] = "disabled"  # "auto" would drop the conversation's start: not done here
    include: list[Literal["message.output_text.logprobs"]] = Field(default_factory=list)
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)  # alternatives, with the include above
    metadata: dict[str, str] | None = Field(default=None, max_length=16)
    user: str | None = None
    safety_identifier: str | None = None  # OpenAI's successor of user: nothing here tells users apart
    prompt_cache_key: str | None = None  # a hint where caching is by request: here every prompt's prefix is cached
    service_tier: Literal["auto", "default"] | None = None

    def input_messages(self) -> list[dict[str, Any]]:
        """This request's input as chat messages, without the instructions."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        return [_message_of(item, i) for i, item in enumerate(self.input)]

    def chat_body(self, history: list[dict[str, Any]]) -> dict[str, Any]:
        """The chat request this one is: ``history`` (from previous_response_id), then the instructions as a
        system message, then the input."""
        system = [{"role": "system", "content": self.instructions}] if self.instructions is not None else []
        messages = [*system, *history, *self.input_messages()]  # the chat request caps their number
        body: dict[str, Any] = {
            "model": self.model, "messages": messages, "max_completion_tokens": self.max_output_tokens,
            "temperature": self.temperature, "top_p": self.top_p, "stream": self.stream, "user": self.user,
            "parallel_tool_calls": self.parallel_tool_calls,
        }
        if "message.output_text.logprobs" in self.include:
            body |= {"logprobs": True, "top_logprobs": self.top_logprobs or 0}
        if self.text is not None and self.text.format is not None:
            body["response_format"] = _response_format(self.text.format)
        if self.tools:
            body["tools"] = [{"type": "function", "function": tool.model_dump(exclude={"type"}, exclude_none=True)}
                             for tool in self.tools]
        if self.tool_choice is not None:
            choice = self.tool_choice
            body["tool_choice"] = choice if isinstance(choice, str) else {"type": "function",
                                                                          "function": {"name": choice.name}}
        return body


def _response_format(fmt: TextFormat) -> dict[str, Any]:
    if fmt.type != "json_schema":
        return {"type": fmt.type}
    return {"type": "json_schema", "json_schema": fmt.model_dump(by_alias=True, exclude={"type"}, exclude_none=True)}


def _message_of(item: dict[str, Any], index: int) -> dict[str, Any]:
    """One input item as a chat message: a message (its text parts joined), a function call the model made
    earlier, or a function call's output."""
    kind = item.get("type", "message")
    if kind == "function_call":
        call = {"id": item.get("call_id"), "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments", "")}}
        return {"role": "assistant", "content": None, "tool_calls": [call]}
    if kind == "function_call_output":
        return {"role": "tool", "tool_call_id": item.get("call_id"), "content": str(item.get("output", ""))}
    if kind != "message":
        raise FieldError("input", f"input: item {index} is of type {kind!r}; message, function_call and "
                         "function_call_output are supported")
    content = item.get("content")
    if isinstance(content, list):
        if any(not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text") for part in content):
            raise FieldError("input", f"input: item {index}: only input_text and output_text content parts are "
                                      "supported")
        content = "".join(str(part.get("text", "")) for part in content)
    if not isinstance(content, str) or item.get("role") not in ("user", "system", "developer", "assistant"):
        raise FieldError("input", f"input: item {index} needs a role (user, system, developer or assistant) and "
                                  "a content")
    return {"role": item["role"], "content": content}


class ResponseStore:
    """Stored responses, the newest MAX_STORED_RESPONSES, each with its conversation (input and output as
    chat messages) for a later previous_response_id. Written from the event loop, read from the tokenizer
    pool: locked."""

    def __init__(self, capacity: int = MAX_STORED_RESPONSES) -> None:
        self._items: OrderedDict[str, tuple[dict[str, Any], list[dict[str, Any]]]] = OrderedDict()
        self._capacity = capacity
        self._lock = threading.Lock()

    def put(self, response: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        with self._lock:
            self._items[response["id"]] = (response, conversation)
            while len(self._items) > self._capacity:
                self._items.popitem(last=False)

    def get(self, response_id: str) -> tuple[dict[str, Any], list[dict[str, Any]]] | None:
        with self._lock:
            return self._items.get(response_id)

    def delete(self, response_id: str) -> bool:
        """Forget a stored response (OpenAI's DELETE); False where none was stored under that id."""
        with self._lock:
            return self._items.pop(response_id, None) is not None


class ResponsesShape:
    """One response as the Responses API shows it: whole, or as its stream of events."""

    def __init__(self, body: ResponsesRequest, model: str, forced: ForcedToolCalls | None,
                 logprobs: LogprobFormatter, auto_tools: str | None = None,
                 reasoning: Callable[[], ReasoningParser] | None = None) -> None:
        """``forced``: the calls tool_choice forces; ``auto_tools``: the parser that reads the calls the model
        chose to make (tool_choice auto with --enable-auto-tool-choice), else None; ``reasoning``: what makes the
        parser that splits the reasoning off (--reasoning-parser), ahead of the rest, else None."""
        self.body, self.model, self.forced, self.logprobs = body, model, forced, logprobs
        self.auto_tools = auto_tools
        self.reasoning = reasoning if forced is None else None  # forced calls hold the reply from its first token
        self._auto = AutoToolStream(auto_tools) if auto_tools is not None else None
        # Streamed with auto_tools or a reasoning parser, items open as their text comes: the reasoning, the
        # message and calls, in order.
        self._ordered = auto_tools is not None or self.reasoning is not None
        self._auto_items: list[dict[str, Any]] = []
        self._thinking = self.reasoning() if self.reasoning is not None else None  # the streamed reply's parser
        self._reasoning_id = f"rs_{uuid.uuid4().hex}"
        self._reasoning_text = ""
        self._reasoning_at: int | None = None  # the reasoning item's place among _auto_items, once it began
        self._reasoning_done = False
        self._auto_text = ""  # the message's text streamed so far
        self._auto_message_at: int | None = None  # the message's place among _auto_items, once its text began
        self.id = f"resp_{uuid.uuid4().hex}"
        self.created_at = int(time.time())
        self._sequence = 0
        self._message_id = f"msg_{uuid.uuid4().hex}"
        self._calls: dict[int, dict[str, Any]] = {}  # streamed function_call items by call index
        self._tool_stream = forced.stream() if forced is not None else None
        self._text_started = False

    def envelope(self, status: str, output: list[dict[str, Any]], final: RequestOutput | None) -> dict[str, Any]:
        body = self.body
        response = {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "model": self.model, "output": output, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "previous_response_id": body.previous_response_id, "temperature": body.temperature, "top_p": body.top_p,
            "parallel_tool_calls": body.parallel_tool_calls, "store": body.store, "truncation": body.truncation,
            "tool_choice": body.tool_choice if isinstance(body.tool_choice, str) else (
                body.tool_choice.model_dump() if body.tool_choice else "auto"),
            "tools": [tool.model_dump(exclude_none=True) for tool in body.tools or ()],
            "text": {"format": (body.text.format.model_dump(by_alias=True, exclude_none=True)
                                if body.text and body.text.format else {"type": "text"})},
            "metadata": body.metadata or {}, "user": body.user, "usage": None,
        }
        if final is not None:
            prompt, out = len(final.prompt_token_ids), len(final.token_ids)
            reasoning = 0 if self.reasoning is None else count_reasoning_tokens(
                self.reasoning, final.token_ids, self.logprobs.tokenizer_decode)
            response["usage"] = {"input_tokens": prompt, "output_tokens": out, "total_tokens": prompt + out,
                                 "input_tokens_details": {"cached_tokens": final.num_cached_tokens},
                                 "output_tokens_details": {"reasoning_tokens": reasoning}}
        return response

    def full(self, final: RequestOutput) -> dict[str, Any]:
        return self.envelope(self.status(final), self.output_items(final), final)

    def status(self, final: RequestOutput) -> str:
        return "incomplete" if final.finish_reason == "length" else "completed"

    def output_items(self, final: RequestOutput) -> list[dict[str, Any]]:
        """The output: the function calls the text makes (tool_choice required or named), or one message; with a
        reasoning parser, the reasoning first (its item), and a message only where there is content after it."""
        status = self.status(final)
        if self.forced is not None:
            return [_function_call_item(call, self._call_status(status)) for call in self.forced.calls(final.text)]
        thought, text, content_first = [], final.text, False
        if self.reasoning is not None:
            parser = self.reasoning()
            reasoning, content = read(parser, final.text, ending=True)
            thought, text = ([self._reasoning_item(reasoning, "completed")] if reasoning else []), content
            content_first = parser.content_before > 0  # items in the order a stream opens them
        if self.auto_tools is not None:
            content, calls = parse(self.auto_tools, text)
            message = [self._message(content, status, self._logprobs(final))] if content else []
            items = message + thought if content_first and message else thought + message
            return items + [_function_call_item(whole_call(c.name, c.arguments), "completed") for c in calls]
        if self.reasoning is not None and not text:
            return thought
        message = [self._message(text, status, self._logprobs(final))]
        return message + thought if content_first else thought + message

    def _reasoning_item(self, text: str, status: str) -> dict[str, Any]:
        """The reasoning item: no content while in progress, then its one reasoning_text part."""
        content = [] if status == "in_progress" else [{"type": "reasoning_text", "text": text}]
        return {"type": "reasoning", "id": self._reasoning_id, "summary": [], "content": content, "status": status}

    def _logprobs(self, output: RequestOutput, streamed: bool = False) -> list[dict[str, Any]]:
        """The output_text's logprobs (chat's entries): all of them, or those a stream has not sent yet."""
        if output.logprobs is None:
            return []
        return (self.logprobs.chat_delta(output) if streamed else self.logprobs.chat(output.logprobs))["content"]

    def _call_status(self, status: str) -> str:
        """A listed call is complete once it is read; a named call is as complete as the response."""
        return status if self.forced is not None and self.forced.named is not None else "completed"

    def _message(self, text: str, status: str, logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        """The message item: no content while in progress, then its one output_text part."""
        content = [] if status == "in_progress" else [{"type": "output_text", "text": text, "annotations": [],
                                                       "logprobs": logprobs or []}]
        return {"type": "message", "id": self._message_id, "status": status, "role": "assistant", "content": content}

    @staticmethod
    def conversation_of(response: dict[str, Any]) -> list[dict[str, Any]]:
        """A response's output as chat messages, for the next response's history."""
        messages = []
        for item in response["output"]:
            if item["type"] == "reasoning":  # chat templates leave earlier turns' reasoning out
                continue
            if item["type"] == "message":
                messages.append({"role": "assistant", "content": "".join(p["text"] for p in item["content"])})
            else:
                messages.append(_message_of(item, 0))
        return messages

    # ----- the stream of events -----

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        self._sequence += 1
        return {"type": kind, "sequence_number": self._sequence - 1, **fields}

    def opening(self) -> list[dict[str, Any]]:
        response = self.envelope("in_progress", [], None)
        return [self.event("response.created", response=response), self.event("response.in_progress",
                                                                                 response=response)]

    def deltas(self, output: RequestOutput) -> list[dict[str, Any]]:
        """The events one step's output makes: text deltas, or function calls as they are read."""
        if self._ordered:
            return self._ordered_events(output.delta_text, ending=False)
        if self._tool_stream is not None:
            return [e for call in self._tool_stream.feed(output.delta_text) for e in self._call_events(call)]
        events = []
        if not self._text_started:
            self._text_started = True
            events += [self.event("response.output_item.added", output_index=0,
                                  item=self._message("", "in_progress")),
                       self.event("response.content_part.added", item_id=self._message_id, output_index=0,
                                  content_index=0, part={"type": "output_text", "text": "", "annotations": []})]
        logprobs = self._logprobs(output, streamed=True)
        if output.delta_text or logprobs:
            events.append(self.event("response.output_text.delta", item_id=self._message_id, output_index=0,
                                     content_index=0, delta=output.delta_text, logprobs=logprobs))
        return events

    def _ordered_events(self, text: str, ending: bool) -> list[dict[str, Any]]:
        """With auto_tools or a reasoning parser: the events of the reply's next piece of text (``ending``: its
        last, with what the parsers held back), the reasoning read first, the rest as content and calls."""
        reasoning = ""
        if self._thinking is not None:
            reasoning, text = read(self._thinking, text, ending)
        events = self._reasoning_events(reasoning, ending)
        if self._auto is None:
            return events + self._auto_events(text, [])
        content, calls = self._auto.feed(text)
        if ending:
            more, last = self._auto.finish()
            content, calls = content + more, calls + last
        return events + self._auto_events(content, calls)

    def _reasoning_events(self, reasoning: str, ending: bool) -> list[dict[str, Any]]:
        """The reasoning item's events: opened at its first text, its deltas, and closed once the reasoning ends
        (at its closing tag, or with the reply)."""
        events = []
        if reasoning:
            if self._reasoning_at is None:
                self._reasoning_at, events = self._open_text_item(self._reasoning_item("", "in_progress"),
                                                                  {"type": "reasoning_text", "text": ""})
            self._reasoning_text += reasoning
            events.append(self.event("response.reasoning_text.delta", item_id=self._reasoning_id,
                                     output_index=self._reasoning_at, content_index=0, delta=reasoning))
        ended = ending or self._thinking is None or self._thinking.phase is Phase.AFTER
        if ended and self._reasoning_at is not None and not self._reasoning_done:
            self._reasoning_done = True
            index = self._reasoning_at
            item = self._auto_items[index] = self._reasoning_item(self._reasoning_text, "completed")
            events += [self.event("response.reasoning_text.done", item_id=self._reasoning_id, output_index=index,
                                  content_index=0, text=self._reasoning_text),
                       self.event("response.content_part.done", item_id=self._reasoning_id, output_index=index,
                                  content_index=0, part=item["content"][0]),
                       self.event("response.output_item.done", output_index=index, item=item)]
        return events

    def _open_text_item(self, item: dict[str, Any], part: dict[str, Any]) -> tuple[int, list[dict[str, Any]]]:
        """An item whose text streams (the reasoning, the message), opened in place among the ordered items with
        its one empty part: its index, and the events that open it."""
        index = len(self._auto_items)
        self._auto_items.append(item)
        return index, [self.event("response.output_item.added", output_index=index, item=dict(item)),
                       self.event("response.content_part.added", item_id=item["id"], output_index=index,
                                  content_index=0, part=part)]

    def _auto_events(self, content: str, calls: list[ParsedCall]) -> list[dict[str, Any]]:
        """With auto_tools or a reasoning parser: the message's text as it is read (its item opened at its first
        text), and each call read, whole, as an item of its own after what came before it."""
        events = []
        if content:
            if self._auto_message_at is None:
                self._auto_message_at, events = self._open_text_item(
                    self._message("", "in_progress"), {"type": "output_text", "text": "", "annotations": []})
            self._auto_text += content
            events.append(self.event("response.output_text.delta", item_id=self._message_id,
                                     output_index=self._auto_message_at, content_index=0, delta=content,
                                     logprobs=[]))
        for call in calls:
            item = _function_call_item(whole_call(call.name, call.arguments), "completed")
            index = len(self._auto_items)
            self._auto_items.append(item)
            opened = item | {"arguments": "", "status": "in_progress"}
            events += [self.event("response.output_item.added", output_index=index, item=opened),
                       self.event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                                  delta=item["arguments"]),
                       self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                  arguments=item["arguments"]),
                       self.event("response.output_item.done", output_index=index, item=dict(item))]
        return events

    def _ordered_closing(self, final: RequestOutput, status: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """With auto_tools or a reasoning parser: the last piece, what was held back, and the message's closing
        events; the output."""
        events = self._ordered_events(final.delta_text, ending=True)
        if self._auto_message_at is not None:
            index = self._auto_message_at
            item = self._auto_items[index] = self._message(self._auto_text, status, self._logprobs(final))
            part = item["content"][0]
            events += [self.event("response.output_text.done", item_id=self._message_id, output_index=index,
                                  content_index=0, text=self._auto_text, logprobs=part["logprobs"]),
                       self.event("response.content_part.done", item_id=self._message_id, output_index=index,
                                  content_index=0, part=part),
                       self.event("response.output_item.done", output_index=index, item=item)]
        return events, [dict(item) for item in self._auto_items]

    def _call_events(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        index = call["index"]
        events = []
        if index not in self._calls:
            item = self._calls[index] = _function_call_item(call, "in_progress") | {"arguments": ""}
            events.append(self.event("response.output_item.added", output_index=index, item=dict(item)))
        item = self._calls[index]
        delta = call["function"].get("arguments", "")
        item["arguments"] += delta
        if delta:
            events.append(self.event("response.function_call_arguments.delta", item_id=item["id"],
                                     output_index=index, delta=delta))
        if self.forced is not None and self.forced.named is None:  # a listed call comes complete
            events += self._call_done(index, "completed")
        return events

    def _call_done(self, index: int, status: str) -> list[dict[str, Any]]:
        item = self._calls[index]
        if item["status"] != "in_progress":
            return []
        item["status"] = status
        return [self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                           arguments=item["arguments"]),
                self.event("response.output_item.done", output_index=index, item=dict(item))]

    def closing(self, final: RequestOutput) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """The events that end the stream, and the response they end with (what a store keeps)."""
        status = self.status(final)
        if self._ordered:
            events, output = self._ordered_closing(final, status)
            response = self.envelope(status, output, final)
            kind = "response.incomplete" if status == "incomplete" else "response.completed"
            return [*events, self.event(kind, response=response)], response
        events = self.deltas(final)  # the last step's piece, and the item's start if nothing came before
        if self.forced is not None:
            events += [e for index in sorted(self._calls) for e in self._call_done(index, self._call_status(status))]
            output = [dict(self._calls[index]) for index in sorted(self._calls)]
        else:
            item = self._message(final.text, status, self._logprobs(final))
            part = item["content"][0]
            events += [self.event("response.output_text.done", item_id=self._message_id, output_index=0,
                                  content_index=0, text=final.text, logprobs=part["logprobs"]),
                       self.event("response.content_part.done", item_id=self._message_id, output_index=0,
                                  content_index=0, part=part),
                       self.event("response.output_item.done", output_index=0, item=item)]
            output = [item]
        response = self.envelope(status, output, final)
        kind = "response.incomplete" if status == "incomplete" else "response.completed"
        return [*events, self.event(kind, response=response)], response


def _function_call_item(call: dict[str, Any], status: str) -> dict[str, Any]:
    """A tool call (tool_calls.py's, OpenAI's chat shape) as a Responses function_call item, its id made from
    the call's."""
    return {"type": "function_call", "id": "fc_" + call["id"].removeprefix("call_"), "call_id": call["id"],
            "name": call["function"]["name"], "arguments": call["function"]["arguments"], "status": status}


async def sse_events(shape: ResponsesShape, outputs: AsyncIterator[RequestOutput],
                     on_done: Callable[[dict[str, Any]], None]) -> AsyncIterator[str]:
    """The stream as server-sent events (``event:`` names each); ``on_done(response)`` gets the final one."""

    def frame(payload: dict[str, Any]) -> str:
        return f"event: {payload['type']}\ndata: {json.dumps(payload)}\n\n"

    for payload in shape.opening():
        yield frame(payload)
    async for output in outputs:
        if not output.finished:
            for payload in shape.deltas(output):
                yield frame(payload)
            continue
        events, response = shape.closing(output)
        for payload in events:
            yield frame(payload)
        on_done(response)


def error_frame(message: str, code: str | None) -> str:
    """The Responses API's error event, for an engine that failed mid-stream."""
    payload = {"type": "error", "code": code, "message": message, "param": None, "sequence_number": 0}
    return f"event: error\ndata: {json.dumps(payload)}\n\n"
