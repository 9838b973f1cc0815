"""Soak: many concurrent clients, random requests, random disconnects, random bad input, against a real server.

Each request is drawn from a seed: a completion (token ids or text) or a chat, streamed or not, greedy or
seeded sampling, n of 1-3, stop strings, and one in four leaves at a random point (after a few events, or a
random fraction of a second). Mixed in: malformed bodies, oversized bodies (declared and chunked) and calls
without the key. A separate process times ``/health`` and a malformed body's 400 all along.

Afterwards: no 5xx anywhere, no error event, the server's ledger balanced (every request finished, aborted
or errored, none errored, none open), no KV block held, nothing running or waiting, memory growth bounded
(RSS before and after, reported), and every completed greedy output equal to the offline engine's.

``test_soak_short`` runs in ``make test`` on the tiny model (well under a minute); ``test_soak`` is the long
one, on the default model (``make soak``, marked slow); ``CONVEYOR_SOAK_REPORT=path`` writes the figures as
JSON, ``CONVEYOR_SOAK_REQUESTS`` sets the long one's count. The latency bounds (``/health`` p99 100 ms, a
malformed body's 400 p99 200 ms) are checked unless other work oversubscribes the machine's CPUs.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import sys
import time
import warnings
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from conveyor import LLM, SamplingParams
from tests.serving import ledger, rss_bytes, running_server, wait_until_idle

API_KEY = "soak-key"
BODY_LIMIT = 65536
MAX_MODEL_LEN = 1024
WORDS = ["river", "stone", "light", "north", "quiet", "garden", "signal", "paper", "engine", "window", "cloud"]
STOPS = ["the", "a", "\n", "ing", ".", "er"]


@dataclass(frozen=True)
class SoakConfig:
    requests: int
    concurrency: int
    seed: int = 0
    warmup: int = 40
    check_latency: bool = True


@dataclass
class Tally:
    kinds: Counter = field(default_factory=Counter)  # what was sent
    outcomes: Counter = field(default_factory=Counter)  # completed, disconnected, refused as expected
    failures: list = field(default_factory=list)  # anything unexpected: a 5xx, an error event, a wrong status
    greedy: list = field(default_factory=list)  # (prompt, SamplingParams, endpoint, texts by index)
    latencies: list = field(default_factory=list)  # seconds, each request from sending to its last byte


def _prompt(rng: random.Random, endpoint: str):
    if endpoint == "chat":
        turns = rng.randrange(1, 4) * 2 - 1
        return [{"role": "user" if t % 2 == 0 else "assistant", "content": " ".join(rng.choices(WORDS, k=12))}
                for t in range(turns)]
    if endpoint == "text":
        return " ".join(rng.choices(WORDS, k=rng.randint(1, 60)))
    return [rng.randrange(1000, 40000) for _ in range(rng.randint(1, 120))]


def _valid_body(rng: random.Random) -> tuple[str, dict, SamplingParams | None]:
    """An endpoint, a body, and the offline SamplingParams when the request is greedy (else None)."""
    endpoint = rng.choice(["tokens", "text", "chat"])
    greedy = rng.random() < 0.7
    n = 1 if rng.random() < 0.85 else rng.randint(2, 3)
    body = {"max_tokens": rng.randint(1, 40), "n": n, "stream": rng.random() < 0.5}
    body |= {"temperature": 0} if greedy else {"temperature": 0.8, "top_p": 0.9, "seed": rng.randrange(1000)}
    if rng.random() < 0.2:
        body["stop"] = rng.sample(STOPS, rng.randint(1, 3))
    if rng.random() < 0.5:
        body["ignore_eos"] = True
    if body["stream"] and rng.random() < 0.3:
        body["stream_options"] = {"include_usage": True}
    prompt = _prompt(rng, endpoint)
    body["messages" if endpoint == "chat" else "prompt"] = prompt
    params = None
    if greedy:
        params = SamplingParams(temperature=0.0, max_tokens=body["max_tokens"], n=n, stop=tuple(body.get("stop", ())),
                                ignore_eos=body.get("ignore_eos", False))
    return endpoint, body, params


MALFORMED = [  # (path, raw body, expected status)
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": ', 400),
    ("/v1/completions", b"not json at all", 400),
    ("/v1/completions", b'{"prompt": 5}', 400),
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": 0}', 400),
    ("/v1/completions", b'{"prompt": "hi", "temperature": -1}', 400),
    ("/v1/completions", b'{"prompt": "hi", "n": 1000}', 400),
    ("/v1/completions", b'{"prompt": "hi", "bogus": 1}', 400),
    ("/v1/completions", json.dumps({"prompt": "hi", "stop": ["x"] * 40}).encode(), 400),
    ("/v1/completions", json.dumps({"prompt": [1000] * 1100}).encode(), 400),
    ("/v1/completions", b'{"prompt": [-5]}', 400),
    ("/v1/completions", b'{"prompt": "hi", "logprobs": 21}', 400),  # over the 20 alternatives allowed
    ("/v1/completions", b'{"prompt": "hi", "model": "nope"}', 404),
    ("/v1/chat/completions", b'{"messages": []}', 400),
    ("/v1/chat/completions", b'{"messages": [{"role": "wizard", "content": "hi"}]}', 400),
    ("/v1/chat/completions", b'{"messages": "hi"}', 400),
]


class Soak:
    def __init__(self, base: str, config: SoakConfig) -> None:
        self.base, self.config, self.tally = base, config, Tally()
        self.headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}

    async def run(self, first: int, count: int) -> None:
        limits = httpx.Limits(max_connections=self.config.concurrency + 8)
        # A generous timeout: on a machine shared with other work a queued request can wait minutes; one that
        # never gets an answer still fails the soak.
        async with httpx.AsyncClient(timeout=600, limits=limits) as client:
            next_index = iter(range(first, first + count))

            async def worker():
                for i in next_index:
                    await self.one(client, i)

            await asyncio.gather(*(worker() for _ in range(self.config.concurrency)))

    async def one(self, client: httpx.AsyncClient, i: int) -> None:
        rng = random.Random(f"{self.config.seed}-{i}")
        kind = rng.choices(["valid", "malformed", "oversized", "unauthenticated"], [75, 14, 7, 4])[0]
        self.tally.kinds[kind] += 1
        start = time.monotonic()
        try:
            await getattr(self, kind)(client, rng)
        except httpx.HTTPError as error:  # a transport failure is a failure of the server too
            self.tally.failures.append((kind, i, f"{type(error).__name__} after {time.monotonic() - start:.1f} s"))
        self.tally.latencies.append(time.monotonic() - start)

    def expect(self, kind: str, response: httpx.Response, status: int) -> None:
        if response.status_code != status:
            self.tally.failures.append((kind, response.status_code, response.text[:200]))
        else:
            self.tally.outcomes[f"{kind} refused"] += 1

    async def malformed(self, client: httpx.AsyncClient, rng: random.Random) -> None:
        path, content, status = rng.choice(MALFORMED)
        self.expect("malformed", await client.post(f"{self.base}{path}", content=content, headers=self.headers),
                    status)

    async def oversized(self, client: httpx.AsyncClient, rng: random.Random) -> None:
        content = json.dumps({"prompt": "x" * rng.randint(BODY_LIMIT + 1, 2 * BODY_LIMIT)}).encode()
        body: bytes | object = content
        if rng.random() < 0.5:  # chunked: no length declared
            size = rng.choice([1024, 8192, 65536])

            async def chunks():
                for start in range(0, len(content), size):
                    yield content[start : start + size]

            body = chunks()
            self.tally.kinds["oversized chunked"] += 1
        response = await client.post(f"{self.base}/v1/completions", content=body, headers=self.headers)
        self.expect("oversized", response, 413)

    async def unauthenticated(self, client: httpx.AsyncClient, rng: random.Random) -> None:
        response = await client.post(f"{self.base}/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        self.expect("unauthenticated", response, 401)

    async def valid(self, client: httpx.AsyncClient, rng: random.Random) -> None:
        endpoint, body, greedy = _valid_body(rng)
        path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
        leave = rng.random() < 0.25
        if body["stream"]:
            texts = await self.stream(client, path, body, rng.randint(0, 6) if leave else None)
        else:
            texts = await self.whole(client, path, body, rng.uniform(0, 0.3) if leave else None)
        if texts is None:
            self.tally.outcomes["disconnected"] += 1
            return
        self.tally.outcomes["completed"] += 1
        if greedy is not None:
            self.tally.greedy.append((body.get("messages") or body["prompt"], greedy, endpoint, texts))

    async def whole(self, client, path: str, body: dict, leave_after: float | None) -> list[str] | None:
        request = client.post(f"{self.base}{path}", json=body, headers=self.headers)
        try:
            response = await (request if leave_after is None else asyncio.wait_for(request, leave_after))
        except TimeoutError:
            return None  # the client left before the answer
        if response.status_code != 200:
            self.tally.failures.append(("valid", response.status_code, response.text[:200]))
            return None
        choices = sorted(response.json()["choices"], key=lambda c: c["index"])
        return [c["message"]["content"] if "message" in c else c["text"] for c in choices]

    async def stream(self, client, path: str, body: dict, leave_after: int | None) -> list[str] | None:
        texts = [""] * body["n"]
        events = 0
        async with client.stream("POST", f"{self.base}{path}", json=body, headers=self.headers) as response:
            if response.status_code != 200:
                self.tally.failures.append(("valid", response.status_code, (await response.aread())[:200]))
                return None
            done = False
            async for line in response.aiter_lines():
                if leave_after is not None and events >= leave_after:
                    return None  # leaving the block closes the connection mid-stream
                if not line.startswith("data:"):
                    continue
                events += 1
                if line == "data: [DONE]":
                    done = True
                    continue
                event = json.loads(line[5:])
                if "error" in event:
                    self.tally.failures.append(("valid", "error event", event["error"]))
                    return None
                for choice in event["choices"]:
                    delta = choice.get("delta", {}).get("content") if "delta" in choice else choice.get("text")
                    texts[choice["index"]] += delta or ""
        if not done:
            self.tally.failures.append(("valid", "stream ended without [DONE]"))
            return None
        return texts


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)] if ordered else 0.0


def _check_greedy(model_dir, greedy: list) -> int:
    """Every completed greedy output against the offline engine's; how many sequences were compared."""
    llm = LLM(str(model_dir), num_kv_blocks=512, max_model_len=MAX_MODEL_LEN)
    prompts = [llm.tokenizer.apply_chat_template(p) if endpoint == "chat" else p for p, _, endpoint, _ in greedy]
    outputs = llm.generate(prompts, [params for _, params, _, _ in greedy], use_tqdm=False)
    expected = [o.text for o in outputs]
    got = [text for *_, texts in greedy for text in texts]
    mismatches = [(g, e) for g, e in zip(got, expected) if g != e]
    assert len(got) == len(expected) and not mismatches, f"{len(mismatches)} greedy outputs differ: {mismatches[:3]}"
    return len(got)


def run_soak(model_dir, tmp_path: Path, config: SoakConfig) -> dict:
    flags = ["--num-kv-blocks", "512", "--max-num-seqs", "32", "--max-request-bytes", str(BODY_LIMIT),
             "--max-model-len", str(MAX_MODEL_LEN)]
    with running_server(model_dir, *flags, api_key=API_KEY) as server:
        soak = Soak(server.base, config)
        asyncio.run(soak.run(0, config.warmup))  # first requests: the allocator and caches settle
        wait_until_idle(server)
        rss_before = rss_bytes(server.process.pid)
        stop_file, probe_file = tmp_path / "stop", tmp_path / "probe.json"
        prober = subprocess.Popen([sys.executable, "-c", "import sys; from tests.serving import probe; "
                                   "probe(*sys.argv[1:])", server.base, API_KEY, str(stop_file), str(probe_file)],
                                  cwd=Path(__file__).resolve().parent.parent)
        start = time.monotonic()
        asyncio.run(soak.run(config.warmup, config.requests))
        duration = time.monotonic() - start
        stop_file.touch()
        assert prober.wait(timeout=60) == 0
        values = wait_until_idle(server)
        books = ledger(server)
        rss_after = rss_bytes(server.process.pid)
    probe = json.loads(probe_file.read_text())
    tally = soak.tally
    report = {
        "model": Path(model_dir).name, "requests": config.requests, "concurrency": config.concurrency,
        "duration_s": round(duration, 1), "machine": _machine(),
        "sent": dict(tally.kinds), "outcomes": dict(tally.outcomes), "failures": len(tally.failures),
        "server_ledger": books, "leaked_kv_blocks": round(values["conveyor:kv_cache_usage_perc"] * 512),
        "rss_before_mib": round(rss_before / 2**20, 1), "rss_after_mib": round(rss_after / 2**20, 1),
        "health_p50_ms": round(_percentile(probe["health"], 0.5) * 1000, 1),
        "health_p99_ms": round(_percentile(probe["health"], 0.99) * 1000, 1),
        "health_max_ms": round(max(probe["health"]) * 1000, 1),
        "malformed_400_p50_ms": round(_percentile(probe["malformed"], 0.5) * 1000, 1),
        "malformed_400_p99_ms": round(_percentile(probe["malformed"], 0.99) * 1000, 1),
        "malformed_400_max_ms": round(max(probe["malformed"]) * 1000, 1),
        "probes": len(probe["health"]) + len(probe["malformed"]),
        "request_latency_p50_s": round(_percentile(tally.latencies, 0.5), 2),
        "request_latency_max_s": round(max(tally.latencies), 2),
    }
    report["greedy_sequences_checked"] = _check_greedy(model_dir, tally.greedy)
    print("\nsoak:", json.dumps(report, indent=1))
    if os.environ.get("CONVEYOR_SOAK_REPORT"):
        Path(os.environ["CONVEYOR_SOAK_REPORT"]).write_text(json.dumps(report, indent=1) + "\n")

    assert not tally.failures, tally.failures[:5]
    assert all(s == 200 for s in probe["health_statuses"]) and all(s == 400 for s in probe["malformed_statuses"])
    assert books["open"] == 0 and books["errored"] == 0
    assert books["submitted"] == books["finished"] + books["aborted"] + books["errored"]
    assert report["leaked_kv_blocks"] == 0
    assert not any(values.get(f"conveyor:num_requests_{q}") for q in ("running", "waiting", "swapped"))
    assert tally.outcomes["disconnected"] > 0 and tally.outcomes["completed"] > 0
    assert rss_after - rss_before < 256 * 2**20, "memory grew by more than 256 MiB"
    if config.check_latency and _oversubscribed():
        warnings.warn(f"latency figures not checked: the machine is oversubscribed ({_machine()})", stacklevel=1)
    elif config.check_latency:
        assert report["health_p99_ms"] <= 100, report
        assert report["malformed_400_p99_ms"] <= 200, report
    return report


def _machine() -> str:
    load = os.getloadavg()
    return f"{os.cpu_count()} CPUs, load average {load[0]:.1f} / {load[1]:.1f} (1 / 5 min)"


def _oversubscribed() -> bool:
    """Other work on this machine would set the latency, not the server: more than two runnable per CPU."""
    return min(os.getloadavg()[:2]) > 2 * (os.cpu_count() or 1)


def test_soak_short(tiny_model_dir, tmp_path):
    run_soak(tiny_model_dir, tmp_path, SoakConfig(requests=300, concurrency=32, seed=1))


@pytest.mark.slow
@pytest.mark.soak
def test_soak(default_model_dir, tmp_path):
    """The default model (SmolLM2-135M): model steps of tens of milliseconds, during which the server must
    still answer, stream and accept."""
    requests = int(os.environ.get("CONVEYOR_SOAK_REQUESTS", "2000"))
    run_soak(default_model_dir, tmp_path, SoakConfig(requests=requests, concurrency=64, seed=2))
