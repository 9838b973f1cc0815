"""``--speculative-config``: vLLM's JSON shape, plus how the draft length is chosen.

``{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}`` as in
vLLM; ``method`` may also be ``suffix`` (drafts from the request and recent requests, SuffixDecoding-style).
``draft_length`` is Conveyor's: ``auto`` (the default) lets each step carry the drafts that are expected to
pay, from each request's acceptance so far and what steps of each size measured to cost, down to none when a
big batch makes them dearer than they save; ``fixed`` always carries ``num_speculative_tokens`` where the
proposer has them (vLLM's behaviour).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

METHODS = ("ngram", "suffix")
DRAFT_LENGTHS = ("auto", "fixed")
MAX_SPECULATIVE_TOKENS = 16  # a step's verify rows grow with it, and acceptance of a 16th draft is rare
MAX_LOOKUP = 16  # the longest n-gram matched
DEFAULT_LOOKUP = (2, 4)  # prompt_lookup_min and _max when neither is given


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 4  # the most drafts one request carries in a step
    prompt_lookup_min: int = DEFAULT_LOOKUP[0]  # the shortest n-gram a draft is matched on
    prompt_lookup_max: int = DEFAULT_LOOKUP[1]  # the longest, tried first
    draft_length: str = "auto"

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config: method must be one of {', '.join(METHODS)}, got {self.method!r}")
        if self.draft_length not in DRAFT_LENGTHS:
            raise ValueError(f"speculative_config: draft_length must be auto or fixed, got {self.draft_length!r}")
        _check_int("num_speculative_tokens", self.num_speculative_tokens, 1, MAX_SPECULATIVE_TOKENS)
        _check_int("prompt_lookup_min", self.prompt_lookup_min, 1, MAX_LOOKUP)
        _check_int("prompt_lookup_max", self.prompt_lookup_max, 1, MAX_LOOKUP)
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config: prompt_lookup_min ({self.prompt_lookup_min}) is more than "
                             f"prompt_lookup_max ({self.prompt_lookup_max})")

    @classmethod
    def parse(cls, text: str | dict[str, Any] | None) -> SpeculativeConfig | None:
        """The config a flag's JSON (or a dict) describes; None for None or an empty string. ValueError naming
        the key for anything else than the keys above with values of their kinds."""
        if text is None or text == "":
            return None
        if isinstance(text, str):
            try:
                fields = json.loads(text)
            except json.JSONDecodeError as error:
                raise ValueError(f"speculative_config: not JSON ({error.msg}); example: "
                                 '{"method": "ngram", "num_speculative_tokens": 4}') from None
        else:
            fields = text
        if not isinstance(fields, dict):
            raise ValueError("speculative_config: expected a JSON object such as "
                             '{"method": "ngram", "num_speculative_tokens": 4}')
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(fields) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {unknown}; known: {sorted(known)}")
        if "prompt_lookup_min" in fields and "prompt_lookup_max" not in fields:  # vLLM: the other one follows
            fields = {**fields, "prompt_lookup_max": _larger(fields["prompt_lookup_min"], DEFAULT_LOOKUP[1])}
        if "prompt_lookup_max" in fields and "prompt_lookup_min" not in fields:
            fields = {**fields, "prompt_lookup_min": _smaller(fields["prompt_lookup_max"], DEFAULT_LOOKUP[0])}
        return cls(**fields)

    def to_json(self) -> str:
        return json.dumps({name: getattr(self, name) for name in self.__dataclass_fields__})


def _check_int(name: str, value: object, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"speculative_config: {name} must be an integer from {low} to {high}, got {value!r}")


def _larger(value: object, default: int) -> object:
    """The larger of a given bound and a default (the value itself when it is no int: __post_init__ says so)."""
    return max(value, default) if isinstance(value, int) else value


def _smaller(value: object, default: int) -> object:
    return min(value, default) if isinstance(value, int) else value
