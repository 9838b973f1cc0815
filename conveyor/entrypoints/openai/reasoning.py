"""Reasoning parsers (vLLM's ``--reasoning-parser``): a reply's ``<think>...</think>`` text split from its answer,
into ``reasoning_content`` beside ``content``.

- ``deepseek_r1``: everything before ``</think>`` is reasoning, whether the reply opens with ``<think>`` or the
  chat template already put it in the prompt (DeepSeek-R1, Qwen3's thinking-only models); a reply that never
  writes ``</think>`` is reasoning whole (it was cut off while thinking).
- ``qwen3``: the reasoning is the ``<think>...</think>`` block the reply writes; a reply without ``<think>`` is
  content whole (Qwen3 with ``enable_thinking`` false, say).

Only the first block is reasoning: a later ``<think>`` is content. A parser reads a reply as it streams: ``feed``
takes the next piece of text and returns the reasoning and content it adds, holding back only what may be the
start of a tag split across pieces; ``finish`` returns what was held. The whole reply is the same text fed at
once, so a stream and a whole answer always split alike.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Callable, Sequence
from typing import Protocol

OPEN, CLOSE = "<think>", "</think>"


class Phase(enum.Enum):
    BEFORE = "before"  # no reasoning yet: text is content (qwen3, until <think>)
    REASONING = "reasoning"
    AFTER = "after"  # the reasoning ended: the rest is content


class ReasoningParser(Protocol):
    phase: Phase
    content_before: int  # characters of content read before the reasoning began

    def feed(self, delta: str) -> tuple[str, str]:
        """The (reasoning, content) that ``delta`` adds."""
        ...

    def finish(self) -> tuple[str, str]:
        """The (reasoning, content) held back, once the reply has ended."""
        ...


class _ThinkBlock:
    """The shared reading: content until the opening tag (where it is needed), reasoning until the closing one,
    content after."""

    def __init__(self, opened: bool, undecided: bool = False) -> None:
        self.phase = Phase.REASONING if opened else Phase.BEFORE
        self._opened = False  # the opening tag was read (a deepseek_r1 reply may still write it: dropped)
        self._pending = ""  # text not yet returned: what may begin a tag
        self._undecided = undecided  # reasoning held until a tag shows it is that (else content, at the end)
        self._held = ""
        self.content_before = 0  # characters of content returned before the reasoning began

    def feed(self, delta: str) -> tuple[str, str]:
        self._pending += delta
        reasoning, content = [], []
        while self.phase is not Phase.AFTER:
            tags = self._tags()
            out = reasoning if self.phase is Phase.REASONING else content
            found = [(at, tag) for tag in tags if (at := self._pending.find(tag)) >= 0]
            if not found:
                keep = max(_partial_suffix(self._pending, tag) for tag in tags)
                out.append(self._pending[:len(self._pending) - keep])
                self._pending = self._pending[len(self._pending) - keep:]
                break
            at, tag = min(found)
            out.append(self._pending[:at])
            self._pending = self._pending[at + len(tag):]
            if self._undecided:  # either tag shows that what came before was reasoning
                reasoning.insert(0, self._held)
                self._undecided, self._held = False, ""
            if tag == OPEN:
                self._opened = True
                if self.phase is Phase.BEFORE:
                    self.content_before = sum(map(len, content))
                    self.phase = Phase.REASONING
            else:
                self.phase = Phase.AFTER
        if self.phase is Phase.AFTER:
            content.append(self._pending)
            self._pending = ""
        if self._undecided:
            self._held += "".join(reasoning)
            return "", "".join(content)
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        rest, self._pending = self._pending, ""
        if self._undecided:  # no tag came: it was all content
            held, self._held = self._held, ""
            return "", held + rest
        return (rest, "") if self.phase is Phase.REASONING else ("", rest)

    def _tags(self) -> tuple[str, ...]:
        """The tags that mean something now."""
        if self.phase is Phase.BEFORE:
            return (OPEN,)
        return (CLOSE,) if self._opened else (OPEN, CLOSE)


class DeepSeekR1Parser(_ThinkBlock):
    """Reasoning from the reply's first character to ``</think>`` (a ``<think>`` the reply writes is dropped).

    ``constrained``: the reply is held to a constraint from its first token (response_format, guided_*), so its
    start may be no reasoning at all but the answer (a JSON object): the text is held back until a tag shows it
    is reasoning, and is content where the reply ends without one."""

    def __init__(self, constrained: bool = False) -> None:
        super().__init__(opened=True, undecided=constrained)


class Qwen3Parser(_ThinkBlock):
    """Reasoning only inside the ``<think>...</think>`` block the reply writes; without one, all is content."""

    def __init__(self) -> None:
        super().__init__(opened=False)


PARSERS: dict[str, Callable[[], ReasoningParser]] = {"deepseek_r1": DeepSeekR1Parser, "qwen3": Qwen3Parser}


def reasoning_parser(name: str, constrained: bool = False) -> Callable[[], ReasoningParser]:
    """What makes a fresh parser of ``name`` for each choice; ``constrained``: the request is held to a
    constraint from its first token (see DeepSeekR1Parser)."""
    if name not in PARSERS:
        raise ValueError(f"reasoning parser {name!r}: one of {', '.join(PARSERS)}")
    if name == "deepseek_r1" and constrained:
        return functools.partial(DeepSeekR1Parser, constrained=True)
    return PARSERS[name]


def read(parser: ReasoningParser, text: str, ending: bool = False) -> tuple[str, str]:
    """The (reasoning, content) the next piece of a reply adds; ``ending``: its last piece, with what the
    parser held back."""
    reasoning, content = parser.feed(text)
    if not ending:
        return reasoning, content
    more_reasoning, more_content = parser.finish()
    return reasoning + more_reasoning, content + more_content


def split(make: Callable[[], ReasoningParser], text: str) -> tuple[str | None, str | None]:
    """A whole reply as (reasoning, content), each None where empty (vLLM's shape)."""
    reasoning, content = read(make(), text, ending=True)
    return reasoning or None, content or None


def count_reasoning_tokens(make: Callable[[], ReasoningParser], token_ids: Sequence[int],
                           decode: Callable[[list[int]], str]) -> int:
    """Output tokens spent on reasoning: from the first of the reasoning (its opening tag's included) through the
    one that completes ``</think>`` (to the end, where the reasoning never closed). Found by bisection over
    decoded prefixes: a few decodes of the reply, not one per token."""
    ids = list(token_ids)

    def parsed(count: int) -> ReasoningParser:
        parser = make()
        parser.feed(decode(ids[:count]))
        return parser

    if split(make, decode(ids))[0] is None:
        return 0
    end = _first(len(ids), lambda count: parsed(count).phase is Phase.AFTER)
    ahead = parsed(len(ids)).content_before  # characters of content ahead of the reasoning (qwen3; rarely any)
    if not ahead:
        return end
    # The tokens wholly within that content are not reasoning.
    return end - max(_first(end, lambda count: len(decode(ids[:count])) > ahead) - 1, 0)


def _first(limit: int, reached: Callable[[int], bool]) -> int:
    """The smallest count in 0..limit for which ``reached`` (monotone) holds; ``limit`` where none does."""
    low, high = 0, limit
    while low < high:
        middle = (low + high) // 2
        if reached(middle):
            high = middle
        else:
            low = middle + 1
    return low


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that is a beginning of ``tag`` (held back while streaming)."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0
