"""What a structured-output request asks its text to match: a JSON schema, any JSON object, a regex, or a choice.

Plain data, torch-free, so it can ride on SamplingParams through the core; the
executor compiles it into a grammar (see ``conveyor.executor.grammar``).
``key`` is the canonical form grammars are cached by: the same schema sent
twice, with its keys in another order, compiles once.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from conveyor.core.errors import FieldError

StructuredKind = Literal["json", "json_object", "regex", "choice"]

# Limits checked before anything is compiled. Compile time grows steeply with nesting (900 nested arrays took
# 61 s, 200 take 0.4 s) and with size (a 20,000-value enum, 10 s); OpenAI's own structured outputs allow 10
# levels of objects and 1,000 enum values in all. What is under these compiles in milliseconds here; the
# compile's time budget (conveyor.executor.grammar_compilers) catches what slips through.
MAX_GRAMMAR_BYTES = 32 * 1024  # a schema's JSON text, a regex, or the choices together
MAX_SCHEMA_DEPTH = 32  # levels of objects and lists in a schema (one nested object is two: it and properties)
MAX_ENUM_VALUES = 1000  # enum and const values of a schema together, or guided_choice's choices


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    """Exactly one constraint. ``json``: a JSON schema (dict or its JSON text); ``json_object``: any JSON object;
    ``regex``: a regular expression the whole output matches; ``choice``: the output is one of these strings."""

    json: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.choice is not None and not isinstance(self.choice, tuple):
            object.__setattr__(self, "choice", tuple(self.choice))
        given = [name for name in ("json", "regex", "choice") if getattr(self, name) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise _refused(None, f"give exactly one of json, json_object, regex, choice; got {given}")
        if isinstance(self.json, str):
            try:
                object.__setattr__(self, "json", json.loads(self.json))
            except json.JSONDecodeError as error:
                raise _refused("json", f"not valid JSON ({error})") from None
            except RecursionError:  # JSON text nested thousands deep: Python's parser gives up
                raise _refused("json", f"the schema nests deeper than the limit of "
                               f"{MAX_SCHEMA_DEPTH} levels of objects and lists") from None
        if self.json is not None and not isinstance(self.json, dict):
            raise _refused("json", f"a JSON schema must be an object, got {self.json!r}")
        if self.regex is not None and (not isinstance(self.regex, str) or not self.regex):
            raise _refused("regex", f"must be a non-empty string, got {self.regex!r}")
        if self.choice is not None and (not self.choice or any(not isinstance(c, str) or not c for c in self.choice)):
            raise _refused("choice", f"must be non-empty strings, got {self.choice!r}")
        self._check_limits()

    def _check_limits(self) -> None:
        """Refuse, naming the limit, a constraint too big or too deep to compile in good time, and a schema that
        refers outside itself (xgrammar fetches no remote or file ``$ref``: it silently allowed any JSON)."""
        if self.kind == "json":
            _SchemaCounts().walk(self.json, 0)  # first: the depth bounds how deep the text below recurses
        kind, text = self.key
        if len(text.encode()) > MAX_GRAMMAR_BYTES:
            raise _refused(kind, f"{len(text.encode())} bytes, over the limit of "
                           f"{MAX_GRAMMAR_BYTES} bytes of a schema, regex or choices")
        if kind == "choice" and len(self.choice or ()) > MAX_ENUM_VALUES:
            raise _refused("choice", f"{len(self.choice or ())} choices, over the limit of "
                           f"{MAX_ENUM_VALUES}")


    def __hash__(self) -> int:
        return hash(self.key)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, StructuredOutput) and self.key == other.key

    @property
    def kind(self) -> StructuredKind:
        if self.json is not None:
            return "json"
        if self.json_object:
            return "json_object"
        return "regex" if self.regex is not None else "choice"

    @property
    def key(self) -> tuple[str, str]:
        """(kind, canonical text): what a compiled grammar is cached by."""
        kind = self.kind
        if kind == "json":
            return kind, json.dumps(self.json, sort_keys=True, separators=(",", ":"))
        if kind == "regex":
            return kind, self.regex or ""
        if kind == "choice":
            return kind, json.dumps(list(self.choice or ()))
        return kind, ""


@dataclass(slots=True)
class _SchemaCounts:
    """One walk over a schema: its depth, its enum values, and any ``$ref`` that leaves it."""

    num_enum_values: int = 0

    def walk(self, value: Any, depth: int) -> None:
        if depth > MAX_SCHEMA_DEPTH:
            raise _refused("json", f"the schema nests deeper than the limit of "
                           f"{MAX_SCHEMA_DEPTH} levels of objects and lists")
        if isinstance(value, list):
            for item in value:
                self.walk(item, depth + 1)
        elif isinstance(value, dict):
            self._check_node(value)
            for item in value.values():
                self.walk(item, depth + 1)

    def _check_node(self, node: dict[str, Any]) -> None:
        ref = node.get("$ref")
        if isinstance(ref, str) and not ref.startswith("#"):
            raise _refused("json", f"$ref {ref[:100]!r} points outside the schema; only refs "
                           "within it (#/$defs/...) are followed, nothing is fetched")
        enum = node.get("enum")
        self.num_enum_values += (len(enum) if isinstance(enum, list) else 0) + ("const" in node)
        if self.num_enum_values > MAX_ENUM_VALUES:
            raise _refused("json", f"more than the limit of {MAX_ENUM_VALUES} enum and const "
                           "values in the schema")


def _refused(kind: str | None, reason: str) -> FieldError:
    """A constraint refused, named ``structured_output.KIND`` (the server renames it to the client's field)."""
    field = "structured_output" if kind is None else f"structured_output.{kind}"
    return FieldError(field, f"{field}: {reason}")
