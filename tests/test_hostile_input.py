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
