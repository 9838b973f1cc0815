"""Soak: many concurrent clients, random requests, random disconnects, random bad input, against a real server.

Each request is drawn from a seed: a completion (token ids or text) or a chat, streamed or not, greedy or
seeded sampling, n of 1-3, stop strings, and one in four leaves at a random point (after a few events, or a
random fraction of a second). Mixed in: malformed bodies, oversized bodies (declared and chunked), calls
without the key, hostile bodies (lone surrogates, nesting, numbers past every edge, long arrays: any 2xx or
4xx), slow senders (a body sent in pieces, served; or one that stalls, 408) and, in the second half only,
grammar bombs (constraints over a limit, refused, or as costly as the limits allow). A separate process times
``/health`` and a malformed body's 400 all along, another a plain completion: its p99 with the grammar bombs
must stay within twice its p99 without.

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
import contextlib
import dataclasses
import json
import os
import random
import subprocess
import sys
import time
import warnings
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from conveyor import LLM, SamplingParams
from conveyor.core.structured import MAX_ENUM_VALUES
from tests.hostile_bodies import grammar_bomb, random_hostile_body
from tests.serving import ledger, rss_bytes, running_server, wait_until_idle

API_KEY = "soak-key"
BODY_LIMIT = 65536
BODY_READ_TIMEOUT_S = 2
KINDS = {"valid": 63, "malformed": 12, "oversized": 5, "unauthenticated": 3, "hostile": 10, "slow": 3, "bomb": 4}
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
    fill_caches: bool = True  # the grammar cache made resident before the load (_fill_caches)


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
        self.bombs = False  # grammar bombs among the requests: the second half only, to compare latency

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
        weights = {kind: 0 if kind == "bomb" and not self.bombs else weight for kind, weight in KINDS.items()}
        kind = rng.choices(list(weights), list(weights.values()))[0]
        self.tally.kinds[kind] += 1
        start = time.monotonic()
        try:
            await getattr(self, kind)(client, rng)
        except (httpx.HTTPError, OSError) as error:  # a transport failure is a failure of the server too
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

    async def hostile(self, client: httpx.AsyncClient, rng: random.Random) -> None:
        path, content = random_hostile_body(rng)
        response = await client.post(f"{self.base}{path}", content=content, headers=self.headers)
        if 200 <= response.status_code < 300 or 400 <= response.status_code < 500:
            self.tally.outcomes[f"hostile {response.status_code}"] += 1
        else:
            self.tally.failures.append(("hostile", response.status_code, content[:200], response.text[:200]))

    async def bomb(self, client: httpx.AsyncClient, rng: random.Random) -> None:
        body = grammar_bomb(rng, rng.randrange(10**9), MAX_ENUM_VALUES)
        response = await client.post(f"{self.base}/v1/completions", json=body, headers=self.headers)
        if response.status_code in (200, 400):
            self.tally.outcomes[f"bomb {response.status_code}"] += 1
        else:
            self.tally.failures.append(("bomb", response.status_code, response.text[:200]))

    async def slow(self, client: httpx.AsyncClient, rng: random.Random) -> None:
        """A body sent in pieces over up to a second (served), or one that stops after its first bytes (408)."""
        stall = rng.random() < 0.4
        body = json.dumps({"prompt": "a slow sender", "max_tokens": 2}).encode()
        address = httpx.URL(self.base)
        reader, writer = await asyncio.open_connection(address.host, address.port)
        head = (f"POST /v1/completions HTTP/1.1\r\nHost: {address.host}\r\nAuthorization: Bearer {API_KEY}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n")
        try:
            writer.write(head.encode() + body[:5])
            for start in range(5, len(body), 12) if not stall else ():
                await asyncio.sleep(rng.uniform(0.05, 0.2))
                writer.write(body[start : start + 12])
                await writer.drain()
            answer = await asyncio.wait_for(reader.read(), BODY_READ_TIMEOUT_S + 60)
        finally:
            writer.close()
        status = int(answer.split(b" ", 2)[1]) if answer.startswith(b"HTTP/1.1 ") else None
        if status == (408 if stall else 200):
            self.tally.outcomes[f"slow {status}"] += 1
        else:
            self.tally.failures.append(("slow", status, answer[:200]))

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


# How close the offline engine's two likeliest tokens must be for a differing greedy output to count as a
# tie: a batch of another size sums its float32 dot products in another order, and where two tokens' logits
# are within that rounding either is the greedy choice. Far above the rounding (~1e-5), far below any real
# preference.
NEAR_TIE_LOGPROB = 0.01


def _check_greedy(model_dir, greedy: list) -> dict:
    """Every completed greedy output against the offline engine's: equal, or differing first where the offline
    engine's two likeliest tokens tie (within NEAR_TIE_LOGPROB) and the server took the other of them."""
    llm = LLM(str(model_dir), num_kv_blocks=512, max_model_len=MAX_MODEL_LEN)
    prompts = [llm.tokenizer.apply_chat_template(p) if endpoint == "chat" else p for p, _, endpoint, _ in greedy]
    outputs = llm.generate(prompts, [dataclasses.replace(p, logprobs=2) for _, p, _, _ in greedy], use_tqdm=False)
    got = [text for *_, texts in greedy for text in texts]
    assert len(got) == len(outputs), (len(got), len(outputs))
    differing = [(text, output) for text, output in zip(got, outputs) if text != output.text]
    not_ties = [(text, output.text) for text, output in differing if not _is_near_tie(llm.tokenizer, text, output)]
    assert not not_ties, f"{len(not_ties)} greedy outputs differ: {not_ties[:3]}"
    return {"sequences": len(got), "equal": len(got) - len(differing), "near_ties": len(differing)}


def _is_near_tie(tokenizer, text: str, output) -> bool:
    """Whether ``text`` leaves the offline output first at a token whose two likeliest choices tie, by taking
    the other one."""
    ids = output.token_ids
    for i in range(len(ids)):
        if not text.startswith(tokenizer.decode(ids[: i + 1])):
            top = output.logprobs[i].top
            if len(top) < 2 or top[0][1] - top[1][1] > NEAR_TIE_LOGPROB:
                return False
            other = tokenizer.decode([*ids[:i], top[1][0]])
            return text.startswith(other) or other.startswith(text)
    return False


@contextlib.contextmanager
def _probes(base: str, tmp_path: Path) -> Iterator[dict]:
    """The two probe processes (``/health`` and a malformed body; a plain completion) for the duration of the
    block; their figures fill the dict yielded, once they stopped."""
    stop_file, figures = tmp_path / "stop", {}
    outputs = {"probe": tmp_path / "probe.json", "plain": tmp_path / "plain.json"}
    probers = [subprocess.Popen([sys.executable, "-c", f"import sys; from tests.serving import {name}; "
                                 f"{name}(*sys.argv[1:])", base, API_KEY, str(stop_file), str(out)],
                                cwd=Path(__file__).resolve().parents[2]) for name, out in
               (("probe", outputs["probe"]), ("plain_probe", outputs["plain"]))]
    try:
        yield figures
    finally:
        stop_file.touch()
        assert all(prober.wait(timeout=120) == 0 for prober in probers)
    figures.update({name: json.loads(out.read_text()) for name, out in outputs.items()})


@dataclass
class Loaded:
    soak: Soak
    figures: dict  # the probes'
    rss_before: int  # the server's, after the warm-up
    duration: float
    bombs_from: float  # when the grammar bombs began (time.time())


def _load(server, config: SoakConfig, tmp_path: Path) -> Loaded:
    """The soak's requests after its warm-up, the second half with grammar bombs."""
    soak = Soak(server.base, config)
    asyncio.run(soak.run(0, config.warmup))  # first requests: the allocator and caches settle
    if config.fill_caches:
        asyncio.run(_fill_caches(soak))
    wait_until_idle(server)
    rss_before = rss_bytes(server.process.pid)
    half = config.requests // 2
    with _probes(server.base, tmp_path) as figures:
        start = time.monotonic()
        asyncio.run(soak.run(config.warmup, half))
        bombs_from, soak.bombs = time.time(), True
        asyncio.run(soak.run(config.warmup + half, config.requests - half))
        duration = time.monotonic() - start
    return Loaded(soak, figures, rss_before, duration, bombs_from)


async def _fill_caches(soak: Soak) -> None:
    """Make resident what is meant to grow to a bound, so that the memory check after the load sees leaks only:
    the compiled grammars' cache, filled to its byte limit by grammar bombs (measured on the default model:
    resident memory grew by 220 MiB over the first 20 bombs, 39 over the next 20, 5 over the 20 after: bounded,
    unlike a leak). The KV pool is resident from the server's start (Decoder.zeroed_kv_cache)."""
    rng = random.Random("fill")
    async with httpx.AsyncClient(timeout=600) as client:
        for i in range(40):
            await client.post(f"{soak.base}/v1/completions", headers=soak.headers,
                              json=grammar_bomb(rng, 10**9 + i, MAX_ENUM_VALUES))


def _plain_p99_ms(plain: list, bombs_from: float) -> tuple[float, float]:
    """A plain completion's p99 latency without the grammar bombs and with them, in ms."""
    without = [latency for sent, latency, _ in plain if sent < bombs_from]
    during = [latency for sent, latency, _ in plain if sent >= bombs_from]
    return round(_percentile(without, 0.99) * 1000, 1), round(_percentile(during, 0.99) * 1000, 1)


def run_soak(model_dir, tmp_path: Path, config: SoakConfig) -> dict:
    flags = ["--num-kv-blocks", "512", "--max-num-seqs", "32", "--max-request-bytes", str(BODY_LIMIT),
             "--max-model-len", str(MAX_MODEL_LEN), "--body-read-timeout", str(BODY_READ_TIMEOUT_S)]
    with running_server(model_dir, *flags, api_key=API_KEY) as server:
        run = _load(server, config, tmp_path)
        values = wait_until_idle(server)
        books = ledger(server)
        rss_after = rss_bytes(server.process.pid)
    figures, duration, rss_before, tally = run.figures, run.duration, run.rss_before, run.soak.tally
    probe, plain = figures["probe"], figures["plain"]
    without_bombs, with_bombs = _plain_p99_ms(plain, run.bombs_from)
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
        "plain_probes": len(plain), "plain_p99_without_bombs_ms": without_bombs,
        "plain_p99_with_bombs_ms": with_bombs,
        "request_latency_p50_s": round(_percentile(tally.latencies, 0.5), 2),
        "request_latency_max_s": round(max(tally.latencies), 2),
    }
    report["greedy_sequences_checked"] = _check_greedy(model_dir, tally.greedy)
    print("\nsoak:", json.dumps(report, indent=1))
    if os.environ.get("CONVEYOR_SOAK_REPORT"):
        Path(os.environ["CONVEYOR_SOAK_REPORT"]).write_text(json.dumps(report, indent=1) + "\n")
    _check(report, tally, figures, books, values, config)
    return report


def _check(report: dict, tally: Tally, figures: dict, books: dict, values: dict, config: SoakConfig) -> None:
    probe = figures["probe"]
    assert not tally.failures, tally.failures[:5]
    assert all(s == 200 for s in probe["health_statuses"]) and all(s == 400 for s in probe["malformed_statuses"])
    assert all(status == 200 for *_, status in figures["plain"]), "a plain completion was not served"
    assert books["open"] == 0 and books["errored"] == 0
    assert books["submitted"] == books["finished"] + books["aborted"] + books["errored"]
    assert report["leaked_kv_blocks"] == 0
    assert not any(values.get(f"conveyor:num_requests_{q}") for q in ("running", "waiting", "swapped"))
    assert tally.outcomes["disconnected"] > 0 and tally.outcomes["completed"] > 0
    assert report["rss_after_mib"] - report["rss_before_mib"] < 256, "memory grew by more than 256 MiB"
    if config.check_latency and _oversubscribed():
        warnings.warn(f"latency figures not checked: the machine is oversubscribed ({_machine()})", stacklevel=1)
    elif config.check_latency:
        assert report["health_p99_ms"] <= 100, report
        assert report["malformed_400_p99_ms"] <= 200, report
        assert report["plain_p99_with_bombs_ms"] <= 2 * report["plain_p99_without_bombs_ms"], report


def _machine() -> str:
    load = os.getloadavg()
    return f"{os.cpu_count()} CPUs, load average {load[0]:.1f} / {load[1]:.1f} (1 / 5 min)"


def _oversubscribed() -> bool:
    """Other work on this machine would set the latency, not the server: more than two runnable per CPU."""
    return min(os.getloadavg()[:2]) > 2 * (os.cpu_count() or 1)


def test_soak_short(tiny_model_dir, tmp_path):
    """The soak's every check but latency on the tiny model, in `make test`: there the suite's other worker
    shares the two cores, so the latency figures are printed and held to their bounds by `make soak` only. The
    tiny model's KV pool is small, and its few grammar bombs leave the grammar cache far below its limit: nothing
    to fill before the memory check."""
    run_soak(tiny_model_dir, tmp_path, SoakConfig(requests=300, concurrency=32, seed=1, check_latency=False,
                                                  fill_caches=False))


@pytest.mark.slow
@pytest.mark.soak
def test_soak(default_model_dir, tmp_path):
    """The default model (SmolLM2-135M): model steps of tens of milliseconds, during which the server must
    still answer, stream and accept."""
    requests = int(os.environ.get("CONVEYOR_SOAK_REQUESTS", "2000"))
    run_soak(default_model_dir, tmp_path, SoakConfig(requests=requests, concurrency=64, seed=2))
