"""What one client may ask of a real ``conveyor serve``: sequences per request, time to send a body; and what a
browser may: CORS for the origins named, nothing for a Host the server does not answer for.

Found by attacking the server: one 1 KB request asked for 64 prompts x n=64 = 4,096 sequences (41 s of engine
time at max_tokens 1); 60 connections that declared 1,000 bytes and sent 10 all stayed open; no CORS at all,
and with no key a page could reach the server by DNS rebinding (no Host check).
"""

from __future__ import annotations

import socket
import time
from urllib.parse import urlparse

import httpx
import pytest

from tests.serving import running_server

KEY = "limits-key"
APP = "http://app.example"


@pytest.fixture(scope="module")
def served(tiny_model_dir):
    with running_server(tiny_model_dir, "--num-kv-blocks", "256", "--max-sequences-per-request", "8",
                        "--body-read-timeout", "1", "--allowed-origins", f'["{APP}"]',
                        "--allowed-hosts", '["127.0.0.1", "localhost"]', api_key=KEY) as running:
        yield running


def test_more_sequences_than_the_cap_is_a_400_naming_it(served) -> None:
    with httpx.Client(base_url=served.base, headers=served.headers, timeout=60) as client:
        over = client.post("/v1/completions", json={"prompt": ["a", "b", "c"], "n": 3, "max_tokens": 1})
        assert over.status_code == 400 and over.json()["error"]["param"] == "n", over.text
        assert "--max-sequences-per-request of 8" in over.json()["error"]["message"]
        chat = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "n": 9,
                                                          "max_tokens": 1})
        assert chat.status_code == 400 and chat.json()["error"]["param"] == "n", chat.text
        within = client.post("/v1/completions", json={"prompt": ["a", "b"], "n": 4, "max_tokens": 1})
        assert within.status_code == 200 and len(within.json()["choices"]) == 8


def test_a_slow_sender_gets_408_and_its_connection_closed(served) -> None:
    address = urlparse(served.base)
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\n"
            "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n").encode()
    senders = [socket.create_connection((address.hostname, address.port), timeout=10) for _ in range(20)]
    start = time.monotonic()
    for sender in senders:
        sender.sendall(head + b'{"prompt":')  # 10 of the 1,000 bytes declared, and then nothing
    for sender in senders:
        answer = b""
        while chunk := sender.recv(65536):  # until the server closes the connection
            answer += chunk
        sender.close()
        assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
        assert b"did not arrive within 1 s" in answer
    assert time.monotonic() - start < 8, "every slow sender is cut off near the deadline"
    assert httpx.get(f"{served.base}/health").status_code == 200


def test_cors_answers_the_allowed_origin_only(served) -> None:
    preflight = {"Origin": APP, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}
    allowed = httpx.options(f"{served.base}/v1/completions", headers=preflight)
    assert allowed.status_code == 200, "a preflight carries no key: CORS answers it before the key check"
    assert allowed.headers["access-control-allow-origin"] == APP
    other = httpx.options(f"{served.base}/v1/completions", headers=preflight | {"Origin": "http://evil.example"})
    assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
    call = httpx.post(f"{served.base}/v1/completions", json={"prompt": "hi", "max_tokens": 1},
                      headers=served.headers | {"Origin": APP})
    assert call.status_code == 200 and call.headers["access-control-allow-origin"] == APP


def test_a_host_not_allowed_is_refused(served) -> None:
    rebound = httpx.get(f"{served.base}/health", headers={"Host": "attacker.example:8000"})
    assert rebound.status_code == 421 and rebound.json()["error"]["code"] == "host_not_allowed"
    assert httpx.get(f"{served.base}/health", headers={"Host": "localhost"}).status_code == 200
    assert httpx.get(f"{served.base}/health").status_code == 200  # 127.0.0.1:PORT
