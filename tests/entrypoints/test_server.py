"""The OpenAI-compatible server, as a real process on a loopback port, driven by the official client."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest

from conveyor import SamplingParams
from tests.serving import free_port, offline_text, openai_client, running_server

API_KEY = "test-key"


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with running_server(tiny_model_dir, "--num-kv-blocks", "1024", "--api-key", API_KEY,
                        "--served-model-name", "tiny", "--max-request-bytes", "20000") as running:
        yield running.base


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server, API_KEY)


def test_completion_streamed_equals_unstreamed_equals_offline(client, offline):
    prompt = "The quick brown fox"
    full = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0)
    chunks = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0, stream=True)
    streamed = "".join(c.choices[0].text for c in chunks)
    assert full.choices[0].text == streamed == offline_text(offline, prompt, 12)
    assert full.usage.completion_tokens == 12 and full.choices[0].finish_reason == "length"


def test_chat_streamed_equals_unstreamed_equals_offline(client, offline):
    messages = [{"role": "user", "content": "Say something."}]
    full = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0)
    stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    parts, usage = [], None
    for chunk in stream:
        if chunk.choices:
            parts.append(chunk.choices[0].delta.content or "")
        if chunk.usage:
            usage = chunk.usage
    prompt_ids = offline.tokenizer.apply_chat_template(messages)
    assert full.choices[0].message.content == "".join(parts) == offline_text(offline, prompt_ids, 10)
    assert usage is not None and usage.completion_tokens == 10 and usage.prompt_tokens == len(prompt_ids)


def test_return_token_ids_and_timings_answer_as_vllm_and_llama_cpp_do(client, offline):
    prompt = [504, 3458, 282, 9, 17]
    expected = offline.generate([prompt], SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True),
                                use_tqdm=False)[0].token_ids
    extra = {"return_token_ids": True, "ignore_eos": True}
    full = client.completions.create(model="tiny", prompt=prompt, max_tokens=9, temperature=0, extra_body=extra)
    answer = full.model_dump()
    assert answer["choices"][0]["token_ids"] == expected and answer["choices"][0]["prompt_token_ids"] == prompt
    timings = answer["timings"]  # llama.cpp's names: the output's time from its first token to its last
    assert timings["predicted_n"] == 9 and timings["prompt_n"] == len(prompt) and timings["cache_n"] == 0
    assert timings["predicted_ms"] > 0 and timings["prompt_ms"] > 0
    chunks = client.completions.create(model="tiny", prompt=prompt, max_tokens=9, temperature=0, stream=True,
                                       extra_body=extra)
    streamed = [token for c in chunks for token in c.model_dump()["choices"][0]["token_ids"]]
    assert streamed == expected  # each chunk carries the ids it adds, none twice
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=5, temperature=0, extra_body=extra).model_dump()
    assert len(chat["choices"][0]["token_ids"]) == 5 and chat["prompt_token_ids"]
    plain = client.completions.create(model="tiny", prompt=prompt, max_tokens=3, temperature=0).model_dump()
    assert "token_ids" not in plain["choices"][0]


def test_32_concurrent_streams_match_offline(server, offline):
    rng = random.Random(5)
    prompts = [[rng.randrange(1000, 40000) for _ in range(rng.randrange(1, 60))] for _ in range(32)]
    lengths = [rng.randrange(1, 24) for _ in prompts]

    async def one(client: openai.AsyncOpenAI, prompt, n):
        stream = await client.completions.create(model="tiny", prompt=prompt, max_tokens=n, temperature=0,
                                                 stream=True)
        return "".join([c.choices[0].text async for c in stream])

    async def all_of_them():
        client = openai.AsyncOpenAI(base_url=f"{server}/v1", api_key=API_KEY, max_retries=0)
        return await asyncio.gather(*(one(client, p, n) for p, n in zip(prompts, lengths)))

    texts = asyncio.run(all_of_them())
    expected = offline.generate(prompts, [SamplingParams(temperature=0.0, max_tokens=n) for n in lengths],
                                use_tqdm=False)
    assert texts == [o.text for o in expected]


AUTH = {"Authorization": f"Bearer {API_KEY}"}


def _metric(base: str, name: str) -> float:
    for line in httpx.get(f"{base}/metrics", headers=AUTH).text.splitlines():
        if line.startswith(f"conveyor:{name}{{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"metric {name} not found")


def test_a_repeated_prompt_reports_its_cached_tokens_and_the_counters_move(client, server):
    rng = random.Random(11)
    prompt = [rng.randrange(1000, 40000) for _ in range(70)]  # 4 full blocks of 16, and 6 tokens more
    before = _metric(server, "prefix_cache_hits_total")
    first = client.completions.create(model="tiny", prompt=prompt, max_tokens=4, temperature=0)
    again = client.completions.create(model="tiny", prompt=prompt, max_tokens=4, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens == 64
    assert again.choices[0].text == first.choices[0].text
    deadline = time.monotonic() + 5  # the gauges and counters move after the step that answered
    while _metric(server, "prefix_cache_hits_total") < before + 64:
        assert time.monotonic() < deadline, "prefix_cache_hits_total did not move"
        time.sleep(0.05)
    assert _metric(server, "prefix_cache_hits_total") == before + 64
    assert _metric(server, "prefix_cache_queries_total") >= 2 * 70


def test_no_max_tokens_means_the_rest_of_the_context(client):
    prompt = [random.Random(5).randrange(1000, 40000) for _ in range(1000)]  # the tiny model's context is 1024
    reply = client.completions.create(model="tiny", prompt=prompt, temperature=0, extra_body={"ignore_eos": True})
    assert reply.usage.completion_tokens == 1024 - 1000 and reply.choices[0].finish_reason == "length"


def test_n_3_streamed_and_unstreamed_equal_offline(client, offline):
    prompt = [random.Random(21).randrange(1000, 40000) for _ in range(40)]
    sampling = dict(temperature=1.0, top_p=0.9, seed=5, max_tokens=8)
    expected = [o.text for o in offline.generate([prompt], SamplingParams(n=3, **sampling), use_tqdm=False)]
    full = client.completions.create(model="tiny", prompt=prompt, n=3, **sampling)
    assert [c.index for c in full.choices] == [0, 1, 2]
    assert [c.text for c in full.choices] == expected
    assert full.usage.prompt_tokens == 40 and full.usage.completion_tokens == 3 * 8
    streamed = ["", "", ""]
    stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], n=3,
                                            stream=True, **sampling)
    for chunk in stream:
        for choice in chunk.choices:
            streamed[choice.index] += choice.delta.content or ""
    chat_full = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], n=3,
                                               **sampling)
    assert streamed == [c.message.content for c in chat_full.choices]
    assert len(set(streamed)) > 1, "three seeds, three draws"


def test_disconnected_streams_are_aborted_and_free_their_blocks(server):
    async def drop_after_two_chunks(client: httpx.AsyncClient, i: int):
        body = {"model": "tiny", "prompt": [1000 + i] * 30, "max_tokens": 400, "temperature": 0,
                "ignore_eos": True, "stream": True}
        async with client.stream("POST", f"{server}/v1/completions", json=body,
                                 headers={"Authorization": f"Bearer {API_KEY}"}) as response:
            seen = 0
            async for line in response.aiter_lines():
                seen += line.startswith("data:")
                if seen == 2:
                    return  # leaving the block closes the connection mid-stream

    async def drop_all():
        async with httpx.AsyncClient(timeout=60) as client:
            await asyncio.gather(*(drop_after_two_chunks(client, i) for i in range(20)))

    asyncio.run(drop_all())
    deadline = time.monotonic() + 20
    while _metric(server, "num_requests_running") or _metric(server, "kv_cache_usage_perc"):
        assert time.monotonic() < deadline, "aborted requests still hold the batch or KV blocks"
        time.sleep(0.2)


def _post(base: str, path: str, body, key: str | None = API_KEY, **kwargs) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"} if key else {}
    content = json.dumps(body, separators=(",", ":"))
    return httpx.post(f"{base}{path}", content=content, headers=headers, timeout=30, **kwargs)


def _assert_error(response: httpx.Response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param:
        assert error["param"] == param
    assert "Traceback" not in response.text
    return error


@pytest.mark.parametrize(("body", "param"), [
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "hi", "temperature": -1}, "temperature"),
    ({"prompt": "hi", "top_p": 1.5}, "top_p"),
    ({"prompt": "hi", "n": 0}, "n"),
    ({"prompt": "hi", "n": 65}, "n"),
    ({"prompt": "hi", "logprobs": 21}, "logprobs"),
    ({"prompt": "hi", "bogus_field": 1}, "bogus_field"),
    ({"prompt": ""}, "prompt"),
    ({}, "prompt"),
])
def test_bad_parameters_get_400(server, body, param):
    _assert_error(_post(server, "/v1/completions", body), 400, param)


def test_prompt_over_the_limit_gets_400_with_both_numbers(server):
    error = _assert_error(_post(server, "/v1/completions", {"prompt": [1000] * 1500}), 400)
    assert "1500" in error["message"] and "1024" in error["message"]


def test_auth_model_and_body_size(server):
    _assert_error(_post(server, "/v1/completions", {"prompt": "hi"}, key=None), 401)
    _assert_error(_post(server, "/v1/completions", {"prompt": "hi"}, key="wrong"), 401)
    _assert_error(_post(server, "/v1/completions", {"prompt": "hi", "model": "nope"}), 404, "model")
    _assert_error(_post(server, "/v1/completions", {"prompt": "x" * 30000}), 413)
    assert httpx.get(f"{server}/health").status_code == 200


PROTECTED = [("GET", "/v1/models"), ("GET", "/v1/models/tiny"), ("POST", "/v1/completions"),
             ("POST", "/v1/chat/completions"), ("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/metrics"),
             ("GET", "/version"),
             ("GET", "/docs"), ("GET", "/redoc"), ("GET", "/openapi.json"), ("GET", "/no-such-route")]


@pytest.mark.parametrize(("method", "path"), PROTECTED)
def test_every_route_but_health_needs_the_key(server, method, path):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}, {"Authorization": "Basic x"}):
        response = httpx.request(method, f"{server}{path}", headers=headers, json={} if method == "POST" else None)
        error = _assert_error(response, 401)
        assert error["code"] == "invalid_api_key" and response.headers["www-authenticate"] == "Bearer"
    assert httpx.request(method, f"{server}{path}", headers=AUTH, json={}).status_code != 401


def test_metrics_can_be_left_open_by_a_flag(tiny_model_dir):
    with running_server(tiny_model_dir, "--num-kv-blocks", "64", "--api-key", API_KEY,
                        "--metrics-without-auth") as running:
        assert httpx.get(f"{running.base}/metrics").status_code == 200
        assert httpx.get(f"{running.base}/health").status_code == 200
        assert httpx.get(f"{running.base}/v1/models").status_code == 401


@pytest.mark.parametrize("how", ["flag", "environment"])
def test_an_empty_api_key_is_refused_at_start_up(tiny_model_dir, how):
    command = [sys.executable, "-m", "conveyor.entrypoints.cli", "serve", "--model", str(tiny_model_dir),
               "--port", str(free_port())]
    env = {k: v for k, v in os.environ.items() if k != "CONVEYOR_API_KEY"}
    if how == "flag":
        command += ["--api-key", ""]
    else:
        env["CONVEYOR_API_KEY"] = " "
    result = subprocess.run(command, capture_output=True, text=True, timeout=60, env=env)
    assert result.returncode == 2
    assert "empty" in result.stderr and "CONVEYOR_API_KEY" in result.stderr


def test_a_chunked_body_over_the_limit_gets_413(server):
    def chunks(total: int, size: int = 4096):
        body = json.dumps({"prompt": "x" * total}).encode()
        for start in range(0, len(body), size):
            yield body[start : start + size]

    response = httpx.post(f"{server}/v1/completions", content=chunks(30000), headers=AUTH, timeout=30)
    error = _assert_error(response, 413)
    assert error["code"] == "request_too_large" and "20000" in error["message"]
    small = httpx.post(f"{server}/v1/completions", content=chunks(100), timeout=30,
                       headers={**AUTH, "Content-Type": "application/json"})
    assert small.status_code == 200, small.text


@pytest.mark.parametrize(("body", "param"), [
    ({"prompt": "hi", "stop": [f"s{i}" for i in range(17)]}, "stop"),
    ({"prompt": "hi", "stop": "y" * 257}, "stop"),
    ({"prompt": "hi", "stop_token_ids": list(range(65))}, "stop_token_ids"),
    ({"prompt": [1000] * 1024}, "prompt"),
    ({"messages": [{"role": "user"}] * 1025}, "messages"),
])
def test_caps_on_per_request_work_get_400(server, body, param):
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    error = _assert_error(_post(server, path, body), 400, param)
    assert any(str(n) in error["message"] for n in (16, 256, 64, 1024)), error["message"]


def test_tokenize_detokenize_version(server):
    tokens = _post(server, "/tokenize", {"prompt": "Hello world"}).json()["tokens"]
    assert _post(server, "/detokenize", {"tokens": tokens}).json()["prompt"] == "Hello world"
    assert httpx.get(f"{server}/version", headers=AUTH).json()["version"]
    assert httpx.get(f"{server}/v1/models", headers={"Authorization": f"Bearer {API_KEY}"}).json()["data"][0][
        "id"] == "tiny"
    client = openai_client(server, API_KEY)
    assert client.models.retrieve("tiny").id == "tiny"  # GET /v1/models/{model}
    with pytest.raises(openai.NotFoundError, match="'nope' does not exist") as missing:
        client.models.retrieve("nope")
    assert missing.value.code == "model_not_found"


def test_overload_gets_503_with_retry_after(tiny_model_dir):
    with running_server(tiny_model_dir, "--num-kv-blocks", "256", "--max-num-seqs", "1",
                        "--max-waiting-requests", "2") as running:
        base = running.base

        async def fire():
            async with httpx.AsyncClient(timeout=120) as client:
                body = {"prompt": [1000] * 8, "max_tokens": 200, "ignore_eos": True}
                return await asyncio.gather(*(client.post(f"{base}/v1/completions", json=body) for _ in range(8)))

        responses = asyncio.run(fire())
        refused = [r for r in responses if r.status_code == 503]
        assert refused and all(r.headers.get("retry-after") for r in refused)
        _assert_error(refused[0], 503)
        assert all(r.status_code in (200, 503) for r in responses)


def test_sigterm_lets_streams_finish_or_end_them_with_an_error(tiny_model_dir):
    port = free_port()
    command = [sys.executable, "-m", "conveyor.entrypoints.cli", "serve", "--model", str(tiny_model_dir),
               "--port", str(port), "--num-kv-blocks", "512", "--shutdown-timeout", "0.2"]  # 1000 tokens: 0.7 s
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        assert process.poll() is None, process.stdout.read()
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                break
        assert time.monotonic() < deadline
        time.sleep(0.3)

    async def stream(client: httpx.AsyncClient, max_tokens: int, started: asyncio.Semaphore) -> list[str]:
        body = {"prompt": [1000] * 4, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
        events = []
        async with client.stream("POST", f"{base}/v1/completions", json=body) as response:
            async for line in response.aiter_lines():
                if line.startswith("data:"):
                    events.append(line[5:].strip())
                    if len(events) == 1:
                        started.release()
        return events

    async def run():
        started = asyncio.Semaphore(0)
        async with httpx.AsyncClient(timeout=120) as client:
            tasks = [asyncio.create_task(stream(client, n, started)) for n in (5, 1000, 1000)]
            for _ in tasks:  # every stream is under way (a request arriving after SIGTERM gets a 503)
                await started.acquire()
            process.send_signal(signal.SIGTERM)
            return await asyncio.gather(*tasks)

    results = asyncio.run(run())
    assert process.wait(timeout=60) == 0
    for events in results:
        assert events[-1] == "[DONE]"
        last = events[-2]
        assert '"finish_reason": "length"' in last or '"error"' in last, last
    assert any('"error"' in events[-2] for events in results), "the 1000-token streams outlast the 0.2 s timeout"
    assert '"finish_reason": "length"' in results[0][-2], "a short stream finishes normally"


def test_bench_serve_measures_a_running_server(server, tmp_path, capsys):
    from conveyor.entrypoints.cli import main

    out = tmp_path / "serve.json"
    code = main(["bench", "serve", "--base-url", server, "--api-key", API_KEY, "--num-prompts", "6",
                 "--request-rate", "20", "--output-len", "2,10", "--slo-ttft", "60", "--json", str(out)])
    assert code == 0
    result = json.loads(out.read_text())
    assert result["completed"] == 6 and result["failed"] == 0
    assert 0 < result["ttft_p50_s"] <= result["e2e_p50_s"] and result["goodput_requests_per_s"] > 0
    assert "itl_p99_s" in capsys.readouterr().out


def test_bench_serve_shared_prefix_counts_the_servers_cached_tokens(server, tmp_path):
    from conveyor.entrypoints.cli import main

    out = tmp_path / "shared.json"
    code = main(["bench", "serve", "--base-url", server, "--api-key", API_KEY, "--workload", "shared-prefix",
                 "--num-prompts", "12", "--request-rate", "20", "--output-len", "2,2", "--json", str(out)])
    assert code == 0
    result = json.loads(out.read_text())
    assert result["completed"] == 12 and result["workload"] == "shared-prefix"
    assert 0 < result["prompt_tokens_cached"] < result["prompt_tokens"], "later requests reuse the 8 prefixes"
