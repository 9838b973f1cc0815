"""Hypothesis strategies of hostile request bodies, one per endpoint, shared by the fuzz suite
(tests/entrypoints/test_fuzz_bodies.py) and the soak (tests/entrypoints/test_soak.py).

Each body starts from a valid one (so that most reach the engine, not only the first validation) and puts
hostile values into some of its fields: text with lone surrogates and control characters, nesting far past
any field's need, numbers at and past every edge (NaN and infinities included), and long arrays. A body is
JSON text made here: lone surrogates and NaN cannot travel through an HTTP client's own JSON encoder.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from hypothesis import strategies as st

# Text of every kind, lone surrogates (category Cs) and control characters (Cc) included, which hypothesis
# leaves out of st.text() by default.
ANY_CHARACTER = st.characters(codec=None, exclude_categories=())
CONTROL = st.characters(categories=["Cc", "Cs", "Cf", "Zl", "Zp"])
EDGE_NUMBERS = [0, -1, 1, 2, 2**31, -(2**31), 2**53 + 1, 2**63, -(2**63), 2**64, 10**30, 1e308, -1e308, 5e-324,
                0.5, -0.0, 100.0, 2.0000001, float("nan"), float("inf"), float("-inf")]


def hostile_text(max_size: int = 40) -> st.SearchStrategy[str]:
    """Short strings of any code points, often of control characters and surrogates alone."""
    return st.one_of(st.text(ANY_CHARACTER, max_size=max_size), st.text(CONTROL, min_size=1, max_size=8),
                     st.sampled_from(["\ud800", "a\udfffb", "\x00", "\u200b", "<|im_start|>", "{{ x }}", "{%", ""]))


def extreme_number() -> st.SearchStrategy[int | float]:
    return st.one_of(st.sampled_from(EDGE_NUMBERS), st.integers(-(2**70), 2**70),
                     st.floats(allow_nan=True, allow_infinity=True))


def deep(leaf: Any, levels: int, as_list: bool) -> Any:
    """``leaf`` inside ``levels`` lists (or one-key objects): built, not drawn, so 500 levels cost nothing."""
    value = leaf
    for _ in range(levels):
        value = [value] if as_list else {"a": value}
    return value


def nesting() -> st.SearchStrategy[Any]:
    return st.builds(deep, st.sampled_from([1, "x", None]), st.integers(2, 500), st.booleans())


def huge_array() -> st.SearchStrategy[list]:
    """A long list of one repeated item (a prompt of 20,000 token ids, 5,000 stop strings, ...)."""
    return st.builds(lambda item, size: [item] * size, st.one_of(st.integers(-1, 60_000), st.sampled_from(["a", {}])),
                     st.integers(100, 20_000))


def small_json() -> st.SearchStrategy[Any]:
    """Any small JSON value, its strings hostile."""
    scalars = st.one_of(st.none(), st.booleans(), extreme_number(), hostile_text())
    return st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                         st.dictionaries(hostile_text(8), inner, max_size=4)),
                        max_leaves=12)


def hostile_value() -> st.SearchStrategy[Any]:
    return st.one_of(hostile_text(), extreme_number(), nesting(), huge_array(), small_json())


def odd_text() -> st.SearchStrategy[str]:
    """Unicode text with control characters, odd marks and template syntax: valid, to be served."""
    return st.one_of(st.text(st.characters(codec="utf-8"), max_size=30),
                     st.sampled_from(["\x00", "\u200b", "<|im_start|>", "{{ x }}", "{% if %}", "\r\n\t", "\ufeff"]))


def text_value() -> st.SearchStrategy[Any]:
    """What a free-form text field gets in a hostile body: odd text, hostile text, or a hostile value."""
    return st.one_of(odd_text(), hostile_text(), hostile_value())


def object_value() -> st.SearchStrategy[Any]:
    """What a free-form object (chat_template_kwargs, metadata) gets: hostile keys and values, or anything."""
    return st.one_of(st.dictionaries(hostile_text(8), text_value(), max_size=4), hostile_value())


def hostile_message() -> st.SearchStrategy[dict]:
    """A chat message whose role, content or extra fields may each be hostile."""
    parts = st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": text_value()}), max_size=3)
    content = st.one_of(text_value(), parts)
    roles = st.sampled_from(["user", "user", "system", "assistant", "tool"])
    return st.fixed_dictionaries({"role": st.one_of(roles, hostile_text(8)), "content": content},
                                 optional={"name": hostile_value(), "tool_calls": hostile_value(),
                                           "tool_call_id": hostile_value()})


@dataclass(frozen=True)
class Endpoint:
    """One POST route: a valid body to start from; its free-form fields (text, objects) and its other fields,
    which a body may fill with hostile values (at most one of the others, so that many bodies get served)."""

    path: str
    valid: dict[str, Any]
    texts: tuple[str, ...]
    objects: tuple[str, ...]
    fields: tuple[str, ...]

    def bodies(self) -> st.SearchStrategy[bytes]:
        """Half served (odd but valid text in the free-form fields), half hostile."""
        return st.one_of(self._served(), self._hostile())

    def _served(self) -> st.SearchStrategy[bytes]:
        odd = {name: odd_text() for name in self.texts}
        if "messages" in self.valid:
            odd["messages"] = st.lists(st.fixed_dictionaries({"role": st.just("user"), "content": odd_text()}),
                                       min_size=1, max_size=3)
        texts = st.fixed_dictionaries({}, optional=odd)
        return st.builds(lambda changed: encode(self.valid | changed), texts)

    def _hostile(self) -> st.SearchStrategy[bytes]:
        free = {name: text_value() for name in self.texts} | {name: object_value() for name in self.objects}
        if "messages" in self.valid or "messages" in self.fields:
            free["messages"] = st.lists(hostile_message(), min_size=1, max_size=3)
        changed = st.fixed_dictionaries({}, optional=free)
        other = st.dictionaries(st.sampled_from(self.fields), hostile_value(), max_size=1)
        return st.builds(lambda a, b: encode(self.valid | a | b), changed, other)


def encode(body: dict) -> bytes:
    """JSON text as a hostile client writes it: lone surrogates as ``\\ud800`` escapes, NaN and Infinity bare."""
    return json.dumps(body, ensure_ascii=True, allow_nan=True).encode()


SAMPLING = ("model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop_token_ids", "n",
            "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "min_tokens",
            "prompt_logprobs", "guided_json", "guided_regex", "guided_choice", "priority", "stream", "stream_options",
            "ignore_eos", "skip_special_tokens", "include_stop_str_in_output", "unknown_field")
CHAT = ("chat_template_kwargs", "tools", "tool_choice", "parallel_tool_calls", "response_format", "logprobs",
        "top_logprobs", "max_completion_tokens", "metadata", "echo", "add_generation_prompt", "continue_final_message",
        "modalities", "service_tier", "store")
ENDPOINTS = [
    Endpoint("/v1/completions", {"prompt": "hello", "max_tokens": 2}, ("prompt", "stop", "user"), (),
             (*SAMPLING, "echo", "suffix", "best_of", "logprobs")),
    Endpoint("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
             ("stop", "user"), ("chat_template_kwargs", "metadata"), (*SAMPLING, *CHAT)),
    Endpoint("/v1/responses", {"input": "hello", "max_output_tokens": 2},
             ("input", "instructions", "user", "safety_identifier", "prompt_cache_key", "previous_response_id"),
             ("metadata",),
             ("model", "max_output_tokens", "temperature", "top_p", "stream", "store", "text", "tools", "tool_choice",
              "parallel_tool_calls", "truncation", "include", "top_logprobs", "service_tier")),
    Endpoint("/tokenize", {"prompt": "hello"}, ("prompt",), ("chat_template_kwargs",),
             ("model", "messages", "tools", "add_generation_prompt", "continue_final_message")),
    Endpoint("/detokenize", {"tokens": [1, 2, 3]}, (), (), ("model", "tokens")),
]


# The soak draws its hostile bodies from a seeded random.Random, not from hypothesis: one body per request,
# thousands of them, each reproducible from the soak's seed and the request's index.
HOSTILE_VALUES = ["\ud800", "a\udfffb", "\x00\x01\x1f\x7f", "\u202e\u200b\ufeff", "{{ raise }}", float("nan"),
                  float("inf"), -(2**70), 2**64, 1e308, -0.0, [0] * 20_000, ["a"] * 5_000, [{}] * 2_000,
                  deep(1, 500, True), deep("x", 500, False), deep(None, 65, True), {"\ud800": "\udc00"}]


def random_hostile_body(rng) -> tuple[str, bytes]:
    """A path and a body with one or two fields of one endpoint set to hostile values."""
    endpoint = rng.choice(ENDPOINTS)
    names = [*endpoint.texts, *endpoint.objects, *endpoint.fields]
    changed = {name: rng.choice(HOSTILE_VALUES) for name in rng.sample(names, min(len(names), rng.randint(1, 2)))}
    return endpoint.path, encode(endpoint.valid | changed)


def nested_arrays(levels: int, leaf: dict | None = None) -> dict:
    schema = leaf or {"type": "integer"}
    for _ in range(levels):
        schema = {"type": "array", "items": schema}
    return schema


def grammar_bomb(rng, index: int, max_values: int) -> dict:
    """A completion body whose constraint is over a limit (refused before compiling) or as costly as the limits
    allow (a compile of its own: ``index`` keeps it out of the compiled-grammar cache)."""
    distinct = [f"v{index}-{i}" for i in range(max_values)]
    constraints = [
        {"guided_json": nested_arrays(900)},
        {"guided_json": {"enum": [*distinct, "one more"]}},
        {"guided_regex": "a" * 40_000},
        {"guided_json": {"type": "object", "properties": {"a": {"$ref": "http://127.0.0.1:9/s.json"}}}},
        {"guided_json": {"enum": distinct}},
        {"guided_choice": distinct},
        {"guided_json": nested_arrays(30, {"type": "string", "pattern": f"v{index}[a-z]{{1,64}}"})},
        {"guided_regex": f"(v{index}|[a-z]{{1,40}}|[0-9]{{1,40}}){{1,200}}"},
    ]
    return {"prompt": "hi", "max_tokens": 4} | rng.choice(constraints)
