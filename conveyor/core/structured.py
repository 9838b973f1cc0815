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

StructuredKind = Literal["json", "json_object", "regex", "choice"]


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
            raise ValueError(f"structured_output: give exactly one of json, json_object, regex, choice; got {given}")
        if isinstance(self.json, str):
            try:
                object.__setattr__(self, "json", json.loads(self.json))
            except json.JSONDecodeError as error:
                raise ValueError(f"structured_output.json: not valid JSON ({error})") from None
        if self.json is not None and not isinstance(self.json, dict):
            raise ValueError(f"structured_output.json: a JSON schema must be an object, got {self.json!r}")
        if self.regex is not None and (not isinstance(self.regex, str) or not self.regex):
            raise ValueError(f"structured_output.regex: must be a non-empty string, got {self.regex!r}")
        if self.choice is not None and (not self.choice or any(not isinstance(c, str) or not c for c in self.choice)):
            raise ValueError(f"structured_output.choice: must be non-empty strings, got {self.choice!r}")

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
