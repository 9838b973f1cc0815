"""``conveyor bench serve``: an online benchmark against any OpenAI-compatible server.

Requests arrive as a Poisson process at ``--request-rate`` (or all at once
with ``inf``), each streaming from ``/v1/completions`` with token-id prompts
and ``ignore_eos`` so that lengths are exact; the same seeded workload as
``bench throughput``. It times each token as the client sees it: time to
first token (TTFT), time per output token after the first (TPOT),
inter-token latency (ITL) and end-to-end latency, and counts goodput, the
requests per second that met the latency objectives.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from conveyor.benchmarks.report import format_table
from conveyor.benchmarks.workload import (
    Conversation,
    SyntheticRequest,
    long_tail_workload,
    multi_turn_workload,
    shared_prefix_workload,
)
from conveyor.observe.figures import mean, met_targets, percentile


@dataclass(slots=True)
class RequestTiming:
    prompt_tokens: int
    output_tokens: int = 0
    cached_tokens: int = 0  # usage.prompt_tokens_details.cached_tokens, where the server reports it
    ttft: float | None = None
    latency: float | None = None
    token_times: list[float] = field(default_factory=list)
    error: str | None = None
    status: int | None = None  # the HTTP status of a request the server did not answer with 200
    text: str = ""  # the answer, which a multi-turn conversation sends back in its next turn

    @property
    def tpot(self) -> float | None:
        if self.latency is None or self.ttft is None or self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


@dataclass(frozen=True, slots=True)
class ExtraBody:
    """Fields added to a share of the requests (logprobs, penalties, a JSON schema...): what they cost is the
    difference to the same run without them."""

    fields: dict[str, Any]
    fraction: float = 1.0

    def applies_to(self, index: int) -> bool:
        """Spread evenly: request ``index`` gets the fields when the running share crosses a whole number."""
        return int((index + 1) * self.fraction) > int(index * self.fraction)


def parse_extra_body(text: str | None, fraction: float) -> ExtraBody | None:
    if text is None:
        return None
    fields = json.loads(text)
    if not isinstance(fields, dict):
        raise ValueError(f"--extra-body must be a JSON object, got {text!r}")
    if not 0 <= fraction <= 1:
        raise ValueError(f"--extra-body-fraction must be in [0, 1], got {fraction}")
    return ExtraBody(fields, fraction)


async def stream_request(client: httpx.AsyncClient, url: str, model: str | None, item: SyntheticRequest,
                         headers: dict[str, str], extra: dict[str, Any] | None = None) -> RequestTiming:
    """One streamed completion of ``item`` (greedy, ``ignore_eos``; ``extra``: more fields of the body), timed
    token by token as the client sees them; an HTTP error or an error event is recorded, not raised."""
    timing = RequestTiming(len(item.prompt_token_ids))
    body: dict[str, Any] = {"prompt": item.prompt_token_ids, "max_tokens": item.output_len, "temperature": 0,
                            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    body |= extra or {}
    if model:
        body["model"] = model
    start = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body, headers=headers) as response:
            if response.status_code != 200:
                timing.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                timing.status, timing.latency = response.status_code, time.perf_counter() - start
                return timing
            async for line in response.aiter_lines():
                if not line.startswith("data:") or line.strip() == "data: [DONE]":
                    continue
                event = json.loads(line[5:])
                if "error" in event:
                    timing.error = str(event["error"])
                    return timing
                if event.get("choices") and event["choices"][0].get("text"):
                    timing.token_times.append(time.perf_counter() - start)
                    timing.text += event["choices"][0]["text"]
                if event.get("usage"):
                    usage = event["usage"]
                    timing.output_tokens = usage["completion_tokens"]
                    timing.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    except httpx.HTTPError as error:
        timing.error = repr(error)
        return timing
    timing.latency = time.perf_counter() - start
    timing.ttft = timing.token_times[0] if timing.token_times else timing.latency
    return timing


async def run_serve_benchmark(base_url: str, model: str | None, workload: list[SyntheticRequest],
                              request_rate: float, seed: int, api_key: str | None,
                              extra: ExtraBody | None = None,
                              every_body: dict[str, Any] | None = None) -> tuple[list[RequestTiming], float]:
    """Send the workload; ``every_body``: fields every request carries (its latency targets), ``extra``: fields
    a share of them carries."""
    rng = random.Random(seed)
    url = base_url.rstrip("/") + "/v1/completions"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None), limits=limits) as client:
        tasks = []
        start = time.perf_counter()
        for index, item in enumerate(workload):
            fields = {**(every_body or {}), **(extra.fields if extra is not None and extra.applies_to(index) else {})}
            tasks.append(asyncio.create_task(stream_request(client, url, model, item, headers, fields)))
            if request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(request_rate))
        timings = await asyncio.gather(*tasks)
        return list(timings), time.perf_counter() - start


async def _conversation(client: httpx.AsyncClient, base_url: str, model: str | None, conversation: Conversation,
                        headers: dict[str, str], start_delay: float) -> list[RequestTiming]:
    """One chat, closed loop: each turn resends the history (its answers tokenized by the server's /tokenize,
    as a chat client's text would be) and is sent when the previous answer is complete."""
    await asyncio.sleep(start_delay)
    url = base_url.rstrip("/") + "/v1/completions"
    answers: list[list[int]] = []
    timings = []
    for turn in range(len(conversation.questions)):
        item = SyntheticRequest(conversation.prompt(turn, answers), conversation.output_len)
        timing = await stream_request(client, url, model, item, headers)
        timings.append(timing)
        if timing.error is not None:
            break
        body = {"prompt": timing.text} | ({"model": model} if model else {})
        response = await client.post(base_url.rstrip("/") + "/tokenize", json=body, headers=headers)
        answers.append(response.json()["tokens"] if response.status_code == 200 and timing.text else [])
    return timings


async def run_conversations(base_url: str, model: str | None, conversations: list[Conversation],
                            request_rate: float, seed: int, api_key: str | None) -> tuple[list[RequestTiming], float]:
    """Conversations starting as a Poisson process at ``request_rate`` (inf: all at once), each closed loop."""
    rng = random.Random(seed)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    delays, at = [], 0.0
    for _ in conversations:
        delays.append(at)
        at += 0.0 if request_rate == float("inf") else rng.expovariate(request_rate)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None), limits=limits) as client:
        start = time.perf_counter()
        chats = await asyncio.gather(*(_conversation(client, base_url, model, conversation, headers, delay)
                                       for conversation, delay in zip(conversations, delays)))
        return [timing for chat in chats for timing in chat], time.perf_counter() - start


def summarize(timings: list[RequestTiming], elapsed: float, slo_ttft: float | None,
              slo_tpot: float | None) -> dict[str, Any]:
    done = [t for t in timings if t.error is None]
    itl = [b - a for t in done for a, b in zip(t.token_times, t.token_times[1:])]
    good = [t for t in done if met_targets(t.ttft, t.tpot, slo_ttft, slo_tpot)]
    result: dict[str, Any] = {
        "completed": len(done),
        "failed": len(timings) - len(done),
        "elapsed_s": elapsed,
        "requests_per_s": len(done) / elapsed,
        "output_tokens_per_s": sum(t.output_tokens for t in done) / elapsed,
        "prompt_tokens": sum(t.prompt_tokens for t in done),
        "prompt_tokens_cached": sum(t.cached_tokens for t in done),
        "prefix_cache_hit_rate": sum(t.cached_tokens for t in done) / max(sum(t.prompt_tokens for t in done), 1),
        "goodput_requests_per_s": len(good) / elapsed,
    }
    for name, values in (("ttft", [t.ttft for t in done]), ("tpot", [t.tpot for t in done if t.tpot is not None]),
                         ("itl", itl), ("e2e", [t.latency for t in done])):
        result[f"{name}_mean_s"] = mean(values)
        for q in (50, 90, 99):
            result[f"{name}_p{q}_s"] = percentile(values, q)
    refused = [t.latency for t in timings if t.status == 429]
    result["refused"] = len(refused)  # 429: a queue cap, or a deadline admission control saw would be missed
    result["refused_latency_p99_s"] = percentile(refused, 99)
    result["refused_latency_max_s"] = max(refused, default=math.nan)
    errors = [t.error for t in timings if t.error]
    if errors:
        result["first_error"] = errors[0]
    return result


def bench_serve(base_url: str, model: str | None, num_prompts: int, request_rate: float, seed: int,
                output_range: tuple[int, int], vocab_size: int, slo_ttft: float | None, slo_tpot: float | None,
                api_key: str | None, workload_kind: str = "longtail", extra: ExtraBody | None = None,
                num_turns: int = 6, num_system_prompts: int = 0, send_slo: bool = False) -> dict[str, Any]:
    """``workload_kind``: ``longtail`` (``bench throughput``'s requests), ``shared-prefix`` (its shared-prefix
    requests: 8 prefixes of 400-800 tokens, questions of 16-48, ``output_range[1]`` output tokens) or
    ``multi-turn`` (``num_prompts`` conversations of ``num_turns`` turns, ``output_range[1]`` tokens per answer,
    starting at ``request_rate`` conversations/s, with their own system prompts or ``num_system_prompts`` shared
    ones). ``extra``: fields sent with a share of the requests (not
    with ``multi-turn``, whose turns must stay plain answers to resend). ``send_slo``: every request carries
    ``slo_ttft``/``slo_tpot`` as its own targets (``ttft_slo_ms``, ``tpot_slo_ms``), for a server that schedules
    and sheds by them (``--scheduling-policy slo --admission-control``)."""
    if workload_kind == "multi-turn":
        if extra is not None:
            raise ValueError("--extra-body applies to the longtail and shared-prefix workloads, not multi-turn")
        conversations = multi_turn_workload(num_prompts, seed, vocab_size, num_turns, output_range[1],
                                            num_system_prompts)
        timings, elapsed = asyncio.run(run_conversations(base_url, model, conversations, request_rate, seed,
                                                         api_key))
        return {"workload": workload_kind, "request_rate": request_rate, "num_conversations": num_prompts,
                "num_turns": num_turns, "num_system_prompts": num_system_prompts,
                "seed": seed} | summarize(timings, elapsed, slo_ttft, slo_tpot)
    if workload_kind == "shared-prefix":
        workload = shared_prefix_workload(num_prompts, seed, vocab_size, output_len=output_range[1])
    elif workload_kind == "longtail":
        workload = long_tail_workload(num_prompts, seed, vocab_size, output_range=output_range)
    else:
        raise ValueError(f"--workload must be longtail or shared-prefix, got {workload_kind!r}")
    targets = {"ttft_slo_ms": slo_ttft and slo_ttft * 1000, "tpot_slo_ms": slo_tpot and slo_tpot * 1000}
    every_body = {k: v for k, v in targets.items() if v} if send_slo else None
    timings, elapsed = asyncio.run(run_serve_benchmark(base_url, model, workload, request_rate, seed, api_key,
                                                       extra, every_body))
    extra_fields = {} if extra is None else {"extra_body": json.dumps(extra.fields), "extra_fraction": extra.fraction}
    return {"workload": workload_kind, "request_rate": request_rate, "num_prompts": num_prompts,
            "seed": seed, "slo_ttft_s": slo_ttft, "slo_tpot_s": slo_tpot, "slo_sent": send_slo} | extra_fields \
        | summarize(timings, elapsed, slo_ttft, slo_tpot)


def print_serve(result: dict[str, Any]) -> None:
    print(format_table(["figure", "value"], [[k, v] for k, v in result.items()]))
