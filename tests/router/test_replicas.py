"""Two engine replicas on a local Ray behind the router, as a real server process driven by real clients:
outputs equal one engine's, aborts reach the replicas, and a killed replica loses no request."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx
import pytest

from conveyor.entrypoints.cli import main
from tests.serving import offline_text, openai_client, running_server

pytest.importorskip("ray", reason="the replica tests need the ray extra: pip install 'conveyor[ray]'")

MAX_NUM_SEQS = 2  # so that some requests wait in a replica's queue, without output, when it is killed


@contextlib.contextmanager
def replica_server(model_dir, *flags: str) -> Iterator[str]:
    """The server with two replicas of one thread each, as a real process (see ``tests/serving.py``)."""
    with running_server(model_dir, "--data-parallel-size", "2", "--num-threads", "1", *flags) as server:
        yield server.base


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with replica_server(tiny_model_dir, "--num-kv-blocks", "1024", "--served-model-name", "tiny",
                        "--max-num-seqs", str(MAX_NUM_SEQS), "--router-policy", "cache-aware") as base:
        yield base


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server, "none")


def _health(server: str) -> dict:
    return httpx.get(f"{server}/health", timeout=5).json()


def test_health_and_metrics_report_each_replica(server):
    health = _health(server)
    assert [r["replica"] for r in health["replicas"]] == [0, 1]
    assert all(r["healthy"] and r["pid"] for r in health["replicas"])
    assert health["router_policy"] == "cache-aware"
    metrics = httpx.get(f"{server}/metrics", timeout=5).text
    for replica in ("0", "1"):
        assert f'conveyor:replica_healthy{{model_name="tiny",replica="{replica}"}} 1.0' in metrics


def test_completions_streamed_and_not_equal_one_engine(client, offline):
    for prompt in ("The quick brown fox", "Once upon a time", "In 1492"):
        full = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0)
        chunks = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0, stream=True)
        streamed = "".join(chunk.choices[0].text for chunk in chunks)
        assert full.choices[0].text == streamed == offline_text(offline, prompt, 12)


def test_chat_streamed_and_not_equal_one_engine(client, offline):
    messages = [{"role": "user", "content": "Name three rivers."}]
    full = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0)
    stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0,
                                            stream=True)
    parts = [chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices]
    prompt_ids = offline.tokenizer.apply_chat_template(messages)
    assert full.choices[0].message.content == "".join(parts) == offline_text(offline, prompt_ids, 10)


def test_cache_aware_sends_a_repeated_prefix_where_it_is_cached(client):
    system = "You are a careful assistant who answers in one short sentence. " * 4
    for question in ("What is the capital of Peru?", "What is the tallest mountain?", "Who wrote Hamlet?"):
        first = client.completions.create(model="tiny", prompt=system + question, max_tokens=2, temperature=0)
        again = client.completions.create(model="tiny", prompt=system + question + " Be brief.", max_tokens=2,
                                          temperature=0)
        cached = again.usage.prompt_tokens_details.cached_tokens
        assert cached >= first.usage.prompt_tokens - 16, "the repeat went to a replica without its prefix"


def test_disconnected_streams_are_aborted_on_their_replicas(server):
    async def drop_after_two_chunks(http: httpx.AsyncClient, i: int) -> None:
        body = {"model": "tiny", "prompt": [1000 + i] * 30, "max_tokens": 400, "temperature": 0,
                "ignore_eos": True, "stream": True}
        async with http.stream("POST", f"{server}/v1/completions", json=body) as response:
            seen = 0
            async for line in response.aiter_lines():
                seen += line.startswith("data:")
                if seen == 2:
                    return  # leaving the block closes the connection mid-stream

    async def drop_all() -> None:
        async with httpx.AsyncClient(timeout=60) as http:
            await asyncio.gather(*(drop_after_two_chunks(http, i) for i in range(6)))

    asyncio.run(drop_all())
    deadline = time.monotonic() + 30
    while any(r["num_requests_running"] or r["num_requests_waiting"] for r in _health(server)["replicas"]):
        assert time.monotonic() < deadline, "aborted requests still run on a replica"
        time.sleep(0.3)


def test_bench_serve_multi_turn_chats_find_their_history_cached(server, tmp_path):
    out = tmp_path / "multi-turn.json"
    code = main(["bench", "serve", "--base-url", server, "--workload", "multi-turn", "--num-prompts", "4",
                 "--num-turns", "3", "--output-len", "1,8", "--json", str(out)])
    result = json.loads(out.read_text())
    assert code == 0 and result["completed"] == 4 * 3 and result["failed"] == 0
    # Turns 2 and 3 resend their history; cache-aware routing sends each to the replica that holds it.
    assert result["prefix_cache_hit_rate"] > 0.4


@dataclass
class _Outcome:
    text: str = ""
    chunks: int = 0
    finish_reason: str | None = None
    error: str | None = None
    done: bool = False
    first_chunk: asyncio.Event = field(default_factory=asyncio.Event)


async def _stream(http: httpx.AsyncClient, server: str, prompt: list[int], max_tokens: int) -> _Outcome:
    outcome = _Outcome()
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    async with http.stream("POST", f"{server}/v1/completions", json=body) as response:
        if response.status_code != 200:
            outcome.error, outcome.done = f"HTTP {response.status_code}", True
            return outcome
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                outcome.done = True
                break
            event = json.loads(line[6:])
            if "error" in event:
                outcome.error = event["error"]["message"]
                continue
            outcome.chunks += 1
            outcome.first_chunk.set()
            outcome.text += event["choices"][0]["text"]
            outcome.finish_reason = event["choices"][0]["finish_reason"] or outcome.finish_reason
    return outcome


OUTPUT_LEN = 600  # of each request the kill test sends (prompts of 24 tokens; the tiny model's context is 1024)


def test_a_killed_replica_loses_no_request_and_comes_back(server, offline):
    """Kill replica 0's process while its requests run and wait: each request finishes (retried elsewhere if it
    had no output) or ends with an error event; the replica restarts and serves again."""
    victim = _health(server)["replicas"][0]
    prompts = [[3000 + i] * 24 for i in range(8)]

    async def run() -> tuple[list[_Outcome], float]:
        async with httpx.AsyncClient(timeout=120) as http:
            # Long enough that replica 0's requests are still running when its health first shows them: with
            # 200 tokens a fast machine finished them within the half second this waited before looking.
            tasks = [asyncio.create_task(_stream(http, server, prompt, OUTPUT_LEN)) for prompt in prompts]
            deadline = time.monotonic() + 60
            while not any(_running_on(server, 0)):
                assert time.monotonic() < deadline, "no request ran on replica 0 within a minute"
                await asyncio.sleep(0.05)
            os.kill(victim["pid"], signal.SIGKILL)
            killed_at = time.monotonic()
            return list(await asyncio.wait_for(asyncio.gather(*tasks), timeout=120)), killed_at

    outcomes, killed_at = asyncio.run(run())
    errored = [o for o in outcomes if o.error]
    finished = [o for o in outcomes if not o.error]
    assert all(o.done for o in outcomes), "a stream ended without [DONE]"
    assert all(o.finish_reason == "length" for o in finished)
    for prompt, outcome in zip(prompts, outcomes):
        if not outcome.error:
            assert outcome.text == offline_text(offline, prompt, OUTPUT_LEN, ignore_eos=True)
    failover = _health(server)["failover"]
    assert failover["errored"] == len(errored) and failover["unplaced"] == 0
    assert failover["retried"] + failover["errored"] >= 1, "the kill touched no request"

    deadline = time.monotonic() + 120
    while not (replica := _health(server)["replicas"][0])["healthy"] or replica["restarts"] < 1:
        assert time.monotonic() < deadline, "the killed replica did not come back"
        time.sleep(0.5)
    back_after = time.monotonic() - killed_at
    assert replica["pid"] != victim["pid"]
    print(f"\nfailover: {len(prompts)} requests in flight, {failover['retried']} retried, {len(errored)} errored "
          f"mid-stream, 0 lost; replica 0 serving again {back_after:.1f} s after the kill "
          f"(down to healthy as the router saw it: {replica['last_recovery_s']:.1f} s)")

    async def later() -> list[_Outcome]:
        async with httpx.AsyncClient(timeout=120) as http:
            return list(await asyncio.gather(*(_stream(http, server, [4000 + i] * 24, 16) for i in range(4))))

    assert all(o.done and not o.error and o.finish_reason == "length" for o in asyncio.run(later()))
    routed = httpx.get(f"{server}/metrics", timeout=5).text
    assert 'conveyor:replica_restarts_total{model_name="tiny",replica="0"} 1.0' in routed


def _running_on(server: str, replica: int) -> list[int]:
    state = _health(server)["replicas"][replica]
    return [state["num_requests_running"] or 0]
