"""tool_choice auto: replies read for the calls the model chose to make, in its own format.

The parsers on text (hermes, llama3_json, pythonic): calls, content around them, and anything that does not
parse as calls kept whole as content; streamed one character (or a few) at a time, the same content and calls
as the whole reply. Then a real server (``--enable-auto-tool-choice``) of the tiny model with a Qwen-style
template that shows the tools and asks for ``<tool_call>`` blocks (so the hermes parser is chosen from the
template), and the official client: the tiny model's random weights would never write a call, so
``guided_regex`` holds its reply to one (or to plain text), and what comes back is what the parser read.
"""

from __future__ import annotations

import json

import openai
import pytest

from conveyor.entrypoints.openai.tool_parsers import AutoToolStream, ParsedCall, parse, parser_for_template
from tests.serving import running_server, with_chat_template

QWEN_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n# Tools\n<tools>\n{%- for tool in tools %}\n{{ tool | tojson }}"
    "{%- endfor %}\n</tools>\nFor each function call, return a json object within <tool_call></tool_call> "
    "XML tags.<|im_end|>\n{%- endif %}"
    "{%- for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content or '' }}<|im_end|>\n"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
HERMES_REPLY = 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'

CASES = [  # (parser, text, content, calls)
    ("hermes", HERMES_REPLY, "Let me look.", [ParsedCall("get_weather", '{"city": "Paris"}')]),
    ("hermes", '<tool_call>{"name": "a", "arguments": {}}</tool_call>\n<tool_call>{"name": "b", "arguments": '
               '"{\\"x\\": 1}"}</tool_call>', None, [ParsedCall("a", "{}"), ParsedCall("b", '{"x": 1}')]),
    ("hermes", "No call here, just < and <tool", "No call here, just < and <tool", []),
    ("hermes", "<tool_call>{not json}</tool_call>", "<tool_call>{not json}</tool_call>", []),
    ("hermes", '<tool_call>{"name": "a", "arguments": {"k": 2}}', None, [ParsedCall("a", '{"k": 2}')]),  # cut
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}}', None,
     [ParsedCall("get_weather", '{"city": "Paris"}')]),
    ("llama3_json", '<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"y": [1]}}', None,
     [ParsedCall("a", "{}"), ParsedCall("b", '{"y": [1]}')]),
    ("llama3_json", '{"not": "a call"}', '{"not": "a call"}', []),
    ("llama3_json", "Paris is sunny.", "Paris is sunny.", []),
    ("pythonic", '[get_weather(city="Paris"), set_alarm(hours=7, days=[1, 2])]', None,
     [ParsedCall("get_weather", '{"city": "Paris"}'), ParsedCall("set_alarm", '{"hours": 7, "days": [1, 2]}')]),
    ("pythonic", "[open(path)]", "[open(path)]", []),  # a name, not a literal: not a call this reads
    ("pythonic", "[1, 2, 3] are numbers", "[1, 2, 3] are numbers", []),
]


@pytest.mark.parametrize(("parser", "text", "content", "calls"), CASES)
def test_a_whole_reply_is_read_as_calls_or_kept_as_content(parser, text, content, calls):
    assert parse(parser, text) == (content, calls)


@pytest.mark.parametrize(("parser", "text", "content", "calls"), CASES)
@pytest.mark.parametrize("piece", [1, 3, 7])
def test_a_streamed_reply_sends_the_same_content_and_calls(parser, text, content, calls, piece):
    stream = AutoToolStream(parser)
    sent, read = "", []
    for start in range(0, len(text), piece):
        more, found = stream.feed(text[start:start + piece])
        sent, read = sent + more, read + found
    more, found = stream.finish()
    sent, read = sent + more, read + found
    assert read == calls and stream.num_calls == len(calls)
    assert sent.strip() == (content or "")


def test_hermes_content_streams_before_the_call_and_holds_back_only_a_tags_beginning():
    stream = AutoToolStream("hermes")
    assert stream.feed("Let me look.\n<tool") == ("Let me look.\n", [])
    assert stream.feed('_call>{"name": "get_weather", "arguments": {"city": "Paris"}}') == ("", [])
    assert stream.feed("</tool_call>") == ("", [ParsedCall("get_weather", '{"city": "Paris"}')])


def test_the_parser_is_chosen_from_the_template():
    assert parser_for_template(QWEN_TEMPLATE) == "hermes"
    assert parser_for_template("{{ '<|python_tag|>' }}") == "llama3_json"
    assert parser_for_template("{% for m in messages %}{{ m.content }}{% endfor %}") is None


@pytest.fixture(scope="module")
def qwen_style_model(tiny_model_dir, tmp_path_factory):
    """The tiny model with a template that shows tools and asks for <tool_call> blocks."""
    return with_chat_template(tiny_model_dir, tmp_path_factory.mktemp("tiny-tools"), QWEN_TEMPLATE)


@pytest.fixture(scope="module")
def auto_client(qwen_style_model):
    with running_server(qwen_style_model, "--enable-auto-tool-choice", "--num-kv-blocks", "256",
                        "--served-model-name", "tiny") as server:
        yield openai.OpenAI(base_url=f"{server.base}/v1", api_key="unused", max_retries=0)


def _literal(text: str) -> str:
    """A regex matching exactly ``text``."""
    return "".join("\\n" if c == "\n" else "\\" + c if c in ".^$*+?{}[]\\|()" else c for c in text)


def _streamed(client, **kwargs) -> tuple[str, list[tuple[str, str]], str | None]:
    """A streamed reply's content, its calls (name, arguments) and finish_reason."""
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for call in choice.delta.tool_calls or ():
            name, arguments = calls.get(call.index, ("", ""))
            calls[call.index] = (name + (call.function.name or ""), arguments + (call.function.arguments or ""))
        finish = choice.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


def test_a_reply_with_a_call_comes_back_as_tool_calls_streamed_or_not(auto_client):
    kwargs = dict(model="tiny", messages=MESSAGES, tools=[WEATHER], max_tokens=80, temperature=0,
                  extra_body={"guided_regex": _literal(HERMES_REPLY)})
    reply = auto_client.chat.completions.create(**kwargs).choices[0]
    assert reply.finish_reason == "tool_calls" and reply.message.content == "Let me look."
    [call] = reply.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris"})
    content, calls, finish = _streamed(auto_client, **kwargs)
    assert content.strip() == "Let me look." and finish == "tool_calls"
    assert calls == [("get_weather", call.function.arguments)]


def test_a_reply_without_a_call_is_content(auto_client):
    kwargs = dict(model="tiny", messages=MESSAGES, tools=[WEATHER], tool_choice="auto", max_tokens=20,
                  temperature=0, extra_body={"guided_regex": _literal("It is sunny in Paris.")})
    reply = auto_client.chat.completions.create(**kwargs).choices[0]
    assert reply.message.content == "It is sunny in Paris." and not reply.message.tool_calls
    assert reply.finish_reason == "stop"
    assert _streamed(auto_client, **kwargs) == ("It is sunny in Paris.", [], "stop")


@pytest.fixture(scope="module")
def json_client(qwen_style_model):
    """The same model read with --tool-call-parser llama3_json: a reply that is one JSON object is a call,
    which a JSON schema of constants makes the tiny model write (through chat's and the Responses API's own
    structured output)."""
    with running_server(qwen_style_model, "--enable-auto-tool-choice", "--tool-call-parser", "llama3_json",
                        "--num-kv-blocks", "256", "--served-model-name", "tiny") as server:
        yield openai.OpenAI(base_url=f"{server.base}/v1", api_key="unused", max_retries=0)


CALL_SCHEMA = {"type": "object", "properties": {"name": {"const": "get_weather"}, "parameters": {
    "type": "object", "properties": {"city": {"const": "Paris"}}, "required": ["city"], "additionalProperties": False}},
    "required": ["name", "parameters"], "additionalProperties": False}


def test_llama3_json_calls_on_chat(json_client):
    fmt = {"type": "json_schema", "json_schema": {"name": "call", "schema": CALL_SCHEMA}}
    reply = json_client.chat.completions.create(model="tiny", messages=MESSAGES, tools=[WEATHER], max_tokens=60,
                                                temperature=0, response_format=fmt).choices[0]
    assert reply.finish_reason == "tool_calls" and reply.message.content is None
    [call] = reply.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris"})


def test_the_responses_api_reads_calls_streamed_or_not(json_client):
    tool = {"type": "function", "name": "get_weather", "parameters": WEATHER["function"]["parameters"]}
    kwargs = dict(model="tiny", input="Weather in Paris?", tools=[tool], max_output_tokens=60, temperature=0,
                  text={"format": {"type": "json_schema", "name": "call", "schema": CALL_SCHEMA}})
    response = json_client.responses.create(**kwargs)
    [item] = response.output
    assert item.type == "function_call" and item.name == "get_weather" and item.status == "completed"
    assert json.loads(item.arguments) == {"city": "Paris"}
    events = list(json_client.responses.create(stream=True, **kwargs))
    kinds = [event.type for event in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert "response.function_call_arguments.done" in kinds and "response.output_text.delta" not in kinds
    [streamed] = events[-1].response.output
    assert (streamed.name, json.loads(streamed.arguments)) == ("get_weather", {"city": "Paris"})
    plain = json_client.responses.create(model="tiny", input="Hello", tools=[tool], max_output_tokens=5,
                                         temperature=0)
    assert [item.type for item in plain.output] == ["message"] and plain.output[0].content[0].text
    events = list(json_client.responses.create(model="tiny", input="Hello", tools=[tool], max_output_tokens=5,
                                               temperature=0, stream=True))
    deltas = [event for event in events if event.type == "response.output_text.delta"]
    [message] = events[-1].response.output
    assert deltas and {event.output_index for event in deltas} == {0}
    assert message.type == "message" and message.content[0].text == "".join(event.delta for event in deltas)


def test_start_is_refused_without_a_format_to_read(tiny_model_dir, capsys):
    """The tiny model's own template shows no tool-call format: --enable-auto-tool-choice needs a parser named;
    a parser without the switch is refused too. One line each, before serving."""
    from conveyor.entrypoints import cli

    for flags, words in ((["--enable-auto-tool-choice"], "--tool-call-parser (hermes, llama3_json, pythonic)"),
                         (["--tool-call-parser", "hermes"], "give both")):
        assert cli.main(["serve", "--model", str(tiny_model_dir), "--num-kv-blocks", "16", "--port", "0",
                         *flags]) == 2
        err = capsys.readouterr().err
        lines = [line for line in err.splitlines() if line.startswith("conveyor: error:")]
        assert len(lines) == 1 and words in lines[0] and "Traceback" not in err, err
