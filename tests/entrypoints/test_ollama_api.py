"""Ollama's API on a real server, through Ollama's own client (the ``ollama`` package): chat and generate, whole
and streamed (the pieces join to the whole answer), greedy answers equal to the OpenAI routes', the options
(num_predict, stop, seed, num_ctx), ``format``, the model listings (tags, show, ps, version) read from the model's
files, and the errors Ollama's clients expect: 404 for an unknown model, 400 naming a bad field, 401 without
the API key. One server for the module, with a key, a short context and a default max_tokens."""

from __future__ import annotations

import datetime
import json
import math
from pathlib import Path

import httpx
import ollama
import pytest
from safetensors import safe_open

import conveyor
from tests.serving import openai_client, running_server

MODEL = "tiny"
KEY = "ollama-key"
MAX_MODEL_LEN = 128
DEFAULT_MAX_TOKENS = 16
MESSAGES = [{"role": "user", "content": "Name three rivers."}]
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path):
    with running_server(tiny_model_dir, "--num-kv-blocks", "1024", "--served-model-name", MODEL, "--max-model-len",
                        str(MAX_MODEL_LEN), "--default-max-tokens", str(DEFAULT_MAX_TOKENS), api_key=KEY) as running:
        yield running


@pytest.fixture(scope="module")
def client(server) -> ollama.Client:
    return ollama.Client(host=server.base, headers={"Authorization": f"Bearer {KEY}"})


def joined(parts: list, field: str) -> str:
    """The streamed pieces' text, after checking the stream's shape: pieces not done, one closing object done."""
    assert len(parts) >= 2 and all(not part.done for part in parts[:-1]) and parts[-1].done
    pieces = [part.message.content if field == "message" else part.response for part in parts]
    return "".join(pieces)


def test_chat_whole_and_streamed_agree_and_carry_ollamas_fields(client):
    options = GREEDY | {"num_predict": 8}
    whole = client.chat(model=MODEL, messages=MESSAGES, options=options)
    assert whole.model == MODEL and whole.done and whole.done_reason in ("stop", "length")
    assert whole.message.role == "assistant" and whole.message.content
    assert 0 < whole.eval_count <= 8 and whole.prompt_eval_count > 0
    assert whole.total_duration >= whole.load_duration >= 0
    assert whole.total_duration >= whole.prompt_eval_duration > 0 and whole.eval_duration >= 0
    created = datetime.datetime.fromisoformat(whole.created_at)
    assert abs((datetime.datetime.now(datetime.UTC) - created).total_seconds()) < 60
    parts = list(client.chat(model=MODEL, messages=MESSAGES, options=options, stream=True))
    assert joined(parts, "message") == whole.message.content
    closing = parts[-1]
    assert (closing.done_reason, closing.eval_count) == (whole.done_reason, whole.eval_count)
    assert closing.message.content == "" and closing.total_duration > 0


def test_generate_whole_and_streamed_agree_and_return_the_context(client):
    options = GREEDY | {"num_predict": 8}
    whole = client.generate(model=MODEL, prompt="The river", options=options)
    assert whole.done and whole.response and whole.eval_count <= 8
    assert len(whole.context) == whole.prompt_eval_count + whole.eval_count
    parts = list(client.generate(model=MODEL, prompt="The river", options=options, stream=True))
    assert joined(parts, "response") == whole.response
    assert parts[-1].context == whole.context
    # The context carries the conversation on: the next prompt follows it, as Ollama's does.
    after = client.generate(model=MODEL, prompt="And then?", context=whole.context, options=options)
    assert after.prompt_eval_count > len(whole.context)
    assert after.context[:len(whole.context)] == whole.context


def test_greedy_answers_equal_the_openai_routes(server, client):
    openai = openai_client(server.base, KEY)
    ollama_chat = client.chat(model=MODEL, messages=MESSAGES, options=GREEDY | {"num_predict": 10})
    openai_chat = openai.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=10)
    assert ollama_chat.message.content == openai_chat.choices[0].message.content
    assert ollama_chat.prompt_eval_count == openai_chat.usage.prompt_tokens
    raw = client.generate(model=MODEL, prompt="Once upon a time", raw=True, options=GREEDY | {"num_predict": 10})
    completion = openai.completions.create(model=MODEL, prompt="Once upon a time", temperature=0, max_tokens=10)
    assert raw.response == completion.choices[0].text
    # generate, not raw, is the prompt as a chat's user message, through the chat template.
    templated = client.generate(model=MODEL, prompt=MESSAGES[0]["content"], options=GREEDY | {"num_predict": 10})
    assert templated.response == ollama_chat.message.content


def test_num_predict_caps_the_reply_and_minus_one_fills_the_context(client):
    long = client.generate(model=MODEL, prompt="The river", options=GREEDY | {"num_predict": 12})
    short = client.generate(model=MODEL, prompt="The river", options=GREEDY | {"num_predict": 3})
    assert (short.eval_count, short.done_reason) == (3, "length") and long.eval_count == 12
    assert long.response.startswith(short.response)
    default = client.generate(model=MODEL, prompt="The river", options=GREEDY)
    assert default.eval_count == DEFAULT_MAX_TOKENS  # the server's --default-max-tokens
    for up_to_context in (-1, -2):
        filled = client.generate(model=MODEL, prompt="The river", options=GREEDY | {"num_predict": up_to_context})
        assert (filled.done_reason, filled.prompt_eval_count + filled.eval_count) == ("length", MAX_MODEL_LEN)
    # A num_predict past the context is cut by its end, as Ollama's (OpenAI's max_tokens would be refused).
    past = client.generate(model=MODEL, prompt="The river", options=GREEDY | {"num_predict": 1000})
    assert past.prompt_eval_count + past.eval_count == MAX_MODEL_LEN


def test_stop_ends_the_reply_before_the_stop_string(client):
    text = client.generate(model=MODEL, prompt="The river", options=GREEDY | {"num_predict": 12}).response
    stop = text[len(text) // 2:len(text) // 2 + 3]
    assert stop.strip(), f"no stop string to take from {text!r}"
    stopped = client.generate(model=MODEL, prompt="The river", options=GREEDY | {"num_predict": 12, "stop": [stop]})
    assert (stopped.response, stopped.done_reason) == (text[:text.index(stop)], "stop")


def test_a_seed_makes_sampling_reproducible(client):
    def sample(seed: int) -> str:
        options = {"temperature": 1.0, "seed": seed, "num_predict": 12}
        return client.chat(model=MODEL, messages=MESSAGES, options=options).message.content

    assert sample(7) == sample(7)
    assert len({sample(seed) for seed in (1, 2, 3)}) > 1, "unseeded-looking: every seed drew the same"


def test_format_json_and_a_schema_hold_the_reply(client):
    schema = {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]}},
              "required": ["colour"], "additionalProperties": False}
    answer = client.chat(model=MODEL, messages=MESSAGES, format=schema, options=GREEDY | {"num_predict": 60})
    assert json.loads(answer.message.content)["colour"] in ("red", "green", "blue")
    generated = client.generate(model=MODEL, prompt="Colour:", format=schema, options=GREEDY | {"num_predict": 60})
    assert json.loads(generated.response)["colour"] in ("red", "green", "blue")
    raw = client.generate(model=MODEL, prompt="Colour:", raw=True, format=schema,
                          options=GREEDY | {"num_predict": 60})
    assert json.loads(raw.response)["colour"] in ("red", "green", "blue")
    # Any object: the random model could write a string forever; this seed's draw closes its object at once.
    anything = client.chat(model=MODEL, messages=MESSAGES, format="json",
                           options={"temperature": 1.0, "seed": 0, "num_predict": 40})
    assert anything.done_reason == "stop", f"cut off inside its object: {anything.message.content!r}"
    assert isinstance(json.loads(anything.message.content), dict)


def test_logprobs_come_per_token(client):
    answer = client.chat(model=MODEL, messages=MESSAGES, logprobs=True, top_logprobs=2,
                         options=GREEDY | {"num_predict": 5})
    assert len(answer.logprobs) == answer.eval_count == 5
    assert all(len(entry.top_logprobs) == 2 and entry.logprob <= 0 for entry in answer.logprobs)
    assert "".join(entry.token for entry in answer.logprobs) == answer.message.content
    parts = list(client.chat(model=MODEL, messages=MESSAGES, logprobs=True, top_logprobs=2, stream=True,
                             options=GREEDY | {"num_predict": 5}))
    streamed = [entry for part in parts for entry in part.logprobs or ()]
    assert [e.token for e in streamed] == [e.token for e in answer.logprobs]


def test_an_empty_request_loads_the_model(client):
    for answer in (client.generate(model=MODEL, prompt=""), client.chat(model=MODEL, messages=[])):
        assert (answer.done, answer.done_reason) == (True, "load")


def test_latest_tag_names_the_served_model(client):
    assert client.generate(model=f"{MODEL}:latest", prompt="Hi", options={"num_predict": 1}).model == MODEL


def test_tags_show_ps_and_version_read_the_models_files(server, client, tiny_model_dir: Path):
    weights = tiny_model_dir / "model.safetensors"
    with safe_open(weights, "numpy") as tensors:
        count = sum(math.prod(tensors.get_slice(name).get_shape()) for name in tensors.keys())  # noqa: SIM118
    config = json.loads((tiny_model_dir / "config.json").read_text())
    listed = client.list().models
    assert [entry.model for entry in listed] == [MODEL]
    entry = listed[0]
    assert entry.size == weights.stat().st_size and entry.digest == ""  # a folder has no one file's digest
    assert entry.modified_at.timestamp() == pytest.approx(weights.stat().st_mtime, abs=1e-3)
    details = entry.details
    assert (details.format, details.family, details.quantization_level) == ("safetensors", "llama", "F32")
    assert details.parameter_size == f"{count / 1e6:.2f}M"
    shown = client.show(MODEL)
    assert shown.details == details and shown.capabilities == ["completion", "embedding"]
    assert shown.modelinfo == {"general.architecture": "llama", "general.parameter_count": count,
                               "llama.context_length": config["max_position_embeddings"]}
    template = json.loads((tiny_model_dir / "tokenizer_config.json").read_text())["chat_template"]
    assert shown.template == template and shown.modelfile == "" and shown.parameters == ""
    running = client.ps().models
    assert [model.model for model in running] == [MODEL]
    assert running[0].context_length == MAX_MODEL_LEN and running[0].size > weights.stat().st_size  # and the KV
    version = httpx.get(f"{server.base}/api/version", headers={"Authorization": f"Bearer {KEY}"}).json()
    assert version == {"version": conveyor.__version__}


@pytest.mark.parametrize(("call", "status", "words"), [
    (lambda c: c.chat(model="nope", messages=MESSAGES), 404, 'model "nope" not found'),
    (lambda c: c.show("nope"), 404, 'model "nope" not found'),
    (lambda c: c.generate(model=MODEL, prompt="hi", options={"num_ctx": 4096}), 400, "options.num_ctx"),
    (lambda c: c.generate(model=MODEL, prompt="hi", options={"temperature": "hot"}), 400, "options.temperature"),
    (lambda c: c.generate(model=MODEL, prompt="hi", options={"temperature": 5}), 400, "options.temperature"),
    (lambda c: c.generate(model=MODEL, prompt="hi", options={"num_predict": 0}), 400, "options.num_predict"),
    (lambda c: c.generate(model=MODEL, prompt="hi", options={"mirostat": 2}), 400, "options.mirostat"),
    (lambda c: c.generate(model=MODEL, prompt="hi", suffix="end"), 400, "suffix"),
    (lambda c: c.generate(model=MODEL, prompt="hi", images=[b"\x89PNG"]), 400, "images"),
    (lambda c: c.generate(model=MODEL, prompt="hi", raw=True, system="Be brief."), 400, "system"),
    (lambda c: c.chat(model=MODEL, messages=MESSAGES, think=True), 400, "think"),
    (lambda c: c.chat(model=MODEL, messages=[{"role": "robot", "content": "hi"}]), 400, "messages.0.role"),
    (lambda c: c.chat(model=MODEL, messages=MESSAGES, tools=[{"type": "function", "function": {
        "name": "weather", "parameters": {"type": "object", "properties": {}}}}]), 400, "tools"),
])
def test_errors_come_in_ollamas_shape_with_their_status(client, call, status, words):
    with pytest.raises(ollama.ResponseError) as raised:
        call(client)
    assert raised.value.status_code == status and words in raised.value.error, raised.value.error


def test_options_it_does_not_know_are_ignored_as_ollama_ignores_them(client):
    options = GREEDY | {"num_predict": 4, "num_gpu": 99, "num_thread": 3, "repeat_last_n": 64, "a_new_one": 1}
    plain = client.generate(model=MODEL, prompt="The river", options=GREEDY | {"num_predict": 4})
    assert client.generate(model=MODEL, prompt="The river", options=options, keep_alive="5m").response == plain.response


def test_the_api_key_is_wanted_and_a_body_is_json_whatever_its_content_type(server):
    with pytest.raises(ollama.ResponseError) as raised:
        ollama.Client(host=server.base).list()
    assert raised.value.status_code == 401 and "API key" in raised.value.error
    body = json.dumps({"model": MODEL, "prompt": "hi", "stream": False, "options": {"num_predict": 2}})
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/x-www-form-urlencoded"}  # curl -d's
    answer = httpx.post(f"{server.base}/api/generate", content=body, headers=headers, timeout=60)
    assert answer.status_code == 200 and answer.json()["done"] is True
    broken = httpx.post(f"{server.base}/api/chat", content=b'{"model": "tiny", "messages": [', headers=headers)
    assert broken.status_code == 400 and "not JSON" in broken.json()["error"]
    yaml = httpx.post(f"{server.base}/api/generate", json={"model": MODEL, "prompt": "hi", "format": "yaml"},
                      headers=headers)  # Ollama's client refuses this itself; another client may send it
    assert yaml.status_code == 400 and yaml.json()["error"].startswith("format:")
    # Streamed by default, as Ollama: one JSON object a line.
    default = httpx.post(f"{server.base}/api/generate", json={"model": MODEL, "prompt": "hi",
                                                              "options": {"num_predict": 3}}, headers=headers)
    lines = [json.loads(line) for line in default.text.splitlines()]
    assert default.headers["content-type"] == "application/x-ndjson" and len(lines) >= 2 and lines[-1]["done"]


# ----- without a server: the shapes of what the tiny random model cannot be made to write -------------------------

class _Pieces:
    """A tokenizer whose token i is PIECES[i]: a reply's text, token by token."""

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(PIECES[i] for i in ids)


PIECES = ["<think>", "Rain", "?", "</think>", "Let me look.", "<tool_call>",
          '{"name": "weather", "arguments": {"city": "Paris"}}', "</tool_call>"]


def _outputs() -> list:
    """The reply of PIECES as the engine streams it, a token an output, the last one finished."""
    from conveyor.engine import RequestMetrics, RequestOutput

    metrics = RequestMetrics(arrival_time=10.0, first_scheduled_time=10.5, first_token_time=10.75, finish_time=11.0,
                             num_preemptions=0)
    return [RequestOutput("r", None, [7, 8, 9], "".join(PIECES[:n]), list(range(n)), PIECES[n - 1],
                          n == len(PIECES), "stop" if n == len(PIECES) else None, None, metrics)
            for n in range(1, len(PIECES) + 1)]


def _reply(chat: bool):
    from conveyor.entrypoints.ollama.replies import Reply
    from conveyor.entrypoints.openai.logprob_format import LogprobFormatter
    from conveyor.entrypoints.openai.reasoning import reasoning_parser
    from conveyor.entrypoints.openai.response_shapes import ChatShape

    shape = ChatShape("r", MODEL, LogprobFormatter(_Pieces()), auto_tools="hermes" if chat else None,
                      reasoning=reasoning_parser("qwen3"))
    return Reply(shape, chat, started_ns=0, load_ns=5)


def test_thinking_and_tool_calls_come_in_ollamas_shape_whole_and_streamed():
    whole = _reply(chat=True).whole(_outputs()[-1])
    call = {"function": {"index": 0, "name": "weather", "arguments": {"city": "Paris"}}}
    assert whole["message"] == {"role": "assistant", "content": "Let me look.", "thinking": "Rain?",
                                "tool_calls": [call | {"id": whole["message"]["tool_calls"][0]["id"]}]}
    assert (whole["done"], whole["done_reason"], whole["load_duration"]) == (True, "stop", 5)
    assert (whole["prompt_eval_count"], whole["eval_count"]) == (3, len(PIECES))
    assert (whole["prompt_eval_duration"], whole["eval_duration"]) == (250_000_000, 250_000_000)
    reply = _reply(chat=True)
    parts = [part for i, output in enumerate(_outputs()) if (part := reply.piece(output, i == 0)) is not None]
    parts.append(reply.closing(_outputs()[-1]))
    messages = [part["message"] for part in parts]
    assert "".join(m.get("thinking", "") for m in messages) == "Rain?"
    assert "".join(m["content"] for m in messages) == "Let me look."
    calls = [c for m in messages for c in m.get("tool_calls", ())]
    assert [c["function"] for c in calls] == [call["function"]]
    assert [p["done"] for p in parts] == [False] * (len(parts) - 1) + [True]
    generated = _reply(chat=False).whole(_outputs()[-1])
    assert generated["thinking"] == "Rain?" and generated["response"].startswith("Let me look.<tool_call>")
    assert generated["context"] == [7, 8, 9, *range(len(PIECES))]


def test_a_chats_history_reaches_the_template_as_the_openai_path_has_it():
    from conveyor.entrypoints.ollama.protocol import ChatRequest

    body = ChatRequest.model_validate({"model": MODEL, "think": "low", "options": {"repeat_penalty": 1.2}, "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "thinking": "Look it up.",
         "tool_calls": [{"function": {"name": "weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "Rain.", "tool_name": "weather"}]})
    openai = body.openai_body()
    assert openai["messages"][1:] == [
        {"role": "assistant", "content": "", "reasoning_content": "Look it up.",
         "tool_calls": [{"type": "function", "function": {"name": "weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "Rain.", "name": "weather"}]
    assert openai["chat_template_kwargs"] == {"enable_thinking": True, "reasoning_effort": "low"}
    assert openai["repetition_penalty"] == 1.2


def test_parameter_sizes_are_written_as_ollama_writes_them():
    from conveyor.entrypoints.ollama.listing import parameter_size

    sizes = [134_515_008, 8_030_261_248, 7_000_000_000, 500_000_000, 3_500, 999, None]
    assert [parameter_size(n) for n in sizes] == ["134.52M", "8.0B", "7B", "500M", "4K", "999", ""]


def test_a_gguf_files_facts_come_from_its_metadata_and_bytes():
    import hashlib

    from conveyor.model.weights.facts import describe_model
    from conveyor.model.weights.paths import default_model_path

    path = default_model_path()
    facts = describe_model(None)
    assert (facts.format, facts.family, facts.quantization, facts.context_length) == ("gguf", "llama", "Q4_1", 8192)
    assert facts.parameter_count == 134_515_008  # SmolLM2-135M's, as llama.cpp counts its tensors
    assert facts.digest == hashlib.sha256(path.read_bytes()).hexdigest() and facts.size_bytes == path.stat().st_size


def test_embed_gives_the_openai_routes_vectors_and_the_older_route_the_unscaled_one(server, client):
    texts = ["Paris is the capital of France.", "Rivers flow to the sea."]
    answer = client.embed(model=MODEL, input=texts)
    assert answer.model == MODEL and len(answer.embeddings) == 2
    openai = openai_client(server.base, KEY).embeddings.create(model=MODEL, input=texts)
    for ours, theirs in zip(answer.embeddings, openai.data):
        assert ours == pytest.approx(theirs.embedding, abs=1e-6)
        assert math.fsum(x * x for x in ours) == pytest.approx(1.0, abs=1e-5)
    assert answer.prompt_eval_count == openai.usage.prompt_tokens
    assert answer.total_duration >= answer.load_duration >= 0
    (single,) = client.embed(model=MODEL, input=texts[0]).embeddings
    assert single == pytest.approx(answer.embeddings[0], abs=1e-6)

    older = client.embeddings(model=MODEL, prompt=texts[0]).embedding  # /api/embeddings: not scaled
    norm = math.sqrt(math.fsum(x * x for x in older))
    assert norm != pytest.approx(1.0, abs=1e-3)
    assert [x / norm for x in older] == pytest.approx(answer.embeddings[0], abs=1e-5)


def test_embed_truncates_a_long_input_unless_asked_not_to(server, client):
    """Cut to the model's context: the vector of its first MAX_MODEL_LEN tokens."""
    long_text = "Rivers flow to the sea. " * MAX_MODEL_LEN
    (cut,) = client.embed(model=MODEL, input=long_text).embeddings
    tokens = httpx.post(f"{server.base}/tokenize", json={"model": MODEL, "prompt": long_text},
                        headers={"Authorization": f"Bearer {KEY}"}, timeout=60).json()["tokens"]
    assert len(tokens) > MAX_MODEL_LEN
    first = openai_client(server.base, KEY).embeddings.create(model=MODEL, input=tokens[:MAX_MODEL_LEN])
    assert cut == pytest.approx(first.data[0].embedding, abs=1e-6)
    with pytest.raises(ollama.ResponseError) as refused:
        client.embed(model=MODEL, input=long_text, truncate=False)
    assert refused.value.status_code == 400 and "max_model_len" in refused.value.error
    with pytest.raises(ollama.ResponseError) as refused:
        client.embed(model=MODEL, input="a", dimensions=16)
    assert refused.value.status_code == 400 and "dimensions" in refused.value.error
    with pytest.raises(ollama.ResponseError) as unknown:
        client.embed(model="no-such-model", input="a")
    assert unknown.value.status_code == 404
