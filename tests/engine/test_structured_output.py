"""Structured output through xgrammar, on the tiny random model: whatever the model prefers, the grammar
decides what it may say, so every finished output must parse and validate. The schemas bound every value
(string lengths, integer ranges, array sizes) so that a random model's outputs end well within max_tokens;
a KV pool too small for the batch forces preemptions in the middle of constrained requests."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest

from conveyor import LLM, SamplingParams
from conveyor.core.structured import StructuredOutput

NAME = {"type": "string", "minLength": 1, "maxLength": 12}
SCHEMAS = [
    {"type": "object", "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"country": {"enum": ["France", "Spain", "Italy"]}, "capital": NAME,
                                      "coastal": {"type": "boolean"}},
     "required": ["country", "coastal"], "additionalProperties": False},
    {"type": "object", "properties": {
        "title": NAME, "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 4},
        "author": {"type": "object", "properties": {"first": NAME, "last": NAME}, "required": ["first", "last"],
                   "additionalProperties": False}},
     "required": ["title", "tags", "author"], "additionalProperties": False},
    {"type": "object", "properties": {"items": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
        "type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 99},
                                         "done": {"type": "boolean"}},
        "required": ["id", "done"], "additionalProperties": False}}},
     "required": ["items"], "additionalProperties": False},
]


def _prompts(n: int) -> list[list[int]]:
    return [[1000 + (37 * i + 11 * j) % 30000 for j in range(12 + i % 9)] for i in range(n)]


def test_hundred_generations_validate_even_across_preemption(tiny_model_dir: Path) -> None:
    llm = LLM(str(tiny_model_dir), num_kv_blocks=48, max_num_seqs=32)
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=300,
                             structured_output=StructuredOutput(json=SCHEMAS[i % len(SCHEMAS)])) for i in range(100)]
    outputs = llm.generate(_prompts(100), params, use_tqdm=False)
    assert llm.engine.stats().num_preemptions > 0, "the small KV pool must preempt constrained requests"
    assert sum(o.metrics.num_preemptions > 0 for o in outputs) > 0
    for i, out in enumerate(outputs):
        assert out.finish_reason == "stop", (i, out.text)
        jsonschema.validate(json.loads(out.text), SCHEMAS[i % len(SCHEMAS)])


def test_json_object_regex_and_choice_hold(tiny_model_dir: Path) -> None:
    llm = LLM(str(tiny_model_dir), num_kv_blocks=256)
    kinds = [StructuredOutput(regex=r"[A-Z][a-z]{2,5}-\d{3}"), StructuredOutput(choice=("yes", "no", "maybe so"))]
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=40, structured_output=kinds[i % 2]) for i in range(20)]
    outputs = llm.generate(_prompts(20), params, use_tqdm=False)
    for i, out in enumerate(outputs):
        assert out.finish_reason == "stop"
        if i % 2 == 0:
            assert re.fullmatch(r"[A-Z][a-z]{2,5}-\d{3}", out.text), out.text
        else:
            assert out.text in ("yes", "no", "maybe so")
    # Any JSON object: a random model could write a string forever, so a bias towards "{" and "}" (as
    # tokens of their own: the grammar also allows '{"') makes it "{}" at once.
    tokenizer = llm.get_tokenizer()
    bias = {tokenizer.encode("{")[-1]: 8.0, tokenizer.encode("}")[-1]: 8.0}
    params = SamplingParams(temperature=0.0, max_tokens=20, logit_bias=bias,
                            structured_output=StructuredOutput(json_object=True))
    out = llm.generate(_prompts(1), params, use_tqdm=False)[0]
    assert (out.text, out.finish_reason) == ("{}", "stop")


def test_a_constrained_request_is_batch_invariant(tiny_model_dir: Path) -> None:
    llm = LLM(str(tiny_model_dir), num_kv_blocks=512, max_num_seqs=32)
    constrained = SamplingParams(temperature=0.0, max_tokens=100, structured_output=StructuredOutput(json=SCHEMAS[2]))
    plain = SamplingParams(temperature=0.0, max_tokens=20)
    prompts = _prompts(32)
    batch = llm.generate(prompts, [constrained if i % 4 == 0 else plain for i in range(32)], use_tqdm=False)
    for i in range(0, 32, 4):
        assert llm.generate([prompts[i]], constrained, use_tqdm=False)[0].text == batch[i].text


@pytest.mark.parametrize(("spec", "field"), [
    (StructuredOutput(json={"type": "nonsense"}), "structured_output.json"),
    (StructuredOutput(regex="(ab"), "structured_output.regex"),
])
def test_a_constraint_that_does_not_compile_is_refused(tiny_model_dir: Path, spec, field) -> None:
    llm = LLM(str(tiny_model_dir), num_kv_blocks=64)
    with pytest.raises(ValueError, match=re.escape(field)):
        llm.generate([[1, 2, 3]], SamplingParams(structured_output=spec), use_tqdm=False)


@pytest.mark.parametrize("kwargs", [{}, {"json": {}, "regex": "a"}, {"choice": ()}, {"json": "{not json"},
                                    {"json": [1]}, {"regex": ""}])
def test_a_malformed_constraint_names_itself(kwargs) -> None:
    with pytest.raises(ValueError, match="structured_output"):
        StructuredOutput(**kwargs)
