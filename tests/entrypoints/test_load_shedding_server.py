"""Load shedding and tenant salts on real servers, with real clients: a refusal is a 429 in OpenAI's error shape
with ``Retry-After``, at once (a queue cap, or a deadline the predicted wait already misses); a tenant's
prefix is reported cached to that tenant only under ``--tenant-cache-salt`` (and never across ``cache_salt``);
offline, a queue cap is a RequestRefused and nothing of the call is left queued."""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest

from conveyor.core.errors import RequestRefused
from tests.serving import metric, openai_client, running_server, wait_until_idle

PROMPT = [1000 + i for i in range(64)]  # four blocks of 16: three of them can be found cached


def check_refusal(reply: httpx.Response, code: str) -> None:
    assert reply.status_code == 429, reply.text
    assert int(reply.headers["Retry-After"]) >= 1
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "rate_limit_error" and error["code"] == code and error["param"] is None
    assert "retry later" in error["message"]


def wait_for(server, name: str, value: float, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while metric(server, name) != value:
        assert time.monotonic() < deadline, f"{name} never reached {value}"
        time.sleep(0.02)


def cached_tokens(server, user: str, **extra) -> int:
    body = {"prompt": PROMPT, "max_tokens": 1, "temperature": 0, "user": user, **extra}
    reply = httpx.post(f"{server.base}/v1/completions", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    return reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_a_full_queue_is_a_429_with_retry_after_at_once(tiny_model_dir) -> None:
    flags = ("--max-num-seqs", "1", "--max-num-queued-requests", "1", "--num-kv-blocks", "256")
    with running_server(tiny_model_dir, *flags) as server:
        url = f"{server.base}/v1/completions"
        long_body = {"prompt": "Hello", "max_tokens": 1000, "temperature": 0, "ignore_eos": True}
        model = httpx.get(f"{server.base}/v1/models").json()["data"][0]["id"]
        client = openai_client(server.base)
        replies: dict[str, httpx.Response] = {}
        running = threading.Thread(target=lambda: replies.setdefault("a", httpx.post(url, json=long_body,
                                                                                       timeout=120)))
        running.start()
        wait_for(server, "conveyor:num_requests_running", 1)
        queued = threading.Thread(target=lambda: replies.setdefault("b", httpx.post(url, json={
            "prompt": "Hi", "max_tokens": 2, "temperature": 0}, timeout=120)))
        queued.start()
        wait_for(server, "conveyor:num_requests_waiting", 1)
        with pytest.raises(openai.RateLimitError):  # the official client sees it as OpenAI's own 429
            client.completions.create(model=model, prompt="Hi", max_tokens=2)
        start = time.perf_counter()
        refused = httpx.post(url, json={"prompt": "Hi", "max_tokens": 2}, timeout=30)
        elapsed = time.perf_counter() - start
        check_refusal(refused, "queue_full")
        assert "--max-num-queued-requests" in refused.json()["error"]["message"]
        assert elapsed < 0.5, f"the 429 took {elapsed * 1000:.0f} ms"
        running.join()
        queued.join()
        assert replies["a"].status_code == 200 and replies["b"].status_code == 200
        wait_until_idle(server)
        # Without --tenant-cache-salt, one tenant's prompt is found cached by another: the salt test's control.
        assert cached_tokens(server, "alice") == 0
        assert cached_tokens(server, "bob") == 48


def test_a_deadline_the_wait_misses_is_a_429_and_salted_tenants_share_no_prefix(tiny_model_dir) -> None:
    flags = ("--scheduling-policy", "slo", "--admission-control", "--tenant-cache-salt", "--num-kv-blocks", "256")
    with running_server(tiny_model_dir, *flags) as server:
        url = f"{server.base}/v1/completions"
        warm = httpx.post(url, json={"prompt": "Hello", "max_tokens": 24, "temperature": 0, "ignore_eos": True},
                          timeout=60)
        assert warm.status_code == 200, warm.text  # enough steps timed for admission control to predict
        start = time.perf_counter()
        refused = httpx.post(url, json={"prompt": "Hello", "max_tokens": 2, "ttft_slo_ms": 0.001}, timeout=30)
        elapsed = time.perf_counter() - start
        check_refusal(refused, "deadline_unattainable")
        assert elapsed < 0.5, f"the 429 took {elapsed * 1000:.0f} ms"
        loose = httpx.post(url, json={"prompt": "Hello", "max_tokens": 2, "ttft_slo_ms": 60_000}, timeout=60)
        assert loose.status_code == 200, loose.text
        assert cached_tokens(server, "alice") == 0
        assert cached_tokens(server, "alice") == 48  # the tenant's own prefix is found again
        assert cached_tokens(server, "bob") == 0  # another tenant's is not
        assert cached_tokens(server, "alice", cache_salt="x") == 0  # nor across a client's cache_salt
        assert cached_tokens(server, "alice", cache_salt="x") == 48


def test_offline_a_queue_cap_refuses_the_call_whole(tiny_model_dir) -> None:
    from conveyor import LLM, SamplingParams

    llm = LLM(model=str(tiny_model_dir), max_num_queued_requests=2, num_kv_blocks=64)
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    with pytest.raises(RequestRefused, match="max-num-queued-requests") as refused:
        llm.generate(["a", "b", "c"], params, use_tqdm=False)
    assert refused.value.reason == "queue_full"
    assert not llm.engine.has_unfinished_requests()
    assert [len(o.token_ids) for o in llm.generate(["a", "b"], params, use_tqdm=False)] == [2, 2]
