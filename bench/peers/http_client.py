"""The one HTTP client every served engine is timed through: Conveyor's own server and llama.cpp's alike.

A comparison is only fair through the same door: each engine runs as its own
server process, on the same threads, and gets the same requests from this
client (token-id prompts, greedy, exactly ``output_len`` tokens, not streamed:
the client sleeps while the engines compute), so its figures include what a
user meets: the HTTP layer, the server's threads, its event loop. Latency is
the client's; time to first token is that less the server's own account of
its output's time (``timings.predicted_ms``, first token to last, which both
servers report under llama.cpp's name). Not streamed because llama.cpp's stream
leaves out the token ids of a token that ends inside a UTF-8 character.
Runs in the project's .venv (httpx).
"""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import peer_io

START_TIMEOUT_S = 300  # loading a multi-GB file on a loaded 2-core machine can take minutes


@dataclass(frozen=True, slots=True)
class Endpoint:
    """How one engine's server is asked for a completion: its URL, the body of a request, and the output token
    ids in its answer."""

    url: str
    body: Callable[[peer_io.Request], dict[str, Any]]
    tokens_of: Callable[[dict[str, Any]], list[int]]
    # Read the answer as server-sent events, its last event the whole answer's account: for a server that fails
    # a whole answer holding text that is not UTF-8 (ik_llama.cpp on random weights), never for the default.
    streamed: bool = False

    def record(self, answer: dict[str, Any], latency_s: float) -> peer_io.Record:
        """A request's record from its answer: time to first token is the latency less the output's time."""
        ttft = latency_s - answer["timings"]["predicted_ms"] / 1000
        return peer_io.record(self.tokens_of(answer), max(ttft, 0.0), latency_s)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(command: Sequence[str], health_url: str, log: Path, name: str,
                 cwd: Path | None = None) -> subprocess.Popen:
    """Start a server in ``cwd`` (where it leaves any file of its own; None: here), its output to ``log``, and
    wait until ``health_url`` answers 200 (model loaded)."""
    with log.open("w") as out:
        server = subprocess.Popen(list(command), stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                  cwd=cwd)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"{name} exited with {server.returncode}; see {log}")
        try:
            if httpx.get(health_url, timeout=5).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    server.terminate()
    raise RuntimeError(f"{name} did not become healthy in {START_TIMEOUT_S} s; see {log}")


def stop_server(server: subprocess.Popen) -> None:
    server.terminate()
    try:
        server.wait(timeout=60)
    except subprocess.TimeoutExpired:
        server.kill()


async def _one(client: httpx.AsyncClient, endpoint: Endpoint, request: peer_io.Request) -> peer_io.Record:
    start = time.perf_counter()
    if endpoint.streamed:
        answer = await _last_event(client, endpoint, endpoint.body(request) | {"stream": True})
        return endpoint.record(answer, time.perf_counter() - start)
    response = await client.post(endpoint.url, json=endpoint.body(request))
    if response.status_code != 200:
        raise RuntimeError(f"{endpoint.url} answered {response.status_code}: {response.text[:300]}")
    return endpoint.record(response.json(), time.perf_counter() - start)


async def _last_event(client: httpx.AsyncClient, endpoint: Endpoint, body: dict[str, Any]) -> dict[str, Any]:
    """The last ``data:`` event of a streamed answer (llama-server's holds its timings and token count)."""
    last: dict[str, Any] | None = None
    async with client.stream("POST", endpoint.url, json=body) as response:
        if response.status_code != 200:
            await response.aread()
            raise RuntimeError(f"{endpoint.url} answered {response.status_code}: {response.text[:300]}")
        async for line in response.aiter_lines():
            if line.startswith("data:") and line[5:].strip() not in ("", "[DONE]"):
                last = json.loads(line[5:])
    if last is None:
        raise RuntimeError(f"{endpoint.url} streamed no event")
    return last


async def _all(endpoint: Endpoint, requests: list[peer_io.Request]) -> list[peer_io.Record]:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None), limits=limits) as client:
        return list(await asyncio.gather(*(_one(client, endpoint, r) for r in requests)))


def run_together(endpoint: Endpoint) -> peer_io.RunTogether:
    """peer_io's runner over ``endpoint``: a workload's requests sent at once, each answered whole."""
    return lambda requests: asyncio.run(_all(endpoint, requests))
