"""Bodies an attacker sends, against a real ``conveyor serve`` over one kept-alive connection: each gets a 400
that names where the body is wrong, and the connection serves the next request.

Found by attacking the server: a lone surrogate (the JSON escape ``\\ud800``) in a prompt, a chat message,
``/tokenize`` or the Responses ``input`` reached the tokenizer (a TypeError: 500, and the connection dropped);
900 levels of nesting in ``chat_template_kwargs`` made the chat template recurse past Python's limit (500).
"""

from __future__ import annotations

import json

import httpx
import pytest

LONE = '"say \\ud800 hi"'  # JSON text: a high surrogate with no low one after it
PAIR = '"say \\ud83d\\ude00 hi"'  # a surrogate pair is one character (an emoji), valid text


def nested(levels: int) -> str:
    return '{"a": ' * levels + "1" + "}" * levels


CASES = [
    ("/v1/completions", f'{{"prompt": {LONE}, "max_tokens": 2}}', "prompt"),
    ("/v1/chat/completions", f'{{"messages": [{{"role": "user", "content": {LONE}}}], "max_tokens": 2}}',
     "messages.0.content"),
    ("/tokenize", f'{{"prompt": {LONE}}}', "prompt"),
    ("/v1/responses", f'{{"input": {LONE}, "max_output_tokens": 2}}', "input"),
    ("/v1/completions", f'{{"prompt": "hi", "stop": [{LONE}], "max_tokens": 2}}', "stop.0"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, '
     f'"chat_template_kwargs": {nested(900)}}}', "chat_template_kwargs.a.a"),
]


@pytest.fixture(scope="module")
def connection(server: str):
    with httpx.Client(base_url=server, timeout=30) as client:
        yield client


@pytest.mark.parametrize(("path", "body", "where"), CASES)
def test_a_hostile_body_is_a_400_naming_where_and_the_connection_lives_on(connection, path, body, where) -> None:
    response = connection.post(path, content=body, headers={"Content-Type": "application/json"})
    assert response.status_code == 400, response.text
    message = response.json()["error"]["message"]
    assert where in message and ("not Unicode text" in message or "nested deeper than 64" in message), message
    after = connection.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert after.status_code == 200, "the same connection serves the next request"


def test_a_surrogate_pair_is_text_and_is_served(connection) -> None:
    response = connection.post("/v1/completions", content=f'{{"prompt": {PAIR}, "max_tokens": 2}}',
                               headers={"Content-Type": "application/json"})
    assert response.status_code == 200, response.text
    tokens = connection.post("/tokenize", content=f'{{"prompt": {PAIR}}}', headers={"Content-Type": "application/json"})
    assert tokens.status_code == 200 and json.loads(tokens.text)["count"] > 0


# A model whose tokenizer and chat template fail where real ones do: its normalizer removes the zero-width space
# (a text of only that tokenizes to no tokens), and its template shows user messages only (a chat of a system
# message renders as nothing) and compares a variable numerically (a string there is a TypeError in jinja).
ODD_TEMPLATE = ("{% if depth is defined and depth > 2 %}deep {% endif %}{% for message in messages %}"
                "{% if message['role'] == 'user' %}{{ message['content'] }}\n{% endif %}{% endfor %}")


@pytest.fixture(scope="module")
def odd_model_dir(tiny_model_dir, tmp_path_factory):
    import shutil

    folder = tmp_path_factory.mktemp("odd-tokenizer")
    shutil.copytree(tiny_model_dir, folder, dirs_exist_ok=True)
    tokenizer = json.loads((folder / "tokenizer.json").read_text())
    tokenizer["normalizer"] = {"type": "Replace", "pattern": {"String": "\u200b"}, "content": ""}
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer))
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps(config | {"chat_template": ODD_TEMPLATE}))
    return folder


@pytest.fixture(scope="module")
def odd_connection(odd_model_dir):
    from tests.serving import running_server

    with running_server(odd_model_dir, "--num-kv-blocks", "256") as running, \
            httpx.Client(base_url=running.base, timeout=30) as client:
        yield client


USER_HI = [{"role": "user", "content": "hi"}]
ODD_CASES = [
    ("/v1/completions", {"prompt": "\u200b\u200b", "max_tokens": 2}, "prompt", "no tokens"),
    ("/v1/completions", {"prompt": ["hi", "\u200b"], "max_tokens": 2}, "prompt", "no tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "system", "content": "be brief"}], "max_tokens": 2},
     "messages", "no tokens"),
    ("/v1/responses", {"instructions": "be brief", "input": [], "max_output_tokens": 2}, "input", None),
    ("/v1/chat/completions", {"messages": USER_HI, "max_tokens": 2, "chat_template_kwargs": {"depth": "x"}},
     "messages", "chat template"),
    ("/tokenize", {"messages": USER_HI, "chat_template_kwargs": {"depth": "x"}}, "messages", "chat template"),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 2, "chat_template_kwargs": {"depth": "x"}}, None, None),
]


@pytest.mark.parametrize(("path", "body", "param", "words"), ODD_CASES)
def test_what_the_tokenizer_or_template_fails_on_is_a_400_naming_the_field(odd_connection, path, body, param,
                                                                          words) -> None:
    """Before: a prompt of no tokens was a 500 (``logit row -1 of 0``; the third killed the server) and a
    template's TypeError a 500."""
    for _ in range(3):  # three in a row: the engine must not count them as failed steps
        response = odd_connection.post(path, json=body)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert param is None or error["param"] == param, error
        assert words is None or words in error["message"], error
    assert odd_connection.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200
    assert odd_connection.get("/health").status_code == 200


def test_a_template_variable_of_the_right_type_is_served(odd_connection) -> None:
    body = {"messages": USER_HI, "max_tokens": 2, "chat_template_kwargs": {"depth": 3}}
    assert odd_connection.post("/v1/chat/completions", json=body).status_code == 200
    tokens = odd_connection.post("/tokenize", json={"prompt": "\u200b"})
    assert tokens.status_code == 200 and tokens.json()["count"] == 0, "/tokenize answers what the text is"


def refusal_at_start(model_dir) -> str:
    """Run ``conveyor serve`` on ``model_dir``: it must exit at once with status 2 and one line saying why."""
    import subprocess
    import sys

    from tests.serving import free_port

    done = subprocess.run([sys.executable, "-m", "conveyor.entrypoints.cli", "serve", "--model", str(model_dir),
                           "--port", str(free_port())], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stdout + done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("conveyor: error:")]
    assert len(errors) == 1 and "Traceback" not in done.stderr, done.stderr
    return errors[0]


@pytest.fixture
def model_copy(tiny_model_dir, tmp_path):
    import shutil

    return shutil.copytree(tiny_model_dir, tmp_path / "model")


def test_a_model_without_tokenizer_files_is_refused_at_start_in_one_line(model_copy) -> None:
    """Before: the error was transformers' six lines about slow tokenizers and sentencepiece."""
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (model_copy / name).unlink()
    line = refusal_at_start(model_copy)
    assert "no usable tokenizer" in line and "tokenizer.json" in line, line


def test_a_tokenizer_larger_than_the_models_vocabulary_is_refused_at_start(model_copy) -> None:
    """Before: it started, and a prompt holding the extra token gave ids past the model's embedding."""
    tokenizer = json.loads((model_copy / "tokenizer.json").read_text())
    extra = {"id": 49152, "content": "<|extra|>", "single_word": False, "lstrip": False, "rstrip": False,
             "normalized": False, "special": True}
    tokenizer["added_tokens"].append(extra)
    (model_copy / "tokenizer.json").write_text(json.dumps(tokenizer))
    line = refusal_at_start(model_copy)
    assert "49153 tokens" in line and "49152" in line, line


@pytest.mark.parametrize(("field", "number"), [("temperature", "NaN"), ("top_p", "Infinity"),
                                               ("logit_bias", '{"5": -Infinity}'), ("presence_penalty", "NaN")])
def test_a_number_that_is_not_finite_is_a_400_saying_so(connection, field, number) -> None:
    """Before: NaN for temperature was refused as "less than or equal to 100"."""
    response = connection.post("/v1/completions", content=f'{{"prompt": "hi", "max_tokens": 2, "{field}": {number}}}',
                               headers={"Content-Type": "application/json"})
    assert response.status_code == 400, response.text
    message = response.json()["error"]["message"]
    assert field in message and "must be a finite number" in message, message


def test_a_stored_response_can_be_deleted(connection) -> None:
    """Before: DELETE /v1/responses/{id} was missing; a stored answer stayed until 1,024 newer ones came."""
    made = connection.post("/v1/responses", json={"input": "hi", "max_output_tokens": 2, "store": True})
    assert made.status_code == 200, made.text
    response_id = made.json()["id"]
    assert connection.get(f"/v1/responses/{response_id}").status_code == 200
    deleted = connection.delete(f"/v1/responses/{response_id}")
    assert deleted.status_code == 200 and deleted.json() == {"id": response_id, "object": "response", "deleted": True}
    assert connection.get(f"/v1/responses/{response_id}").status_code == 404
    assert connection.delete(f"/v1/responses/{response_id}").status_code == 404


def test_parallel_tool_calls_false_makes_at_most_one_call(connection) -> None:
    """Before: parallel_tool_calls false was accepted and not enforced (the grammar allowed a list of calls)."""
    tools = [{"type": "function", "function": {"name": name, "parameters": {
        "type": "object", "properties": {}, "additionalProperties": False}}} for name in ("ping", "pong")]
    body = {"messages": [{"role": "user", "content": "call"}], "tools": tools, "tool_choice": "required",
            "n": 16, "temperature": 1.5, "seed": 1, "max_tokens": 120}

    def calls_per_choice(parallel: bool) -> list[int]:
        response = connection.post("/v1/chat/completions", json=body | {"parallel_tool_calls": parallel})
        assert response.status_code == 200, response.text
        return [len(choice["message"]["tool_calls"] or ()) for choice in response.json()["choices"]]

    assert max(calls_per_choice(True)) > 1, "with parallel calls the model makes several: the check has power"
    assert set(calls_per_choice(False)) == {1}


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_temperature_is_held_to_openais_range(connection, path) -> None:
    """Before: up to 100 was taken, where OpenAI's maximum is 2 (the Responses API already held to 2)."""
    body = {"prompt": "hi"} if path == "/v1/completions" else {"messages": USER_HI}
    over = connection.post(path, json=body | {"max_tokens": 2, "temperature": 2.5})
    assert over.status_code == 400 and over.json()["error"]["param"] == "temperature", over.text
    assert "2" in over.json()["error"]["message"]
    assert connection.post(path, json=body | {"max_tokens": 2, "temperature": 2}).status_code == 200
