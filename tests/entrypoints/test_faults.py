"""Fault containment: a step that raises fails its own requests, nobody else's; a loop that dies fails them all.

The faults are real: ``CONVEYOR_FAULT_INJECTION`` (``conveyor/executor/faults.py``) makes the real executor
raise on the step that computes a marked prompt, or on every step from then on (a device that is gone). The
engine, the scheduler and the server are the real ones, and the server tests run it as a process on a
loopback port. Throughout, every request ends exactly once, as finished, aborted or errored, and the
ledger of the server says so.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import re
import time

import httpx
import pytest

from conveyor import LLM, SamplingParams
from conveyor.core.engine_core import MAX_CONSECUTIVE_FAILED_STEPS
from conveyor.core.request import FinishReason
from conveyor.engine import AsyncEngine, EngineDead, RequestFailed
from conveyor.executor.faults import ENV
from tests.serving import ledger, metric, running_server, wait_until_idle

POISON = 7777  # a token id no other prompt here holds
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
STEP_IN_MESSAGE = re.compile(r"step (\d+)")


def prompts(count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1000, 7000) for _ in range(rng.randrange(3, 40))] for _ in range(count)]


@pytest.fixture(scope="module")
def reference(tiny_model_dir) -> LLM:
    return LLM(str(tiny_model_dir), num_kv_blocks=256)


# ----- the engine, offline --------------------------------------------------------


@pytest.mark.parametrize("max_num_seqs", [1, 8])
def test_a_failed_step_ends_its_requests_and_the_others_finish_unchanged(
    tiny_model_dir, reference, monkeypatch, max_num_seqs
):
    monkeypatch.setenv(ENV, f"step:{POISON}")
    llm = LLM(str(tiny_model_dir), num_kv_blocks=256, max_num_seqs=max_num_seqs)
    good = prompts(12)
    batch = [*good[:5], [POISON, 1001, 1002], *good[5:]]
    outputs = llm.generate(batch, GREEDY, use_tqdm=False)
    expected = reference.generate(good, GREEDY, use_tqdm=False)
    poisoned = outputs.pop(5)
    assert poisoned.finish_reason == FinishReason.ERROR and "step" in poisoned.error
    assert "Traceback" not in poisoned.error and "InjectedFault" in poisoned.error
    failed = [o for o in outputs if o.error is not None]
    steps = {STEP_IN_MESSAGE.search(o.error).group(1) for o in [poisoned, *failed]}
    assert len(steps) == 1, "only the requests of one step fail"
    assert len(failed) < max_num_seqs, "no more than the step held"
    for output, reference_output in zip(outputs, expected):
        if output.error is None:
            assert output.token_ids == reference_output.token_ids
    if max_num_seqs == 1:
        assert not failed, "the poisoned step held nobody else"
    stats = llm.engine.stats()
    assert stats.num_failed_steps == 1 and stats.num_free_kv_blocks == stats.num_kv_blocks
    again = llm.generate(good[:3], GREEDY, use_tqdm=False)
    assert [o.token_ids for o in again] == [o.token_ids for o in expected[:3]], "the engine serves on"


def test_a_failed_request_with_n_sequences_ends_whole(tiny_model_dir, monkeypatch):
    monkeypatch.setenv(ENV, f"step:{POISON}")
    llm = LLM(str(tiny_model_dir), num_kv_blocks=256)
    outputs = llm.generate([[POISON, 1500, 1501, 1502]], SamplingParams(n=3, max_tokens=5), use_tqdm=False)
    assert [o.index for o in outputs] == [0, 1, 2]
    assert all(o.finish_reason == "error" and o.error for o in outputs)
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.stats().num_free_kv_blocks == llm.engine.stats().num_kv_blocks


# ----- the async engine: the every-request-ends invariant ----------------------------


async def consume(engine: AsyncEngine, request, leave_after: int | None) -> str:
    """Read a request to its end; how it ended, as its caller saw it."""
    stream = engine.submit(request)
    seen = 0
    try:
        async for _ in stream:  # the stream stops after its last sequence's final output
            seen += 1
            if leave_after is not None and seen >= leave_after and not stream.done:
                return "aborted"
        return "finished"
    except RequestFailed:
        return "errored"
    except EngineDead:
        return "errored"
    finally:
        stream.close()


def run_async(engine: AsyncEngine, jobs) -> list[str]:
    async def main():
        return await asyncio.gather(*(consume(engine, request, leave) for request, leave in jobs))

    return asyncio.run(main())


def test_every_request_ends_exactly_once_in_the_ledger(tiny_model_dir, monkeypatch):
    monkeypatch.setenv(ENV, f"step:{POISON}")
    llm = LLM(str(tiny_model_dir), num_kv_blocks=256, max_num_seqs=4)
    engine = AsyncEngine(llm.engine)
    engine.start()
    try:
        rng = random.Random(3)
        jobs = []
        for i, prompt in enumerate(prompts(40, seed=1)):
            if i % 9 == 4:
                prompt = [POISON, *prompt]
            params = SamplingParams(temperature=0.0, max_tokens=rng.randrange(1, 20), ignore_eos=True,
                                    n=rng.choice([1, 1, 2]), seed=i)
            request = llm.engine.make_request(prompt, params, request_id=f"r{i}")
            jobs.append((request, rng.choice([None, None, None, 1, 3])))
        seen = run_async(engine, jobs)
        counts = engine.request_counts()
        assert counts.open == 0 and counts.submitted == len(jobs)
        assert counts.finished + counts.aborted + counts.errored == counts.submitted
        # The ledger and the callers agree, but for callers that left: their abort reaches the loop thread
        # between steps, and a request can finish (after its last token) or fail with its step before then.
        assert counts.errored >= seen.count("errored") > 0
        assert counts.finished >= seen.count("finished") and counts.aborted <= seen.count("aborted")
        for _ in range(200):  # aborts reach the loop thread between its steps
            if not engine.stats().num_unfinished:
                break
            time.sleep(0.05)
        stats = engine.stats()
        assert stats.num_unfinished == 0 and stats.kv_usage == 0
    finally:
        engine.stop()


def test_a_dead_loop_fails_every_open_request_and_refuses_new_ones(tiny_model_dir, monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    llm = LLM(str(tiny_model_dir), num_kv_blocks=256, max_num_seqs=2)
    fatal = []
    engine = AsyncEngine(llm.engine, on_fatal=fatal.append)
    steps = {"n": 0}
    schedule = llm.engine.core.scheduler.schedule

    def failing_schedule():  # a bug in the core itself: the loop cannot know what state it left
        steps["n"] += 1
        if steps["n"] == 5:
            raise RuntimeError("scheduler bug")
        return schedule()

    llm.engine.core.scheduler.schedule = failing_schedule
    engine.start()
    try:
        jobs = [(llm.engine.make_request(p, SamplingParams(max_tokens=50, ignore_eos=True)), None)
                for p in prompts(6, seed=2)]
        assert run_async(engine, jobs) == ["errored"] * 6
        for _ in range(100):  # on_fatal comes from the loop thread just after it failed the requests
            if fatal:
                break
            time.sleep(0.05)
        assert len(fatal) == 1 and isinstance(fatal[0], RuntimeError)
        counts = engine.request_counts()
        assert counts.errored == counts.submitted == 6 and counts.open == 0

        async def late():
            engine.submit(llm.engine.make_request([1000, 1001], SamplingParams(max_tokens=2)))

        with pytest.raises(EngineDead):
            asyncio.run(late())
    finally:
        engine.stop()


# ----- the server, as a process ----------------------------------------------------


async def ask(client: httpx.AsyncClient, base: str, prompt: list[int], stream: bool, max_tokens: int = 12,
              priority: int = 0) -> dict:
    """One completion; its text, or the error it ended with (an error event, or an error status)."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": stream,
            "priority": priority}
    if not stream:
        response = await client.post(f"{base}/v1/completions", json=body)
        payload = response.json()
        if "error" in payload:
            return {"status": response.status_code, "error": payload["error"]}
        return {"status": response.status_code, "text": payload["choices"][0]["text"]}
    text, result = "", {}
    async with client.stream("POST", f"{base}/v1/completions", json=body) as response:
        result["status"] = response.status_code
        async for line in response.aiter_lines():
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            event = json.loads(line[5:])
            if "error" in event:
                result["error"] = event["error"]
            else:
                text += event["choices"][0]["text"]
                result.setdefault("first_token", True)
    result["text"] = text
    return result


def test_server_contains_a_failed_step(tiny_model_dir, reference):
    with running_server(tiny_model_dir, "--num-kv-blocks", "256", "--max-num-seqs", "4",
                        env={ENV: f"step:{POISON}"}) as server:
        good = prompts(12, seed=4)
        poison = [POISON, 1200, 1201]

        async def main():
            async with httpx.AsyncClient(timeout=120) as client:
                tasks = [ask(client, server.base, p, stream=i % 2 == 0) for i, p in enumerate(good[:6])]
                tasks.append(ask(client, server.base, poison, stream=True))
                tasks += [ask(client, server.base, p, stream=i % 2 == 1) for i, p in enumerate(good[6:])]
                return await asyncio.gather(*tasks)

        results = asyncio.run(main())
        poisoned = results.pop(6)
        expected = [o.text for o in reference.generate(good, GREEDY, use_tqdm=False)]
        assert poisoned["status"] == 200 and poisoned["error"]["type"] == "internal_server_error"
        assert "Traceback" not in json.dumps(poisoned) and "step" in poisoned["error"]["message"]
        failed = [r for r in results if "error" in r]
        steps = {STEP_IN_MESSAGE.search(r["error"]["message"]).group(1) for r in [poisoned, *failed]}
        assert len(steps) == 1 and len(failed) <= 3, "only the poisoned step's requests fail"
        for result, text in zip(results, expected):
            if "error" not in result:
                assert result["text"] == text
        values = wait_until_idle(server)
        assert values["conveyor:num_failed_steps_total"] == 1
        books = ledger(server)
        assert books["errored"] == 1 + len(failed) and books["open"] == 0
        assert books["submitted"] == books["finished"] + books["aborted"] + books["errored"]

        async def after():
            async with httpx.AsyncClient(timeout=60) as client:
                return await asyncio.gather(*(ask(client, server.base, p, stream=False) for p in good[:4]))

        assert [r["text"] for r in asyncio.run(after())] == expected[:4], "the server serves on"
        assert metric(server, "conveyor:kv_cache_usage_perc") == 0


def test_server_exits_non_zero_when_the_loop_dies_and_every_open_client_gets_an_error(tiny_model_dir):
    """From the poisoned step on every step fails (the device is gone): after a few in a row the loop gives up,
    every open request gets an error event, /health says 503 and the process exits 1 for its supervisor."""
    with running_server(tiny_model_dir, "--num-kv-blocks", "256", "--max-num-seqs", "2", "--scheduling-policy",
                        "priority", env={ENV: f"device:{POISON}"}) as server:

        async def main():
            async with httpx.AsyncClient(timeout=120) as client:
                first = [asyncio.create_task(ask(client, server.base, p, True, max_tokens=900)) for p in prompts(2)]
                while metric(server, "conveyor:num_requests_running") < 2:
                    await asyncio.sleep(0.05)
                queued = [asyncio.create_task(ask(client, server.base, p, True, max_tokens=900))
                          for p in prompts(6, seed=9)]
                while metric(server, "conveyor:num_requests_waiting") < 6:
                    await asyncio.sleep(0.05)
                # Ahead of the queue (priority), so that it runs at once: its step is the first to fail.
                poisoned = await ask(client, server.base, [POISON, 1300], True, priority=-1)
                return await asyncio.gather(*first, *queued), poisoned

        results, poisoned = asyncio.run(main())
        assert "error" in poisoned
        assert all(r["status"] == 200 and "error" in r for r in results), results
        kinds = {r["error"]["code"] for r in results}
        assert kinds == {"engine_error", "engine_unavailable"}, "failed steps, then the sweep of the rest"
        assert all("Traceback" not in json.dumps(r) for r in results)
        # Every error event was sent after the engine was marked dead: /health can only say 503 now, or the
        # port is already closed.
        with contextlib.suppress(httpx.TransportError):
            assert httpx.get(f"{server.base}/health", timeout=5).status_code == 503
        assert server.process.wait(timeout=60) == 1
    assert MAX_CONSECUTIVE_FAILED_STEPS == 3
