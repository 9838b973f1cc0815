"""``tool_choice: auto``: the model decides whether to call a tool, and its text is read for calls in its own
format (vLLM's ``--enable-auto-tool-choice --tool-call-parser NAME``).

Each family's chat template teaches its model one way to write a call; a parser reads that way back:

- ``hermes`` (Qwen 2.5 / 3, Hermes, and any template that shows ``<tool_call>``): each call a JSON object
  ``{"name": ..., "arguments": {...}}`` between ``<tool_call>`` and ``</tool_call>``; the text around them is
  the message's content.
- ``llama3_json`` (Llama 3.1+): the whole reply one JSON object ``{"name": ..., "parameters": {...}}`` (or
  several, separated by ``;``), optionally after ``<|python_tag|>``.
- ``pythonic`` (Llama 3.2 / 4 and others): the whole reply a Python list of calls,
  ``[get_weather(city="Paris"), ...]``, arguments as literals.

A reply that does not parse as calls is content, whole: nothing the model wrote is lost. Streaming
(:class:`AutoToolStream`) sends content as it comes, holding back only what may begin a call; a hermes call
goes out once its closing tag arrives, a JSON or pythonic reply (whose end no tag marks) when the reply ends.
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass
from typing import Any

PARSERS = ("hermes", "llama3_json", "pythonic")
_HERMES_OPEN, _HERMES_CLOSE = "<tool_call>", "</tool_call>"
_HERMES_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)
_PYTHON_TAG = "<|python_tag|>"
_DECODER = json.JSONDecoder()


@dataclass(frozen=True, slots=True)
class ParsedCall:
    """One call read from the text: the function's name and its arguments as a JSON string."""

    name: str
    arguments: str


def parser_for_template(template: str | None) -> str | None:
    """The parser a chat template's own tool-call format needs (None: it shows none this module reads)."""
    if not template:
        return None
    if _HERMES_OPEN in template:
        return "hermes"
    if _PYTHON_TAG in template or '"parameters"' in template:
        return "llama3_json"
    return None


def parse(parser: str, text: str) -> tuple[str | None, list[ParsedCall]]:
    """A whole reply as (content, calls): content None where the reply is calls and nothing else."""
    if parser == "hermes":
        return _parse_hermes(text)
    stripped = text.strip()
    calls = _parse_json_calls(stripped) if parser == "llama3_json" else _parse_pythonic(stripped)
    if calls is None:
        return text, []
    return None, calls


def _as_call(obj: Any) -> ParsedCall | None:
    """A decoded JSON call ({"name", "arguments" | "parameters"}), or None if it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string already
        return ParsedCall(obj["name"], arguments)
    if not isinstance(arguments, dict):
        return None
    return ParsedCall(obj["name"], json.dumps(arguments, ensure_ascii=False))


def _parse_hermes(text: str) -> tuple[str | None, list[ParsedCall]]:
    if _HERMES_OPEN not in text:
        return text, []
    calls = []
    for block in _HERMES_BLOCK.finditer(text):
        try:
            call = _as_call(json.loads(block.group(1)))
        except json.JSONDecodeError:
            call = None
        if call is None:  # a block that is no call: the reply is content, whole
            return text, []
        calls.append(call)
    content = _HERMES_BLOCK.sub("", text).strip()
    return content or None, calls


def _parse_json_calls(text: str) -> list[ParsedCall] | None:
    """``{...}`` or ``{...}; {...}``, optionally after <|python_tag|>; None if that is not all the text is."""
    text = text.removeprefix(_PYTHON_TAG).strip()
    calls, at = [], 0
    while at < len(text):
        try:
            obj, at = _DECODER.raw_decode(text, at)
        except json.JSONDecodeError:
            return None
        call = _as_call(obj)
        if call is None:
            return None
        calls.append(call)
        while at < len(text) and text[at] in " \n\r\t;":
            at += 1
    return calls or None


def _parse_pythonic(text: str) -> list[ParsedCall] | None:
    """``[f(a=1), g(b="x")]`` with literal keyword arguments; None if the text is not exactly that."""
    if not (text.startswith("[") and text.endswith("]")):
        return None
    try:
        tree = ast.parse(text, mode="eval").body
    except SyntaxError:
        return None
    if not isinstance(tree, ast.List) or not tree.elts:
        return None
    calls = []
    for node in tree.elts:
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            return None
        try:
            arguments = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg is not None}
        except ValueError:
            return None
        calls.append(ParsedCall(node.func.id, json.dumps(arguments, ensure_ascii=False)))
    return calls


class AutoToolStream:
    """One streamed choice's text, read as it comes: each ``feed`` returns (content to send now, calls complete
    now); ``finish`` returns what was held back, once the reply has ended."""

    def __init__(self, parser: str) -> None:
        self.parser = parser
        self._text = ""
        self._sent = 0  # text before this has gone out as content (or been read as calls)
        self._in_calls = False  # a call has begun: the rest is held until it parses
        self.num_calls = 0

    def feed(self, delta: str) -> tuple[str, list[ParsedCall]]:
        self._text += delta
        if self.parser != "hermes":
            return self._feed_whole_reply()
        content, calls = "", []
        while True:
            if not self._in_calls:
                start = self._text.find(_HERMES_OPEN, self._sent)
                if start < 0:  # send all but what may begin the tag
                    safe = len(self._text) - _partial_suffix(self._text, _HERMES_OPEN)
                    content += self._text[self._sent:max(self._sent, safe)]
                    self._sent = max(self._sent, safe)
                    return content, calls
                content += self._text[self._sent:start]
                self._sent, self._in_calls = start, True
            end = self._text.find(_HERMES_CLOSE, self._sent)
            if end < 0:
                return content, calls
            end += len(_HERMES_CLOSE)
            block_content, block_calls = _parse_hermes(self._text[self._sent:end])
            if not block_calls:  # not a call after all: it goes out as content
                content += block_content or ""
            calls += block_calls
            self.num_calls += len(block_calls)
            self._sent, self._in_calls = end, False

    def _feed_whole_reply(self) -> tuple[str, list[ParsedCall]]:
        """llama3_json / pythonic: a reply that begins as calls may only be read at its end; one that does
        not is content from its first character."""
        if self._sent == 0 and not self._in_calls:
            head = self._text.lstrip()
            if not head:
                return "", []
            if self.parser == "pythonic":
                self._in_calls = head.startswith("[")
            else:  # a JSON object, or the tag before one (or what may yet become the tag)
                self._in_calls = head.startswith(("{", _PYTHON_TAG)) or _PYTHON_TAG.startswith(head)
        if self._in_calls:
            return "", []
        content, self._sent = self._text[self._sent:], len(self._text)
        return content, []

    def finish(self) -> tuple[str, list[ParsedCall]]:
        """What was held back, now that the reply has ended: its calls, or its text as content."""
        rest = self._text[self._sent:]
        self._sent = len(self._text)
        if not rest:
            return "", []
        content, calls = parse(self.parser, rest)
        self.num_calls += len(calls)
        return content or "", calls


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that is a beginning of ``tag`` (held back while streaming)."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0
