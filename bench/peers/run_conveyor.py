"""Conveyor's own ``conveyor serve``, driven over HTTP by the same client as every served peer.

This is how ``conveyor bench compare`` times Conveyor: its own server process
on ``--threads`` threads, asked through ``/v1/completions`` with a token-id
prompt (greedy, ``ignore_eos``, exactly ``output_len`` tokens, vLLM's
``return_token_ids``), so its figures hold what a user meets, as the peers'
do. Prefix caching is off, as every peer computes every prompt, except for a
workload marked ``prefix_caching``, which gets a server with it on. Only one
server runs at a time; each is warmed up with one short request when it starts.
Runs in the project's .venv.
"""

from __future__ import annotations

import sys
from importlib.metadata import version
from pathlib import Path
from typing import Any

import http_client
import peer_io

LOG_DIR = peer_io.PEERS / "conveyor"


def completion_body(request: peer_io.Request) -> dict[str, Any]:
    return {
        "prompt": request["prompt_token_ids"],
        "max_tokens": request["output_len"],
        "ignore_eos": True,
        "temperature": 0.0,
        "return_token_ids": True,
        "stream": False,
    }


def endpoint(port: int) -> http_client.Endpoint:
    return http_client.Endpoint(f"http://127.0.0.1:{port}/v1/completions", completion_body,
                                lambda answer: answer["choices"][0]["token_ids"])


def serve_command(model: str | None, port: int, threads: int, caching: bool, extra: list[str]) -> list[str]:
    """``conveyor serve`` of this checkout on ``port``: ``threads`` compute threads, prefix caching as asked,
    then ``extra`` (``--serve-args``)."""
    command = [sys.executable, "-m", "conveyor.entrypoints.cli", "serve", "--host", "127.0.0.1",
               "--port", str(port), "--num-threads", str(threads),
               "--enable-prefix-caching" if caching else "--no-enable-prefix-caching", *extra]
    return command + (["--model", model] if model else [])


class Servers:
    """The server for each prefix-caching mode, started when first asked for (the other one stopped first, so
    that only one holds memory and cores at a time)."""

    def __init__(self, model: str | None, threads: int, extra: list[str]) -> None:
        self.model, self.threads, self.extra = model, threads, extra
        self._caching: bool | None = None
        self._server = None
        self._endpoint: http_client.Endpoint | None = None

    def run(self, caching: bool, requests: list[peer_io.Request]) -> list[peer_io.Record]:
        if self._caching is not caching:
            self.stop()
            port = http_client.free_port()
            LOG_DIR.mkdir(parents=True, exist_ok=True)
            log = LOG_DIR / f"server{'-cached' if caching else ''}.log"
            command = serve_command(self.model, port, self.threads, caching, self.extra)
            self._server = http_client.start_server(command, f"http://127.0.0.1:{port}/health", log,
                                                    "conveyor serve")
            self._caching, self._endpoint = caching, endpoint(port)
            first = requests[0]
            http_client.run_together(self._endpoint)([{"prompt_token_ids": first["prompt_token_ids"],
                                                       "output_len": peer_io.WARMUP_TOKENS}])
        return http_client.run_together(self._endpoint)(requests)

    def stop(self) -> None:
        if self._server is not None:
            http_client.stop_server(self._server)
            self._server = self._caching = None


if __name__ == "__main__":
    parser = peer_io.argument_parser(__doc__.splitlines()[0], Path("(the default model)"))
    parser.add_argument("--serve-args", default="", help="more flags for `conveyor serve`, as one string")
    parser.add_argument("--name", default="Conveyor server", help="the engine's name in the results")
    parser.set_defaults(model=None)
    args = parser.parse_args()
    servers = Servers(args.model, args.threads, args.serve_args.split())
    try:
        peer_io.main(args.name, version("conveyor"), args,
                     lambda requests: servers.run(False, requests), lambda requests: servers.run(True, requests))
    finally:
        servers.stop()
