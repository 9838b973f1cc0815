"""Reasoning parsers (``--reasoning-parser``) and the chat templates they come with (``--chat-template``,
``chat_template_kwargs``).

The parsers on text: deepseek_r1 and qwen3 split a reply into reasoning and content, whole or fed in pieces of
1, 3 and 7 characters (the same split), and the reasoning's tokens are counted. Then two real servers of the
tiny model and the official client: its random weights would never think, so ``guided_regex`` (chat) and a JSON
schema (the Responses API) hold its reply to the text under test, and what comes back is what the parser read.
The deepseek_r1 server reads a Jinja file as its chat template, the qwen3 server a template given as a string
on the command line: what the model sees is that template's rendering; one that fails on a request's messages
answers that request 400, naming the error, and the others go on.
"""

from __future__ import annotations

import concurrent.futures
import json

import httpx
import pytest

from conveyor.engine.tokenizer import Tokenizer
from conveyor.entrypoints.openai.reasoning import (
    PARSERS,
    DeepSeekR1Parser,
    count_reasoning_tokens,
    reasoning_parser,
    split,
)
from tests.serving import openai_client, running_server

CASES = [  # (parser, reply, reasoning, content)
    ("deepseek_r1", "<think>Paris is in France.</think>The answer is Paris.", "Paris is in France.",
     "The answer is Paris."),
    ("deepseek_r1", "Paris is in France.</think>The answer is Paris.", "Paris is in France.",  # <think> in the prompt
     "The answer is Paris."),
    ("deepseek_r1", "<think>\nStill thinking when cut off", "\nStill thinking when cut off", None),
    ("deepseek_r1", "No tags at all", "No tags at all", None),  # cut off before </think>: all reasoning
    ("deepseek_r1", "<think>a < b and </thin</think>x<think>y</think>", "a < b and </thin", "x<think>y</think>"),
    ("deepseek_r1", "<think></think>", None, None),
    ("qwen3", "<think>Paris is in France.</think>\n\nThe answer is Paris.", "Paris is in France.",
     "\n\nThe answer is Paris."),
    ("qwen3", "The answer is Paris.", None, "The answer is Paris."),  # enable_thinking false: no block
    ("qwen3", "Paris is in France.</think>Paris.", None, "Paris is in France.</think>Paris."),
    ("qwen3", '"<think>r</think>Paris."', "r", '"Paris."'),  # content ahead of the block stays content
    ("qwen3", "<think>cut off", "cut off", None),
    ("qwen3", "a <thin", None, "a <thin"),
]


@pytest.mark.parametrize(("parser", "reply", "reasoning", "content"), CASES)
def test_a_whole_reply_splits_into_reasoning_and_content(parser, reply, reasoning, content):
    assert split(PARSERS[parser], reply) == (reasoning, content)


def fed(make, reply: str, piece: int) -> tuple[str | None, str | None]:
    parser = make()
    reasoning, content = "", ""
    for start in range(0, len(reply), piece):
        more_reasoning, more_content = parser.feed(reply[start:start + piece])
        reasoning, content = reasoning + more_reasoning, content + more_content
    more_reasoning, more_content = parser.finish()
    return (reasoning + more_reasoning) or None, (content + more_content) or None


@pytest.mark.parametrize(("parser", "reply", "reasoning", "content"), CASES)
@pytest.mark.parametrize("piece", [1, 3, 7])
def test_a_reply_fed_in_pieces_splits_the_same(parser, reply, reasoning, content, piece):
    assert fed(PARSERS[parser], reply, piece) == (reasoning, content)
    constrained = reasoning_parser(parser, constrained=True)
    assert fed(constrained, reply, piece) == split(constrained, reply)


def test_deepseek_r1_streams_reasoning_at_once_and_holds_back_only_a_tags_beginning():
    parser = DeepSeekR1Parser()
    assert parser.feed("<think>Let me see") == ("Let me see", "")
    assert parser.feed(". </th") == (". ", "")
    assert parser.feed("ink>\n\nParis") == ("", "\n\nParis")
    assert parser.feed("</think>") == ("", "</think>")  # the reasoning ended: tags are content now


def test_a_constrained_deepseek_r1_reply_is_content_unless_a_tag_shows_reasoning():
    """Held to a constraint from its first token, a reply may be the answer itself (a JSON object): its text waits
    for a tag; without one it is content."""
    make = reasoning_parser("deepseek_r1", constrained=True)
    assert split(make, '{"city": "Paris"}') == (None, '{"city": "Paris"}')
    assert split(make, "Paris is in France.</think>Paris.") == ("Paris is in France.", "Paris.")
    parser = make()
    assert parser.feed("Paris is") == ("", "")
    assert parser.feed(" in France.</think>Pa") == ("Paris is in France.", "Pa")
    parser = make()
    assert parser.feed("<think>Paris") == ("Paris", "")  # an opening tag decides at once


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir) -> Tokenizer:
    return Tokenizer(tiny_model_dir)


def tokens_through_close(tokenizer: Tokenizer, ids: list[int]) -> int:
    """How many tokens it takes for the text to show </think> (all, where it never does)."""
    return next((k for k in range(len(ids) + 1) if "</think>" in tokenizer.decode(ids[:k])), len(ids))


def test_reasoning_tokens_run_through_the_one_that_closes_the_reasoning(tokenizer):
    reply = "<think>Paris is the capital of France.</think>The answer is Paris."
    ids = tokenizer.encode(reply)
    assert tokenizer.decode(ids) == reply
    for name in PARSERS:
        spent = count_reasoning_tokens(PARSERS[name], ids, tokenizer.decode)
        assert spent == tokens_through_close(tokenizer, ids) < len(ids)
    cut = tokenizer.encode("Still thinking, cut off")
    assert count_reasoning_tokens(PARSERS["deepseek_r1"], cut, tokenizer.decode) == len(cut)
    assert count_reasoning_tokens(PARSERS["qwen3"], cut, tokenizer.decode) == 0
    ahead = tokenizer.encode('"<think>Paris.</think>Yes."')  # content first: its tokens are not reasoning
    assert 0 < count_reasoning_tokens(PARSERS["qwen3"], ahead, tokenizer.decode) < tokens_through_close(tokenizer,
                                                                                                       ahead)


# ----- real servers ----------------------------------------------------------------------------------------------

# A Jinja file in Qwen3's manner: enable_thinking false puts an empty block in the prompt. A message 'boom' makes it
# raise, as a template does on what it cannot show; 'undefined' reads an attribute a string does not have.
FILE_TEMPLATE = """{%- for message in messages %}
{%- if message.content == 'boom' %}{{ raise_exception('message ' ~ loop.index0 ~ ' cannot be shown') }}{% endif %}
{%- if message.content == 'undefined' %}{{ message.content.no.such }}{% endif %}
<|im_start|>{{ message.role }} (from the file)
{{ message.content }}<|im_end|>
{%- endfor %}
{%- if add_generation_prompt %}
<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% endif %}{% endif %}"""
# One line, as a shell passes it: its \\n escapes are read as line breaks.
STRING_TEMPLATE = ("{%- for message in messages %}<|im_start|>{{ message.role }} (from a string)\\n"
                   "{{ message.content }}<|im_end|>\\n{% endfor %}{%- if add_generation_prompt %}"
                   "<|im_start|>assistant\\n{% endif %}")
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def _literal(text: str) -> str:
    """A regex matching exactly ``text``."""
    return "".join("\\n" if c == "\n" else "\\" + c if c in ".^$*+?{}[]\\|()" else c for c in text)


@pytest.fixture(scope="module")
def deepseek(tiny_model_dir, tmp_path_factory):
    template = tmp_path_factory.mktemp("template") / "template.jinja"
    template.write_text(FILE_TEMPLATE)
    with running_server(tiny_model_dir, "--reasoning-parser", "deepseek_r1", "--chat-template", str(template),
                        "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--num-kv-blocks", "256",
                        "--served-model-name", "tiny") as server:
        yield server


@pytest.fixture(scope="module")
def qwen3(tiny_model_dir):
    with running_server(tiny_model_dir, "--reasoning-parser", "qwen3", "--chat-template", STRING_TEMPLATE,
                        "--num-kv-blocks", "256", "--served-model-name", "tiny") as server:
        yield server


def reply_as(server, text: str, **kwargs):
    """The whole reply and the streamed one, held to ``text``."""
    client = openai_client(server.base)
    body = dict(model="tiny", messages=MESSAGES, max_tokens=80, temperature=0,
                extra_body={"guided_regex": _literal(text), "return_token_ids": True}) | kwargs
    whole = client.chat.completions.create(**body)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **body))
    return whole, chunks


def streamed(chunks) -> tuple[str | None, str | None, list[tuple[str, str]], str | None]:
    """The reasoning, content, calls (name, arguments) and finish_reason a stream's deltas add up to."""
    reasoning, content, calls, finish = "", "", {}, None
    for chunk in chunks:
        for choice in chunk.choices:
            reasoning += getattr(choice.delta, "reasoning_content", None) or ""
            content += choice.delta.content or ""
            for call in choice.delta.tool_calls or ():
                name, arguments = calls.get(call.index, ("", ""))
                calls[call.index] = (name + (call.function.name or ""), arguments + (call.function.arguments or ""))
            finish = choice.finish_reason or finish
    return reasoning or None, content or None, [calls[i] for i in sorted(calls)], finish


def test_chat_replies_carry_reasoning_content_apart_streamed_or_not(deepseek, tokenizer):
    whole, chunks = reply_as(deepseek, "<think>Paris is in France.</think>The answer is Paris.")
    message = whole.choices[0].message
    assert (message.reasoning_content, message.content) == ("Paris is in France.", "The answer is Paris.")
    assert streamed(chunks) == ("Paris is in France.", "The answer is Paris.", [], "stop")
    ids = whole.choices[0].token_ids
    spent = whole.usage.completion_tokens_details.reasoning_tokens
    assert spent == tokens_through_close(tokenizer, ids) < whole.usage.completion_tokens
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == spent


def test_deepseek_r1_reads_reasoning_whose_opening_tag_was_in_the_prompt(deepseek):
    whole, chunks = reply_as(deepseek, "Paris is in France.</think>Paris.")
    message = whole.choices[0].message
    assert (message.reasoning_content, message.content) == ("Paris is in France.", "Paris.")
    assert streamed(chunks)[:2] == ("Paris is in France.", "Paris.")


def test_a_json_answer_is_content(deepseek):
    schema = {"type": "object", "properties": {"city": {"const": "Paris"}}, "required": ["city"],
              "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": schema}}
    client = openai_client(deepseek.base)
    reply = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=20, temperature=0,
                                           response_format=fmt).choices[0].message
    assert json.loads(reply.content) == {"city": "Paris"} and reply.reasoning_content is None


def test_tool_calls_after_the_reasoning_are_read_from_the_content(deepseek):
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    whole, chunks = reply_as(deepseek, f"<think>I should look it up.</think>{call}", tools=[WEATHER])
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.reasoning_content == "I should look it up."
    [made] = choice.message.tool_calls
    assert (made.function.name, json.loads(made.function.arguments)) == ("get_weather", {"city": "Paris"})
    assert streamed(chunks) == ("I should look it up.", None, [("get_weather", made.function.arguments)],
                                "tool_calls")


def test_qwen3_needs_the_block_in_the_reply(qwen3):
    whole, chunks = reply_as(qwen3, "<think>Paris is in France.</think>Paris.")
    assert (whole.choices[0].message.reasoning_content, whole.choices[0].message.content) == (
        "Paris is in France.", "Paris.")
    assert streamed(chunks)[:2] == ("Paris is in France.", "Paris.")
    whole, chunks = reply_as(qwen3, "Paris is in France.</think>Paris.")
    assert whole.choices[0].message.reasoning_content is None
    assert whole.choices[0].message.content == "Paris is in France.</think>Paris."
    assert whole.usage.completion_tokens_details.reasoning_tokens == 0
    assert streamed(chunks)[:2] == (None, "Paris is in France.</think>Paris.")


def test_the_responses_api_gives_a_reasoning_item_and_counts_its_tokens(deepseek, tokenizer):
    """Unconstrained, the tiny model never writes </think>: deepseek_r1 reads the whole reply as reasoning."""
    client = openai_client(deepseek.base)
    kwargs = dict(model="tiny", input="What is the capital of France?", max_output_tokens=12, temperature=0)
    response = client.responses.create(**kwargs)
    [item] = response.output
    assert item.type == "reasoning" and item.id.startswith("rs_") and item.content[0].text
    assert response.usage.output_tokens_details.reasoning_tokens == response.usage.output_tokens == 12
    events = list(client.responses.create(stream=True, **kwargs))
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert deltas == item.content[0].text and "response.output_text.delta" not in {e.type for e in events}
    final = events[-1].response
    assert [i.type for i in final.output] == ["reasoning"] and final.output[0].content[0].text == deltas
    assert final.usage.output_tokens_details.reasoning_tokens == 12


def test_the_responses_api_splits_reasoning_and_message_in_the_order_they_came(qwen3):
    """text.format holds the reply to a JSON string, whose opening quote is content ahead of the block."""
    client = openai_client(qwen3.base)
    schema = {"type": "string", "const": "<think>Paris is in France.</think>Paris."}
    kwargs = dict(model="tiny", input="What is the capital of France?", max_output_tokens=40, temperature=0,
                  text={"format": {"type": "json_schema", "name": "answer", "schema": schema}})
    response = client.responses.create(**kwargs)
    assert [item.type for item in response.output] == ["message", "reasoning"]
    assert response.output_text == '"Paris."' and response.output[1].content[0].text == "Paris is in France."
    spent = response.usage.output_tokens_details.reasoning_tokens
    assert 0 < spent < response.usage.output_tokens
    events = list(client.responses.create(stream=True, **kwargs))
    kinds = [e.type for e in events]
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.done")
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert (reasoning, text) == ("Paris is in France.", '"Paris."')
    assert {e.output_index for e in events if e.type == "response.reasoning_text.delta"} == {1}
    final = events[-1].response
    assert [item.type for item in final.output] == ["message", "reasoning"]
    assert final.output_text == '"Paris."' and final.output[1].content[0].text == reasoning
    assert final.usage.output_tokens_details.reasoning_tokens == spent
    follow = client.responses.create(model="tiny", input="And of Italy?", previous_response_id=response.id,
                                     max_output_tokens=4, temperature=0)
    assert follow.status in ("completed", "incomplete")  # the stored reasoning item is left out of the history


# ----- the chat templates those servers read ---------------------------------------------------------------------

def seen(server, messages, **options) -> str:
    """The prompt the server's template makes of ``messages``, as text."""
    tokens = httpx.post(f"{server.base}/tokenize", json={"messages": messages, **options}, timeout=30).json()
    return httpx.post(f"{server.base}/detokenize", json={"tokens": tokens["tokens"]}, timeout=30).json()["prompt"]


def rendered(tokenizer: Tokenizer, template: str, messages, **kwargs) -> str:
    return tokenizer.hf_tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                                      add_generation_prompt=True, **kwargs)


def test_a_template_file_and_a_template_string_are_what_the_model_sees(deepseek, qwen3, tokenizer):
    from_file = seen(deepseek, MESSAGES)
    assert from_file == rendered(tokenizer, FILE_TEMPLATE, MESSAGES) and "(from the file)" in from_file
    from_string = seen(qwen3, MESSAGES)
    assert from_string == ("<|im_start|>user (from a string)\nWhat is the capital of France?<|im_end|>\n"
                           "<|im_start|>assistant\n")
    own = rendered(tokenizer, tokenizer.hf_tokenizer.chat_template, MESSAGES)
    assert own not in (from_file, from_string)
    for server, prompt in ((deepseek, from_file), (qwen3, from_string)):
        reply = openai_client(server.base).chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=1,
                                                                   temperature=0)
        assert reply.usage.prompt_tokens == len(tokenizer.hf_tokenizer.encode(prompt, add_special_tokens=False))


def test_chat_template_kwargs_reach_the_template(deepseek):
    thinking = seen(deepseek, MESSAGES)
    not_thinking = seen(deepseek, MESSAGES, chat_template_kwargs={"enable_thinking": False})
    assert not_thinking == thinking + "<think>\n\n</think>\n\n"
    client = openai_client(deepseek.base)
    plain = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=1, temperature=0)
    off = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=1, temperature=0,
                                         extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert off.usage.prompt_tokens > plain.usage.prompt_tokens


def test_a_template_that_fails_on_a_request_answers_it_400_and_the_others_go_on(deepseek):
    def ask(content: str) -> httpx.Response:
        body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}, {"role": "user", "content": content}],
                "max_tokens": 4, "temperature": 0}
        return httpx.post(f"{deepseek.base}/v1/chat/completions", json=body, timeout=60)

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(ask, ["Hello", "boom", "Hello again", "undefined", "Bye", "boom"]))
    assert [a.status_code for a in answers] == [200, 400, 200, 400, 200, 400]
    boom, undefined = answers[1].json()["error"], answers[3].json()["error"]
    assert boom["param"] == "messages" and "message 1 cannot be shown" in boom["message"]
    assert "line 2 of the template" in boom["message"]
    assert "has no attribute 'no'" in undefined["message"] and "line 3 of the template" in undefined["message"]
    responses = httpx.post(f"{deepseek.base}/v1/responses", json={"model": "tiny", "input": "boom"}, timeout=60)
    assert responses.status_code == 400 and "cannot be shown" in responses.json()["error"]["message"]
    assert ask("Fine").status_code == 200 and httpx.get(f"{deepseek.base}/health").status_code == 200
