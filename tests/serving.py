"""The server tests' shared harness: a real ``conveyor serve`` process on a loopback port, and what they read of it.

* ``running_server``: starts the process (extra flags, extra environment), waits for ``/health``, yields a
  ``Server`` (its base URL and process), and stops it with SIGTERM;
* ``metric``: one figure from ``/metrics``; ``wait_until_idle``: until nothing is open, running or holding KV;
* ``rss_bytes``: a process's resident memory, from /proc;
* ``openai_client``: the official client on a server; ``offline_text``: what the offline engine answers, which
  a server's answer must equal (the ``offline`` fixture in conftest.py is that engine);
* ``with_chat_template``: a copy of a model folder with another chat template, or none.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    base: str
    process: subprocess.Popen
    api_key: str | None

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def output(self) -> str:
        """What the process printed (once it has exited)."""
        return self.process.stdout.read() if self.process.stdout else ""


def start_server(model_dir, *flags: str, api_key: str | None = None, env: dict[str, str] | None = None) -> Server:
    port = free_port()
    command = [sys.executable, "-m", "conveyor.entrypoints.cli", "serve", "--model", str(model_dir),
               "--port", str(port), *flags]
    if api_key is not None:
        command += ["--api-key", api_key]
    environment = {**os.environ, **(env or {})}
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env=environment)
    server = Server(f"http://127.0.0.1:{port}", process, api_key)
    deadline = time.monotonic() + 300  # a loaded machine can take minutes to import torch and load the model
    while True:
        assert process.poll() is None, f"server exited: {server.output()}"
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{server.base}/health", timeout=1).status_code == 200:
                return server
        assert time.monotonic() < deadline, "server did not start"
        time.sleep(0.05)


def stop_server(server: Server) -> None:
    if server.process.poll() is None:
        server.process.send_signal(signal.SIGTERM)
    try:
        server.process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        server.process.kill()
        server.process.wait()


@contextlib.contextmanager
def running_server(model_dir, *flags: str, api_key: str | None = None,
                   env: dict[str, str] | None = None) -> Iterator[Server]:
    server = start_server(model_dir, *flags, api_key=api_key, env=env)
    try:
        yield server
    finally:
        stop_server(server)


def metrics(server: Server) -> dict[str, float]:
    """Every sample of ``/metrics`` whose name starts with ``conveyor:``, by name with its labels but the model's."""
    values = {}
    for line in httpx.get(f"{server.base}/metrics", headers=server.headers, timeout=10).text.splitlines():
        if not line.startswith("conveyor:"):
            continue
        name, value = line.rsplit(" ", 1)
        labels = name[name.index("{") + 1 : -1].split(",") if "{" in name else []
        kept = [label for label in labels if not label.startswith("model_name=")]
        key = name.split("{")[0] + ("{" + ",".join(kept) + "}" if kept else "")
        values[key] = float(value)
    return values


def metric(server: Server, name: str) -> float:
    values = metrics(server)
    assert name in values, f"metric {name} not found in {sorted(values)}"
    return values[name]


def ledger(server: Server) -> dict[str, float]:
    """The server's request ledger: submitted, finished, aborted, errored, open."""
    values = metrics(server)
    ledger = {"submitted": values["conveyor:requests_submitted_total"], "open": values["conveyor:requests_open"]}
    for outcome in ("finished", "aborted", "errored"):
        ledger[outcome] = values.get(f'conveyor:requests_ended_total{{outcome="{outcome}"}}', 0.0)
    return ledger


def wait_until_idle(server: Server, timeout: float = 30) -> dict[str, float]:
    """Until no request is open, running, waiting or swapped and no KV block is held; the metrics then."""
    deadline = time.monotonic() + timeout
    while True:
        values = metrics(server)
        busy = {name: values.get(name) for name in ("conveyor:requests_open", "conveyor:num_requests_running",
                                                    "conveyor:num_requests_waiting", "conveyor:num_requests_swapped",
                                                    "conveyor:kv_cache_usage_perc")}
        if not any(busy.values()):
            return values
        assert time.monotonic() < deadline, f"still busy after {timeout} s: {busy}"
        time.sleep(0.1)


def openai_client(base: str, api_key: str = "unused"):
    """The official client on ``base``, without retries (a test sees every refusal as it came)."""
    import openai

    return openai.OpenAI(base_url=f"{base}/v1", api_key=api_key, max_retries=0)


def offline_text(llm, prompt, max_tokens: int, ignore_eos: bool = False) -> str:
    """The offline engine's greedy text for ``prompt`` (text or token ids)."""
    from conveyor import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos)
    return llm.generate([prompt], params, use_tqdm=False)[0].text


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def probe(base: str, api_key: str, stop_file: str, out_file: str, health_every: float = 0.02,
          malformed_every: float = 0.1) -> None:
    """Run in a process of its own beside a load: time ``/health`` and a malformed body's 400 until ``stop_file``
    exists, then write the latencies (seconds) and statuses to ``out_file`` as JSON.

    A separate process, so that the load generator's own work does not delay the probe's clock.
    """
    import json
    from pathlib import Path

    health, malformed, statuses, malformed_statuses = [], [], [], []
    headers = {"Authorization": f"Bearer {api_key}", "Content-Type": "application/json"}
    next_malformed = 0.0
    with httpx.Client(timeout=30) as client:
        while not Path(stop_file).exists():
            start = time.perf_counter()
            response = client.get(f"{base}/health")
            health.append(time.perf_counter() - start)
            statuses.append(response.status_code)
            if start >= next_malformed:
                next_malformed = start + malformed_every
                start = time.perf_counter()
                response = client.post(f"{base}/v1/completions", content=b'{"prompt": "hi", "max_tokens": ',
                                       headers=headers)
                malformed.append(time.perf_counter() - start)
                malformed_statuses.append(response.status_code)
            time.sleep(health_every)
    Path(out_file).write_text(json.dumps({"health": health, "malformed": malformed, "health_statuses": statuses,
                                          "malformed_statuses": malformed_statuses}))


def plain_probe(base: str, api_key: str, stop_file: str, out_file: str, every: float = 0.25) -> None:
    """Run in a process of its own beside a load: send a plain completion (2 tokens, greedy) every ``every``
    seconds until ``stop_file`` exists, then write each one's [sent at (time.time()), seconds, status] to
    ``out_file`` as JSON: what a plain client waits while the load (and what it holds) goes on."""
    import json
    from pathlib import Path

    sent = []
    body = {"prompt": "hi", "max_tokens": 2, "temperature": 0}
    with httpx.Client(timeout=600, headers={"Authorization": f"Bearer {api_key}"}) as client:
        while not Path(stop_file).exists():
            at, start = time.time(), time.perf_counter()
            response = client.post(f"{base}/v1/completions", json=body)
            sent.append([at, time.perf_counter() - start, response.status_code])
            time.sleep(every)
    Path(out_file).write_text(json.dumps(sent))


def with_chat_template(model_dir: Path, folder: Path, template: str | None) -> Path:
    """``folder``: the HF model folder ``model_dir`` with ``template`` as its chat template (None: without one)."""
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        shutil.copy(model_dir / name, folder / name)
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(config | ({} if template is None else
                                                                       {"chat_template": template})))
    return folder
