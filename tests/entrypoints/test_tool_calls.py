"""Tool calls on chat through a real server and the official client: tool_choice required and a named function
are held to the tools' schemas by the grammar and come back as OpenAI's tool_calls, streamed (chunks that add
up to the whole answer) or not; a conversation that carries calls and their results goes on; what cannot be
honoured (auto, an unknown name, no tools) is a 400 naming the field."""

from __future__ import annotations

import json
import shutil

import httpx
import jsonschema
import pytest

from conveyor.entrypoints.openai.tool_calls import ForcedToolCalls

MODEL = "tiny"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"hours": {"type": "integer", "minimum": 0, "maximum": 23}},
        "required": ["hours"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "set_alarm", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "set_alarm": TIME}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "set_alarm"}}


def assert_valid_calls(calls, names=tuple(SCHEMAS)) -> None:
    assert calls and len({call.id for call in calls}) == len(calls)
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_") and call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def streamed_calls(stream) -> tuple[list[tuple[str, str]], str | None]:
    """The (name, arguments) of each call a stream's deltas add up to, by index, and its last finish_reason."""
    calls: dict[int, list[str]] = {}
    finish = None
    for chunk in stream:
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            assert not choice.delta.content
            for call in choice.delta.tool_calls or ():
                if call.index not in calls:
                    assert call.id and call.function.name
                    calls[call.index] = [call.function.name, ""]
                calls[call.index][1] += call.function.arguments or ""
    return [tuple(calls[i]) for i in sorted(calls)], finish


def test_a_named_function_is_called_with_arguments_of_its_schema(client):
    kwargs = dict(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=NAMED, max_tokens=40, temperature=0)
    reply = client.chat.completions.create(**kwargs).choices[0]
    assert reply.message.content is None and reply.finish_reason == "tool_calls"
    assert len(reply.message.tool_calls) == 1
    assert_valid_calls(reply.message.tool_calls, ["set_alarm"])
    calls, finish = streamed_calls(client.chat.completions.create(**kwargs, stream=True))
    assert calls == [("set_alarm", reply.message.tool_calls[0].function.arguments)] and finish == "tool_calls"


def test_required_makes_one_or_more_calls_each_of_its_tools_schema(client):
    for seed in range(6):  # sampled: several shapes of call lists, each held to the schemas
        kwargs = dict(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required", max_tokens=120,
                      temperature=1.0, seed=seed)
        reply = client.chat.completions.create(**kwargs).choices[0]
        if reply.finish_reason == "length":  # a random model may write past max_tokens: no call is complete
            continue
        assert reply.finish_reason == "tool_calls" and reply.message.content is None
        assert_valid_calls(reply.message.tool_calls)
        calls, finish = streamed_calls(client.chat.completions.create(**kwargs, stream=True))
        assert calls == [(c.function.name, c.function.arguments) for c in reply.message.tool_calls]
        assert finish == "tool_calls"
        break
    else:
        pytest.fail("no seed of six made a complete list of calls within 120 tokens")


def test_n_choices_each_make_their_own_calls(client):
    response = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=NAMED,
                                              max_tokens=40, temperature=1.0, seed=5, n=3)
    assert [c.index for c in response.choices] == [0, 1, 2]
    for choice in response.choices:
        assert_valid_calls(choice.message.tool_calls, ["set_alarm"])
    ids = [c.message.tool_calls[0].id for c in response.choices]
    assert len(set(ids)) == 3


def test_a_conversation_with_calls_and_their_results_goes_on(client):
    """The assistant's calls and the tool's result go back in; tool_choice none answers in text."""
    call = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=NAMED,
                                          max_tokens=40, temperature=0).choices[0].message.tool_calls[0]
    messages = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                {"role": "tool", "tool_call_id": call.id, "content": "alarm set"}]
    reply = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, tool_choice="none",
                                           max_tokens=6, temperature=0).choices[0]
    assert reply.message.tool_calls is None and reply.message.content
    # The tiny model's template shows neither tools nor calls: with none, the tools change nothing.
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0)
    assert reply.message.content == plain.choices[0].message.content


def test_tools_and_calls_reach_a_template_that_shows_them(tiny_model_dir, tmp_path):
    from conveyor.engine.tokenizer import Tokenizer
    from conveyor.entrypoints.openai.protocol import ChatCompletionRequest

    shutil.copy(tiny_model_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    config = json.loads((tiny_model_dir / "tokenizer_config.json").read_text())
    config["chat_template"] = (
        "{% for t in tools %}[{{ t.function.name }}]{% endfor %}{% for m in messages %}{{ m.role }}:"
        "{% for c in m.tool_calls or [] %}{{ c.function.name }}({{ c.function.arguments.hours }}){% endfor %}"
        "{{ m.tool_call_id or '' }}{{ m.content }};{% endfor %}")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    call = {"id": "call_1", "type": "function", "function": {"name": "set_alarm", "arguments": '{"hours": 7}'}}
    body = ChatCompletionRequest(messages=[*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [call]},
                                           {"role": "tool", "tool_call_id": "call_1", "content": "ok"}],
                                 tools=TOOLS, tool_choice="none")
    tokenizer = Tokenizer(tmp_path)
    text = tokenizer.decode(tokenizer.apply_chat_template(body.message_dicts(), **body.template_options()))
    assert text == "[get_weather][set_alarm]user:What is the weather in Paris?;assistant:set_alarm(7);tool:call_1ok;"


def test_a_stream_reads_a_listed_call_once_its_json_is_complete():
    forced = ForcedToolCalls(SCHEMAS, named=None)
    text = '[{"name": "set_alarm", "parameters": {"hours": 7}}, {"name": "get_weather", "parameters": ' \
           '{"city": "Oslo, \\"N\\"]", "unit": "celsius"}}]'
    stream = forced.stream()
    sent = [(i, call) for i in range(len(text)) for call in stream.feed(text[i])]  # one character at a time
    first_end = text.index("}}") + 1
    assert [(i, call["index"]) for i, call in sent] == [(first_end, 0), (len(text) - 2, 1)]  # at each closing brace
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for _, c in sent] == [
        ("set_alarm", {"hours": 7}), ("get_weather", {"city": 'Oslo, "N"]', "unit": "celsius"})]
    assert [c["function"] for c in forced.calls(text)] == [c["function"] for _, c in sent]
    assert [c["function"] for c in forced.calls(text[: first_end + 1])] == [sent[0][1]["function"]]
    assert forced.calls(text[:first_end]) == []  # cut inside the first call: none complete


@pytest.mark.parametrize(("body", "param"), [
    ({"tools": TOOLS}, "tool_choice"),  # auto, the default with tools
    ({"tools": TOOLS, "tool_choice": "auto"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": NAMED}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [TOOLS[0], TOOLS[0]], "tool_choice": "required"}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}], "tool_choice": "required"},
     "tools.0.function.name"),
    ({"tools": [{"type": "retrieval"}], "tool_choice": "required"}, "tools.0.type"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "guided_regex": "a+"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "echo": True}, "echo"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}],
      "tool_choice": "required"}, "tool_choice"),
])
def test_tool_requests_that_cannot_be_honoured_get_400_naming_the_field(server, body, param):
    response = httpx.post(f"{server}/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 8} | body,
                          timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param, response.json()
