"""A ``conveyor serve`` of this checkout, started for a benchmark and stopped after it."""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx

START_TIMEOUT_S = 300  # importing torch and loading a model can take minutes on a loaded machine


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def local_server(flags: list[str]) -> Iterator[str]:
    """``conveyor serve`` with ``flags`` on a free port, its base URL once ``/health`` answers; SIGTERM after."""
    port = free_port()
    command = [sys.executable, "-m", "conveyor.entrypoints.cli", "serve", "--port", str(port), *flags]
    # No terminal: a server started from a shell job would be stopped (SIGTTIN) as soon as anything read it.
    process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_until_healthy(process, base, command)
        yield base
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()


def _wait_until_healthy(process: subprocess.Popen, base: str, command: list[str]) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with status {process.returncode}: {' '.join(command)}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                return
        if time.monotonic() > deadline:
            raise RuntimeError(f"the server did not start in {START_TIMEOUT_S} s")
        time.sleep(0.5)


def server_script_parser(doc: str, engine_flags_help: str = "flags for every server, after --"
                         ) -> argparse.ArgumentParser:
    """The command line of a script that benchmarks servers it starts (``bench/*.py``): described by the first
    paragraph of its docstring, with ``--json`` (a file for the results) and, after ``--``, the engine flags
    each of its servers gets."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--json", default=None, help="write the results to this file as JSON")
    parser.add_argument("engine_flags", nargs="*", help=engine_flags_help)
    return parser


def save_results(path: str | None, results: object) -> None:
    """The results as JSON at ``path`` (``--json``), where one was given; what JSON has no type for (an enum, a
    path) as its text."""
    if path:
        with open(path, "w") as file:
            json.dump(results, file, indent=2, default=str)
