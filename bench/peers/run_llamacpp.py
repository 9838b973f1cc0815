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

import re
import subprocess
from pathlib import Path
from typing import Any

import http_client
import peer_io

DIR = peer_io.PEERS / "llama.cpp"
SERVER = DIR / "build" / "bin" / "llama-server"
# Forks with llama-server's command line and API, built by hand under .peers/NAME (--fork NAME), and the flags
# each runs with in place of SERVER_ARGS: ik_llama.cpp repacks weights at load into its row-interleaved layouts
# (-rtr) and has no --no-ui.
FORK_ARGS = {"ik_llama.cpp": ("-np", "64", "-c", "65536", "-cb", "-rtr")}
# Forks whose server answers 500 to a whole answer holding text that is not UTF-8 (random weights' outputs):
# read from the stream instead, whose last event holds the count and the timings.
STREAMED_FORKS = {"ik_llama.cpp"}
UNKNOWN_TOKEN = -1  # an output token whose id the server did not return (ik_llama.cpp's answers hold none)
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


def output_tokens(answer: dict[str, Any]) -> list[int]:
    """The answer's output ids (``tokens``); where a server returns none, as many UNKNOWN_TOKEN as it predicted,
    so that its speed counts and its agreement is not judged."""
    if "tokens" in answer:
        return answer["tokens"]
    return [UNKNOWN_TOKEN] * answer["tokens_predicted"]


def endpoint(port: int, streamed: bool = False) -> http_client.Endpoint:
    """``/completion`` with a token-id prompt; the answer's ``tokens`` are the output's ids (``streamed``: the
    answer read from its stream's last event, for a fork that fails whole answers of text that is not UTF-8)."""
    return http_client.Endpoint(f"http://127.0.0.1:{port}/completion", completion_body, output_tokens, streamed)


def start_server(model: str, port: int, log: Path, threads: int,
                 server_args: tuple[str, ...] = SERVER_ARGS, server: Path = SERVER) -> subprocess.Popen:
    """Start llama-server (with ``server_args``: slots, context, batching) in the folder of its log, where a fork
    writes a log file of its own (ik_llama.cpp's llama.log), and wait until /health answers 200 (model loaded)."""
    command = [str(server), "-m", str(Path(model).resolve()), "--host", "127.0.0.1", "--port", str(port),
               "-t", str(threads), *server_args]
    return http_client.start_server(command, f"http://127.0.0.1:{port}/health", log, "llama-server", log.parent)


def server_version(server: Path = SERVER) -> str:
    """``version: 0.5.0-dev (build 1, commit 0c1e570)`` -> ``0.5.0-dev (0c1e570), llama-cpp-python 0.3.36``
    (a fork's: its version and commit alone)."""
    run = subprocess.run([str(server), "--version"], capture_output=True, text=True)
    match = re.search(r"version: (\S+) \((?:.*commit )?(\w+)\)", run.stdout + run.stderr)
    if not match:
        return "unknown"
    return f"{match.group(1)} ({match.group(2)})" + (f", llama-cpp-python {SDIST_VERSION}" if server == SERVER else "")


def gguf_file(kind: str) -> str:
    """The GGUF file of a ``--gguf`` kind (set up by setup_llamacpp.sh; Q4_1 is the file the model ships as)."""
    if kind == "q4_1":
        from conveyor.model.weights.paths import default_model_path

        return str(default_model_path())
    if kind == "gemma3-270m":
        from conveyor.model.weights.packaged import packaged_model_path

        return str(packaged_model_path(kind))
    return str(DIR / f"model-{kind}.gguf")


if __name__ == "__main__":
    parser = peer_io.argument_parser(__doc__.splitlines()[0], DIR / "model-f32.gguf")
    parser.add_argument("--gguf", choices=("f32", "q8_0", "q4_1", "gemma3-270m"), default=None,
                        help="run this GGUF file instead of --model: a kind of the default model's, or Gemma 3 270M's")
    parser.add_argument("--fork", choices=sorted(FORK_ARGS), default=None,
                        help="run a fork's llama-server, built by hand under .peers/FORK, with its own flags")
    args = parser.parse_args()
    model = gguf_file(args.gguf) if args.gguf else args.model
    binary = peer_io.PEERS / args.fork / "build" / "bin" / "llama-server" if args.fork else SERVER
    port = http_client.free_port()
    log = (binary.parents[2] if args.fork else DIR) / "server.log"
    server = start_server(model, port, log, args.threads, FORK_ARGS.get(args.fork, SERVER_ARGS), binary)
    try:
        label = Path(model).name if not args.gguf else args.gguf.upper()
        name = f"{args.fork or 'llama.cpp'} llama-server ({label})"
        streamed = args.fork in STREAMED_FORKS
        peer_io.main(name, server_version(binary), args, http_client.run_together(endpoint(port, streamed)))
    finally:
        http_client.stop_server(server)
