"""llama.cpp's ``llama-server`` (64 slots, ``--threads`` threads, continuous batching) driven over HTTP.

``--gguf`` picks the file: ``f32`` (the default model dequantized, what the float32 engines run), ``q4_1`` (the
default model's own Q4_1 file, as shipped), ``q8_0`` (that file requantized by llama-quantize) or
``gemma3-270m`` (Gemma 3 270M's Q4_K_M file, as its package ships it: ``conveyor bench compare --model
gemma3-270m`` runs Conveyor on the same file).

The runner starts the server, sends each request to ``/completion`` with a
token-id prompt (all of a workload's requests concurrently, or one after
another), and stops the server. Runs in the project's .venv (httpx).
"""

from __future__ import annotations

import asyncio
import re
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import peer_io

DIR = peer_io.PEERS / "llama.cpp"
SERVER = DIR / "build" / "bin" / "llama-server"
SDIST_VERSION = "0.3.36"  # the llama-cpp-python sdist whose vendored llama.cpp setup_llamacpp.sh builds
SERVER_ARGS = ("-np", "64", "-c", "65536", "-cb", "--no-ui")


def completion_body(request: peer_io.Request) -> dict[str, Any]:
    """Greedy, exactly ``output_len`` tokens, no prompt cache (every engine computes every prompt)."""
    return {
        "prompt": request["prompt_token_ids"],
        "n_predict": request["output_len"],
        "ignore_eos": True,
        "temperature": 0.0,
        "cache_prompt": False,
        "return_tokens": True,
        "stream": False,
    }


def parse_completion(body: dict[str, Any], latency_s: float) -> peer_io.Record:
    """The response's token ids; time to first token is the latency less the server's own decode time
    (``timings.predicted_ms`` runs from the first sampled token to the last), since streamed chunks may
    hold back a token that ends inside a UTF-8 character."""
    ttft = latency_s - body["timings"]["predicted_ms"] / 1000
    return peer_io.record(body["tokens"], max(ttft, 0.0), latency_s)


async def _one(client: httpx.AsyncClient, url: str, request: peer_io.Request) -> peer_io.Record:
    start = time.perf_counter()
    response = await client.post(url, json=completion_body(request))
    response.raise_for_status()
    return parse_completion(response.json(), time.perf_counter() - start)


async def _all(url: str, requests: list[peer_io.Request]) -> list[peer_io.Record]:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None), limits=limits) as client:
        return list(await asyncio.gather(*(_one(client, url, r) for r in requests)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str, port: int, log: Path, threads: int,
                 server_args: tuple[str, ...] = SERVER_ARGS) -> subprocess.Popen:
    """Start llama-server (with ``server_args``: slots, context, batching) and wait until /health answers 200
    (model loaded)."""
    with log.open("w") as out:
        server = subprocess.Popen([str(SERVER), "-m", model, "--host", "127.0.0.1", "--port", str(port),
                                   "-t", str(threads), *server_args], stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"llama-server exited with {server.returncode}; see {log}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    server.terminate()
    raise RuntimeError(f"llama-server did not become healthy in 300 s; see {log}")


def server_version() -> str:
    """``version: 0.5.0-dev (build 1, commit 0c1e570)`` -> ``0.5.0-dev (0c1e570), llama-cpp-python 0.3.36``."""
    run = subprocess.run([str(SERVER), "--version"], capture_output=True, text=True)
    match = re.search(r"version: (\S+) \(.*commit (\w+)\)", run.stdout + run.stderr)
    return f"{match.group(1)} ({match.group(2)}), llama-cpp-python {SDIST_VERSION}" if match else "unknown"


def gguf_file(kind: str) -> str:
    """The GGUF file of a ``--gguf`` kind (set up by setup_llamacpp.sh; Q4_1 is the file the model ships as)."""
    if kind == "q4_1":
        from conveyor.model.loader import default_model_path

        return str(default_model_path())
    if kind == "gemma3-270m":
        from conveyor.model.packaged import packaged_model_path

        return str(packaged_model_path(kind))
    return str(DIR / f"model-{kind}.gguf")


if __name__ == "__main__":
    parser = peer_io.argument_parser(__doc__.splitlines()[0], DIR / "model-f32.gguf")
    parser.add_argument("--gguf", choices=("f32", "q8_0", "q4_1", "gemma3-270m"), default=None,
                        help="run this GGUF file instead of --model: a kind of the default model's, or Gemma 3 270M's")
    args = parser.parse_args()
    model = gguf_file(args.gguf) if args.gguf else args.model
    port = free_port()
    server = start_server(model, port, DIR / "server.log", args.threads)
    try:
        url = f"http://127.0.0.1:{port}/completion"
        name = f"llama.cpp llama-server ({args.gguf.upper()})" if args.gguf else "llama.cpp llama-server"
        peer_io.main(name, server_version(), args,
                     lambda requests: asyncio.run(_all(url, requests)))
    finally:
        server.terminate()
        server.wait(timeout=30)
