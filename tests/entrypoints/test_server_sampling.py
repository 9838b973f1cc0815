"""The OpenAI parameters beyond max_tokens and temperature, through a real server and the official client:
logprobs in both endpoints' shapes (streamed chunks add up to the whole answer), echo, several prompts in
one completion request, penalties, response_format and vLLM's guided_* fields; what else clients send (nulls,
OpenAI's fields that ask for nothing missing, vLLM's min_p, include_stop_str_in_output, skip_special_tokens,
continue_final_message, echo on chat, continuous usage); bad values get a 400 naming the field."""

from __future__ import annotations

import json
import re
import shutil

import httpx
import pytest
from pydantic import BaseModel, Field

from conveyor import LLM, SamplingParams

MODEL = "tiny"


@pytest.fixture(scope="module")
def offline(tiny_model_dir):
    return LLM(str(tiny_model_dir), num_kv_blocks=1024)


MESSAGES = [{"role": "user", "content": "Name three rivers."}]


def assert_same_logprobs(got, want) -> None:
    """Equal, but for logprobs to 1e-5: the second of two equal requests finds the first one's prompt blocks
    cached and computes the rest of its prompt in a batch of another shape, which may change a last bit."""
    if isinstance(want, float):
        assert got == pytest.approx(want, rel=1e-5, abs=1e-6)
    elif isinstance(want, dict):
        assert got.keys() == want.keys()
        for key in want:
            assert_same_logprobs(got[key], want[key])
    elif isinstance(want, list):
        assert len(got) == len(want)
        for g, w in zip(got, want):
            assert_same_logprobs(g, w)
    else:
        assert got == want


def test_chat_logprobs_streamed_equal_unstreamed_equal_offline(client, offline):
    full = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0,
                                          logprobs=True, top_logprobs=3)
    content = full.choices[0].logprobs.content
    assert len(content) == full.usage.completion_tokens == 8
    assert "".join(entry.token for entry in content) == full.choices[0].message.content
    for entry in content:
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs),
                                                                 reverse=True)
        assert entry.top_logprobs[0].token == entry.token and entry.bytes == list(entry.token.encode())
    stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0,
                                            logprobs=True, top_logprobs=3, stream=True)
    streamed = [entry for chunk in stream if chunk.choices and chunk.choices[0].logprobs
                for entry in chunk.choices[0].logprobs.content]
    assert_same_logprobs([e.model_dump() for e in streamed], [e.model_dump() for e in content])
    prompt = offline.get_tokenizer().apply_chat_template(MESSAGES)
    out = offline.generate([prompt], SamplingParams(temperature=0, max_tokens=8, logprobs=3), use_tqdm=False)[0]
    assert [e.logprob for e in content] == pytest.approx([e.logprob for e in out.logprobs], abs=1e-5)


def test_completion_logprobs_and_echo_streamed_equal_unstreamed(client):
    kwargs = dict(model=MODEL, prompt="The quick brown fox", max_tokens=6, temperature=0, logprobs=2, echo=True)
    full = client.completions.create(**kwargs).choices[0]
    assert full.text.startswith("The quick brown fox")
    logprobs = full.logprobs
    num_prompt = len(logprobs.tokens) - 6
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None and num_prompt > 1
    assert all(isinstance(v, float) for v in logprobs.token_logprobs[1:])
    assert all(len(top) <= 2 for top in logprobs.top_logprobs[1:])
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(len(logprobs.tokens))]
    chunks = list(client.completions.create(**kwargs, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.text
    streamed = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert [x for s in streamed for x in s.tokens] == logprobs.tokens
    assert_same_logprobs([x for s in streamed for x in s.token_logprobs], logprobs.token_logprobs)
    assert [x for s in streamed for x in s.text_offset] == logprobs.text_offset
    plain = client.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=6, temperature=0)
    assert plain.choices[0].logprobs is None and full.text == "The quick brown fox" + plain.choices[0].text


def test_several_prompts_index_choices_prompt_by_prompt(client):
    prompts = ["The quick brown fox", "Once upon a time", "Rivers flow"]
    response = client.completions.create(model=MODEL, prompt=prompts, max_tokens=5, temperature=0, n=2)
    assert [c.index for c in response.choices] == list(range(6))
    for i, prompt in enumerate(prompts):
        alone = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0).choices[0].text
        assert response.choices[2 * i].text == response.choices[2 * i + 1].text == alone
    assert response.usage.completion_tokens == 30
    stream = client.completions.create(model=MODEL, prompt=prompts, max_tokens=5, temperature=0, stream=True)
    texts: dict[int, str] = {}
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
    assert [texts[i] for i in range(3)] == [response.choices[2 * i].text for i in range(3)]
    token_prompts = [[1000, 2000, 3000], [4000, 5000]]
    by_ids = client.completions.create(model=MODEL, prompt=token_prompts, max_tokens=5, temperature=0)
    assert [c.text for c in by_ids.choices] == [
        client.completions.create(model=MODEL, prompt=p, max_tokens=5, temperature=0).choices[0].text
        for p in token_prompts]
    assert by_ids.usage.prompt_tokens == 5


def test_penalties_bias_and_min_tokens_reach_the_sampler(client, offline):
    prompt = [1000 + 7 * i for i in range(10)]
    extra = {"repetition_penalty": 1.5, "min_tokens": 4}
    got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, presence_penalty=1.0,
                                    frequency_penalty=0.5, logit_bias={"4321": 5.0}, extra_body=extra)
    params = SamplingParams(temperature=0, max_tokens=8, presence_penalty=1.0, frequency_penalty=0.5,
                            logit_bias={4321: 5.0}, repetition_penalty=1.5, min_tokens=4)
    assert got.choices[0].text == offline.generate([prompt], params, use_tqdm=False)[0].text


class Answer(BaseModel):
    verdict: bool
    colour: str = Field(json_schema_extra={"enum": ["red", "green", "blue"]})
    score: int = Field(ge=0, le=9)


def test_openai_client_response_format_and_guided_fields(client, offline):
    parsed = client.chat.completions.parse(model=MODEL, messages=MESSAGES, max_tokens=60, temperature=0,
                                           response_format=Answer).choices[0].message.parsed
    assert isinstance(parsed, Answer) and parsed.colour in ("red", "green", "blue")
    tokenizer = offline.get_tokenizer()  # a bias towards "{" and "}" makes the random model's object "{}"
    bias = {str(tokenizer.encode(brace)[-1]): 10.0 for brace in "{}"}
    obj = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=20, temperature=0,
                                         logit_bias=bias, response_format={"type": "json_object"})
    assert json.loads(obj.choices[0].message.content) == {}
    choice = client.completions.create(model=MODEL, prompt="Pick:", max_tokens=10, temperature=1.0, seed=3,
                                       extra_body={"guided_choice": ["left", "right"]})
    assert choice.choices[0].text in ("left", "right")
    regex = client.completions.create(model=MODEL, prompt="Code:", max_tokens=10, temperature=1.0, seed=3,
                                      extra_body={"guided_regex": r"[a-f]{4}\d"})
    assert re.fullmatch(r"[a-f]{4}\d", regex.choices[0].text)


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/completions", {"prompt": "hi", "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "logprobs": -1}, "logprobs"),
    ("/v1/chat/completions", {"messages": MESSAGES, "top_logprobs": 21, "logprobs": True}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": MESSAGES, "top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": MESSAGES, "logprobs": "yes please"}, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "presence_penalty": 2.5}, "presence_penalty"),
    ("/v1/completions", {"prompt": "hi", "frequency_penalty": -3}, "frequency_penalty"),
    ("/v1/completions", {"prompt": "hi", "repetition_penalty": 0}, "repetition_penalty"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"x": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"5": 101}}, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"999999": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "min_tokens": -1}, "min_tokens"),
    ("/v1/completions", {"prompt": "hi", "min_tokens": 9, "max_tokens": 4}, "min_tokens"),
    ("/v1/completions", {"prompt": "hi", "echo": "sure"}, "echo"),
    ("/v1/completions", {"prompt": []}, "prompt"),
    ("/v1/completions", {"prompt": ["a"] * 65}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "guided_regex": "(ab"}, "guided_regex"),
    ("/v1/completions", {"prompt": "hi", "guided_json": {"type": "nonsense"}}, "guided_json"),
    ("/v1/completions", {"prompt": "hi", "guided_json": "{not json"}, "guided_json"),
    ("/v1/completions", {"prompt": "hi", "guided_choice": []}, "guided_choice"),
    ("/v1/completions", {"prompt": "hi", "guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ("/v1/chat/completions", {"messages": MESSAGES, "response_format": {"type": "xml"}}, "response_format.type"),
    ("/v1/chat/completions", {"messages": MESSAGES, "response_format": {"type": "json_schema"}}, "response_format"),
    ("/v1/chat/completions", {"messages": MESSAGES, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}}, "response_format"),
    ("/v1/completions", {"prompt": "hi", "min_p": 1.5}, "min_p"),
    ("/v1/completions", {"prompt": "hi", "prompt_logprobs": 21}, "prompt_logprobs"),
    ("/v1/chat/completions", {"messages": MESSAGES, "store": True}, "store"),
    ("/v1/chat/completions", {"messages": MESSAGES, "tool_choice": "required"}, "tool_choice"),
    ("/v1/chat/completions", {"messages": MESSAGES, "tool_choice": {"type": "function", "function": {"name": "f"}}},
     "tool_choice"),
    ("/v1/chat/completions", {"messages": MESSAGES, "modalities": ["text", "audio"]}, "modalities.1"),
    ("/v1/chat/completions", {"messages": MESSAGES, "service_tier": "flex"}, "service_tier"),
    ("/v1/chat/completions", {"messages": MESSAGES, "metadata": {str(i): "x" for i in range(17)}}, "metadata"),
    ("/v1/chat/completions", {"messages": MESSAGES, "continue_final_message": True, "add_generation_prompt": True},
     "continue_final_message"),
    ("/v1/chat/completions", {"messages": MESSAGES, "chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
    ("/v1/chat/completions", {"messages": MESSAGES, "chat_template_kwargs": {"tokenize": False}},
     "chat_template_kwargs"),
    ("/v1/chat/completions", {"messages": MESSAGES, "reasoning_effort": "low"}, "reasoning_effort"),
    ("/tokenize", {"messages": MESSAGES, "continue_final_message": True, "add_generation_prompt": True},
     "continue_final_message"),
])
def test_bad_values_get_400_naming_the_field(server, path, body, param):
    response = httpx.post(f"{server}{path}", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    assert "Traceback" not in response.text and "/project/" not in error["message"]


def _chat_text(server: str, body: dict) -> str:
    response = httpx.post(f"{server}/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES} | body,
                          timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]["content"]


def test_a_null_is_the_same_as_leaving_the_field_out(server):
    """OpenAI's API takes null for every optional field: temperature null is its default (1), not greedy."""
    plain = {"max_tokens": 8, "seed": 11}
    nulls = {name: None for name in (
        "temperature", "top_p", "top_k", "min_p", "n", "stop", "presence_penalty", "frequency_penalty", "logit_bias",
        "logprobs", "top_logprobs", "response_format", "stream", "stream_options", "user", "tools", "tool_choice",
        "metadata", "service_tier", "max_completion_tokens", "chat_template_kwargs", "echo")}
    assert _chat_text(server, plain | nulls) == _chat_text(server, plain)
    assert _chat_text(server, plain | {"temperature": 1.0}) == _chat_text(server, plain)  # seeded: reproducible
    assert _chat_text(server, plain | {"temperature": 0}) != _chat_text(server, plain)  # null was not read as 0


def test_openai_fields_that_ask_for_nothing_missing_change_nothing(client):
    """What OpenAI's own clients and SDKs send beside the prompt is accepted where it asks for nothing this
    server lacks, through the official client, and the answer is the plain one."""
    plain = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0)
    dressed = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0, metadata={"team": "eval"}, store=False,
        service_tier="auto", modalities=["text"], tool_choice="none", parallel_tool_calls=True, user="u-1")
    assert dressed.choices[0].message.content == plain.choices[0].message.content


def test_continue_final_message_and_echo_on_chat(server, client, offline):
    """vLLM's continue_final_message renders the final (assistant) message open, so the model continues it;
    echo repeats it ahead of the continuation. Streamed, unstreamed, offline and /tokenize agree."""
    started = "The first river is"
    messages = [*MESSAGES, {"role": "assistant", "content": started}]
    prompt = offline.get_tokenizer().apply_chat_template(messages, False, continue_final_message=True)
    assert offline.get_tokenizer().decode(prompt).endswith(started)  # no end-of-turn after it
    params = SamplingParams(temperature=0, max_tokens=6)
    continued = offline.generate([prompt], params, use_tqdm=False)[0].text
    assert offline.chat(messages, params, use_tqdm=False, add_generation_prompt=False,
                        continue_final_message=True)[0].text == continued
    extra = {"continue_final_message": True, "add_generation_prompt": False}
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0,
                                           extra_body=extra)
    assert plain.choices[0].message.content == continued and plain.usage.prompt_tokens == len(prompt)
    # add_generation_prompt left out: continuing the final message leaves the generation prompt out by itself.
    echoed = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0,
                                            extra_body={"continue_final_message": True, "echo": True})
    assert echoed.choices[0].message.content == started + continued
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0,
                                            stream=True, extra_body={"continue_final_message": True, "echo": True})
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == started + continued
    tokenized = httpx.post(f"{server}/tokenize", json={"messages": messages, **extra}, timeout=60).json()
    assert tokenized["tokens"] == prompt
    # echo repeats only an assistant's final message: after a user's, the reply is the plain one.
    assert _chat_text(server, {"max_tokens": 6, "temperature": 0, "echo": True}) == _chat_text(
        server, {"max_tokens": 6, "temperature": 0})


def test_include_stop_str_in_output_and_skip_special_tokens(client, offline):
    prompt = [1000 + 13 * i for i in range(8)]
    free = offline.generate([prompt], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0].text
    stop = free[len(free) // 3: len(free) // 3 + 3]
    cut = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stop=[stop])
    kept = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stop=[stop],
                                     extra_body={"include_stop_str_in_output": True})
    assert cut.choices[0].text == free[: free.find(stop)]
    assert kept.choices[0].text == free[: free.find(stop) + len(stop)]
    assert kept.choices[0].finish_reason == "stop"
    chunks = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stop=[stop],
                                       stream=True, extra_body={"include_stop_str_in_output": True})
    assert "".join(c.choices[0].text for c in chunks if c.choices) == kept.choices[0].text
    special = offline.get_tokenizer().encode("<|im_start|>")[-1]  # a special token, not EOS
    forced = {"logit_bias": {str(special): 100}}
    hidden = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0, extra_body=forced)
    shown = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0,
                                      extra_body=forced | {"skip_special_tokens": False})
    assert hidden.choices[0].text == "" and shown.choices[0].text == "<|im_start|>" * 2


def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(server):
    def chunks(options: dict) -> list[dict]:
        body = {"prompt": "Rivers flow", "max_tokens": 5, "temperature": 0, "ignore_eos": True, "stream": True,
                "stream_options": options}
        with httpx.stream("POST", f"{server}/v1/completions", json=body, timeout=60) as response:
            lines = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
        assert lines[-1] == "[DONE]"
        return [json.loads(line) for line in lines[:-1]]

    every = chunks({"include_usage": True, "continuous_usage_stats": True})
    counts = [c["usage"]["completion_tokens"] for c in every if c["choices"]]
    assert counts == sorted(counts) and counts[-1] == 5 and len(counts) >= 5
    assert every[-1]["choices"] == [] and every[-1]["usage"]["completion_tokens"] == 5
    assert len({c["usage"]["prompt_tokens"] for c in every}) == 1
    # As vLLM reads it: without include_usage there is no usage at all.
    assert all("usage" not in c for c in chunks({"continuous_usage_stats": True}))


def test_chat_template_kwargs_reach_the_template(tiny_model_dir, tmp_path):
    """chat_template_kwargs are the template's own variables: a template that reads one renders it."""
    from conveyor.engine.tokenizer import Tokenizer

    shutil.copy(tiny_model_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    config = json.loads((tiny_model_dir / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if shout %}!!{% endif %}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tokenizer = Tokenizer(tmp_path)
    messages = [{"role": "user", "content": "hello"}]
    assert tokenizer.decode(tokenizer.apply_chat_template(messages, template_kwargs={"shout": True})) == "hello!!"
    assert tokenizer.decode(tokenizer.apply_chat_template(messages)) == "hello"
    with pytest.raises(ValueError, match="chat_template_kwargs: add_generation_prompt, messages"):
        tokenizer.apply_chat_template(messages, template_kwargs={"messages": [], "add_generation_prompt": False})


def test_prompt_logprobs_as_vllm_gives_them(server, offline):
    """vLLM's prompt_logprobs: per prompt position {token id: {logprob, rank, decoded_token}} for the prompt's
    token and its alternatives, the first None; on a completion's choice, at the top of a chat answer."""
    prompt = [1000 + 11 * i for i in range(9)]
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 3, "temperature": 0, "prompt_logprobs": 2}
    got = httpx.post(f"{server}/v1/completions", json=body, timeout=60).json()["choices"][0]["prompt_logprobs"]
    params = SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=2)
    want = offline.generate([prompt], params, use_tqdm=False)[0].prompt_logprobs
    assert got[0] is None and len(got) == len(prompt)
    for token, entry, reference in zip(prompt[1:], got[1:], want[1:]):
        assert entry[str(token)]["logprob"] == pytest.approx(reference.logprob, abs=1e-5)
        assert entry[str(token)]["rank"] == reference.rank
        alternatives = sorted((v["rank"], k) for k, v in entry.items() if v["rank"] <= 2)
        assert [int(k) for _, k in alternatives] == [t for t, _ in reference.top]
    with httpx.stream("POST", f"{server}/v1/completions", json=body | {"stream": True}, timeout=60) as stream:
        chunks = [json.loads(line[6:]) for line in stream.iter_lines() if line.startswith("data: {")]
    sent = [c["choices"][0]["prompt_logprobs"] for c in chunks if "prompt_logprobs" in c["choices"][0]]
    assert len(sent) == 1 and [e and sorted(e) for e in sent[0]] == [e and sorted(e) for e in got]
    chat = httpx.post(f"{server}/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": MESSAGES, "max_tokens": 2, "temperature": 0, "prompt_logprobs": 0}).json()
    assert len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"] and chat["prompt_logprobs"][0] is None
    assert all(len(entry) == 1 for entry in chat["prompt_logprobs"][1:])  # the prompt's own token only
    plain = httpx.post(f"{server}/v1/completions", json={**body, "prompt_logprobs": None}, timeout=60).json()
    assert "prompt_logprobs" not in plain["choices"][0]
