"""The server stays responsive to everyone: a client that leaves frees its place at once, and one huge prompt
does not hold up the others' tokens. A real server process, a real client, loopback.
"""

from __future__ import annotations

import asyncio
import itertools
import statistics
import time

import httpx

from tests.serving import ledger, metric, running_server, wait_until_idle

LONG = {"prompt": [1000, 1001, 1002, 1003], "max_tokens": 1000, "temperature": 0, "ignore_eos": True}


async def until(condition, timeout: float = 60) -> float:
    """Poll ``condition`` (a sync callable) until it holds; the seconds it took."""
    start = time.monotonic()
    while not await asyncio.to_thread(condition):
        assert time.monotonic() - start < timeout, "condition not met in time"
        await asyncio.sleep(0.02)
    return time.monotonic() - start


def test_a_client_that_leaves_aborts_its_request_queued_or_running_streamed_or_not(tiny_model_dir):
    """One seat (max_num_seqs 1) and three long requests in line: the unstreamed one that holds the seat, then a
    streamed request that leaves while queued (before its first token) and an unstreamed one that leaves while
    queued, all leave the engine at once, not when they would have finished. The running one is cancelled first,
    while it is surely running (the tiny model draws its 1,000 tokens in a few seconds); the two after it queue
    behind the next holders, which hold the seat for 2,000 tokens more."""
    with running_server(tiny_model_dir, "--num-kv-blocks", "256", "--max-num-seqs", "1") as server:

        def waiting(n: int):
            return lambda: metric(server, "conveyor:num_requests_waiting") == n

        async def main() -> dict[str, float]:
            took = {}
            async with httpx.AsyncClient(timeout=300) as client:
                url = f"{server.base}/v1/completions"
                holders = [asyncio.create_task(client.post(url, json=LONG)) for _ in range(3)]
                await until(lambda: metric(server, "conveyor:num_requests_running") == 1 and waiting(2)())
                tokens = metric(server, "conveyor:generation_tokens_total")
                holders[0].cancel()  # the running one: the next in line takes the seat
                took["running unstreamed"] = await until(waiting(1))
                assert tokens < 1000, "the first holder was still running when it left"
                assert ledger(server)["aborted"] == 1
                async with client.stream("POST", url, json={**LONG, "stream": True}) as response:
                    assert response.status_code == 200  # the headers come at once; the tokens would follow
                    await until(waiting(2))
                took["queued stream"] = await until(waiting(1))  # closing the response aborted it
                unstreamed = asyncio.create_task(client.post(url, json=LONG))
                await until(waiting(2))
                unstreamed.cancel()
                took["queued unstreamed"] = await until(waiting(1))
                assert ledger(server)["aborted"] == 3
                for task in holders[1:]:
                    task.cancel()
            return took

        took = asyncio.run(main())
        values = wait_until_idle(server)
        books = ledger(server)
        # The two holders behind the first only keep the seat busy: on a slow machine one may finish first.
        assert books["aborted"] + books["finished"] == 5 and books["aborted"] >= 4
        assert books["errored"] == books["open"] == 0
        assert values["conveyor:kv_cache_usage_perc"] == 0
        print(f"\naborted after the client left, in seconds: {took}")


def test_a_1_mib_prompt_does_not_hold_up_a_concurrent_stream(tiny_model_dir):
    """While a 1 MiB prompt is parsed and tokenized (off the event loop), a running stream's tokens keep coming:
    the longest gap between two of them then is compared with the stream's usual gap."""
    with running_server(tiny_model_dir, "--num-kv-blocks", "256", "--max-request-bytes", str(4 << 20)) as server:
        huge = "All work and no play makes Jack a dull boy. " * ((1 << 20) // 44 + 1)

        async def main():
            arrivals: list[float] = []
            window: list[float] = []
            async with httpx.AsyncClient(timeout=300) as client:
                url = f"{server.base}/v1/completions"

                async def stream():
                    async with client.stream("POST", url, json={**LONG, "stream": True}) as response:
                        async for line in response.aiter_lines():
                            if line.startswith("data:"):
                                arrivals.append(time.monotonic())

                reader = asyncio.create_task(stream())
                while len(arrivals) < 100:
                    await asyncio.sleep(0.01)
                window.append(time.monotonic())
                refused = await client.post(url, json={"prompt": huge, "max_tokens": 1})
                window.append(time.monotonic())
                await reader
            return arrivals, window, refused

        arrivals, (start, end), refused = asyncio.run(main())
        assert refused.status_code == 400 and "max_model_len" in refused.json()["error"]["message"]
        gaps = [b - a for a, b in itertools.pairwise(arrivals)]
        before = [b - a for a, b in itertools.pairwise(arrivals) if b < start]
        during = [b - a for a, b in itertools.pairwise(arrivals) if a < end and b > start]
        usual = statistics.median(before)
        print(f"\n1 MiB prompt refused after {end - start:.3f} s; inter-token gap of the concurrent stream: median "
              f"{usual * 1000:.1f} ms before, longest {max(during) * 1000:.1f} ms while the prompt was handled, "
              f"p99 over the stream {sorted(gaps)[int(0.99 * len(gaps))] * 1000:.1f} ms")
        assert len(during) >= 2, "the stream kept going while the prompt was handled"
        # Tokenizing it on the event loop stopped the stream for the whole tokenization (about a second, most of the
        # time the prompt took to refuse). Off the loop, the stream may still lose a beat to the other processes of
        # a loaded 2-core machine (a parallel test worker: 0.24 s of 2.1 s seen), never most of the handling.
        assert max(during) < max(5 * usual, 0.1, 0.25 * (end - start)), (max(during), usual, end - start)
