"""OpenAI's Responses API through a real server and the official client: a response is the chat completion of
the same conversation (instructions as the system message), streamed as the Responses events that add up to
it; stored responses carry a conversation on (previous_response_id) and can be fetched again; text.format and
function tools work as on chat; what cannot be honoured is a 400 naming the Responses API's own field."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

MODEL = "tiny"
QUESTION = "Name three rivers."
TOOLS = [{"type": "function", "name": "set_alarm", "parameters": {
    "type": "object", "properties": {"hours": {"type": "integer", "minimum": 0, "maximum": 23}},
    "required": ["hours"], "additionalProperties": False}}]
SMALL = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}


def chat_text(client, messages, max_tokens: int) -> str:
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0)
    return reply.choices[0].message.content


def test_a_response_is_the_chat_completion_of_its_conversation(client):
    response = client.responses.create(model=MODEL, input=QUESTION, instructions="Be brief.", max_output_tokens=8,
                                       temperature=0)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTION}]
    assert response.output_text == chat_text(client, messages, 8)
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 8 and response.usage.input_tokens > 5
    assert response.id.startswith("resp_") and response.output[0].type == "message"
    as_items = client.responses.create(model=MODEL, instructions="Be brief.", max_output_tokens=8, temperature=0,
                                       input=[{"role": "user", "content": [{"type": "input_text", "text": QUESTION}]}])
    assert as_items.output_text == response.output_text


def test_the_stream_of_events_adds_up_to_the_response(server, client):
    body = {"model": MODEL, "input": QUESTION, "max_output_tokens": 8, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{server}/v1/responses", json=body, timeout=60) as stream:
        lines = [line for line in stream.iter_lines() if line]
    events = [json.loads(line[6:]) for line in lines if line.startswith("data: ")]
    names = [line[7:] for line in lines if line.startswith("event: ")]
    assert names == [e["type"] for e in events] and [e["sequence_number"] for e in events] == list(range(len(events)))
    kinds = [e["type"] for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    whole = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=8, temperature=0)
    assert text == events[-4]["text"] == events[-1]["response"]["output"][0]["content"][0]["text"] == whole.output_text
    assert events[-1]["response"]["usage"]["output_tokens"] == 8


def test_logprobs_with_include_as_chat_gives_them(client):
    kwargs = dict(model=MODEL, input=QUESTION, max_output_tokens=6, temperature=0)
    response = client.responses.create(**kwargs, include=["message.output_text.logprobs"], top_logprobs=2)
    part = response.output[0].content[0]
    assert len(part.logprobs) == 6 and "".join(entry.token for entry in part.logprobs) == part.text
    assert all(len(entry.top_logprobs) == 2 for entry in part.logprobs)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTION}],
                                          max_tokens=6, temperature=0, logprobs=True, top_logprobs=2)
    assert [e.logprob for e in part.logprobs] == pytest.approx(
        [e.logprob for e in chat.choices[0].logprobs.content], abs=1e-5)
    streamed = [entry for event in client.responses.create(**kwargs, include=["message.output_text.logprobs"],
                                                           top_logprobs=2, stream=True)
                if event.type == "response.output_text.delta" for entry in event.logprobs]
    assert [e.token for e in streamed] == [e.token for e in part.logprobs]
    assert client.responses.create(**kwargs).output[0].content[0].logprobs == []  # not asked for


class Verdict(BaseModel):
    ok: bool
    score: int = Field(ge=0, le=9)


def test_text_format_through_the_clients_parse_and_stream_helpers(client):
    parsed = client.responses.parse(model=MODEL, input=QUESTION, text_format=Verdict, max_output_tokens=40,
                                    temperature=0)
    assert isinstance(parsed.output_parsed, Verdict) and parsed.status == "completed"
    fmt = {"format": {"type": "json_schema", "name": "small", "schema": SMALL, "strict": True}}
    with client.responses.stream(model=MODEL, input=QUESTION, text=fmt, max_output_tokens=40,
                                 temperature=0) as stream:
        final = stream.get_final_response()  # needs response.completed: the grammar ends the text with EOS
    jsonschema.validate(json.loads(final.output_text), SMALL)
    whole = client.responses.create(model=MODEL, input=QUESTION, text=fmt, max_output_tokens=40, temperature=0)
    assert final.output_text == whole.output_text


def test_previous_response_id_carries_the_conversation_not_the_instructions(client):
    first = client.responses.create(model=MODEL, input=QUESTION, instructions="Be brief.", max_output_tokens=6,
                                    temperature=0)
    second = client.responses.create(model=MODEL, input="And three lakes?", previous_response_id=first.id,
                                     max_output_tokens=6, temperature=0)
    messages = [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": first.output_text},
                {"role": "user", "content": "And three lakes?"}]
    assert second.output_text == chat_text(client, messages, 6)
    assert second.previous_response_id == first.id
    assert client.responses.retrieve(second.id).output_text == second.output_text
    unstored = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=2, temperature=0, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    with pytest.raises(openai.NotFoundError, match="previous_response_id"):
        client.responses.create(model=MODEL, input="x", previous_response_id=unstored.id, max_output_tokens=2)


def test_function_tools_make_calls_whose_outputs_carry_on(client):
    kwargs = dict(model=MODEL, input="Wake me at seven.", tools=TOOLS, tool_choice="required", max_output_tokens=60,
                  temperature=0)
    response = client.responses.create(**kwargs)
    calls = [item for item in response.output if item.type == "function_call"]
    assert calls and response.status == "completed"
    for call in calls:
        assert call.name == "set_alarm" and call.call_id.startswith("call_") and call.status == "completed"
        jsonschema.validate(json.loads(call.arguments), TOOLS[0]["parameters"])
    with client.responses.stream(**kwargs) as stream:
        streamed = [item for item in stream.get_final_response().output if item.type == "function_call"]
    assert [(c.name, c.arguments) for c in streamed] == [(c.name, c.arguments) for c in calls]
    named = client.responses.create(**kwargs | {"tool_choice": {"type": "function", "name": "set_alarm"}})
    assert [item.name for item in named.output] == ["set_alarm"]
    after = client.responses.create(model=MODEL, previous_response_id=response.id, tools=TOOLS, tool_choice="none",
                                    input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                                            "output": "alarm set"}], max_output_tokens=4, temperature=0)
    assert after.output[0].type == "message" and after.output_text


@pytest.mark.parametrize(("body", "status", "param"), [
    ({"input": []}, 400, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, 400, "input"),
    ({"input": [{"type": "reasoning", "summary": []}]}, 400, "input"),
    ({"input": "hi", "max_output_tokens": 0}, 400, "max_output_tokens"),
    ({"input": "hi", "tools": TOOLS}, 400, "tool_choice"),  # auto, the default with tools
    ({"input": "hi", "tool_choice": "required"}, 400, "tool_choice"),
    ({"input": "hi", "tools": [{"type": "function", "name": "has space"}], "tool_choice": "required"}, 400,
     "tools.0.name"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nonsense"}}}},
     400, "text.format"),
    ({"input": "hi", "truncation": "auto"}, 400, "truncation"),
    ({"input": "hi", "reasoning": {"effort": "low"}}, 400, "reasoning"),
    ({"input": "hi", "include": ["reasoning.encrypted_content"]}, 400, "include.0"),
    ({"input": "hi", "top_logprobs": 21, "include": ["message.output_text.logprobs"]}, 400, "top_logprobs"),
    ({"input": "hi", "model": "nope"}, 404, "model"),
    ({"input": "hi", "previous_response_id": "resp_missing"}, 404, "previous_response_id"),
])
def test_what_cannot_be_honoured_names_the_responses_field(server, body, status, param):
    response = httpx.post(f"{server}/v1/responses", json={"max_output_tokens": 4} | body, timeout=60)
    assert response.status_code == status, response.text
    assert response.json()["error"]["param"] == param, response.json()
