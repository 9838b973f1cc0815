"""Simulated traffic: when requests arrive, and how long their prompts and outputs are.

Arrivals and lengths are drawn from separate seeded streams, so the same
requests arrive at every request rate of a sweep, only sooner or later.
Length presets follow the mean lengths of the vLLM paper's workloads:
ShareGPT-like (161 prompt / 338 output tokens) and Alpaca-like (19.31 / 58.45).
"""

from __future__ import annotations

import csv
import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

LENGTH_PRESETS: dict[str, tuple[str, str]] = {
    "sharegpt": ("longtail:161", "longtail:338"),
    "alpaca": ("longtail:19.31", "longtail:58.45"),
}
LONG_TAIL_SIGMA = 1.0  # of the log-normal: the median is ~0.6x the mean, and 1 in 20 is over ~3x the mean
TRACE_FIELDS = ("arrival_time", "prompt_tokens", "output_tokens")  # and, optionally, priority


@dataclass(frozen=True, slots=True)
class WorkloadRequest:
    arrival_time: float  # seconds from the start
    prompt_len: int
    output_len: int
    priority: int = 0  # for --scheduling-policy priority: lower first
    shared_prefix_id: int = 0  # requests with the same id and shared_prefix_len > 0 start with the same tokens
    shared_prefix_len: int = 0  # leading prompt tokens shared with the others of its shared_prefix_id
    tenant: str = ""  # who it is served for: the fair policy's unit of share


@dataclass(frozen=True, slots=True)
class SenderShape:
    """Closed-loop clients of one tenant: ``senders`` of them from time 0, each sending its next request the
    moment its last one finishes, until ``until`` seconds (none is sent after it). A tenant that keeps N requests
    in flight whatever the server does, as ``bench/tenant_fairness.py``'s heavy tenant: its load follows the
    engine's pace, which no list of arrival times can. Every request has ``prompt_len`` tokens of its own and
    decodes ``output_len``."""

    tenant: str
    senders: int
    prompt_len: int
    output_len: int
    until: float = math.inf


@dataclass(frozen=True, slots=True)
class LengthDistribution:
    """How long prompts or outputs are; every synthetic workload (simulator and benchmarks) draws from one.

    - ``fixed``: always ``low``;
    - ``uniform``: ``low..high`` inclusive;
    - ``longtail``: log-normal whose *mean* is ``mean`` (shape ``sigma``), rounded, at least 1: the
      simulator's ShareGPT- and Alpaca-like presets, which are given by their means;
    - ``clipped``: log-normal whose *median* is ``median`` (shape ``sigma``), clipped to ``low..high`` and
      truncated: the benchmarks' workloads (``bench throughput``, ``bench serve``, W2), bounded so a real
      engine on this machine finishes them.
    """

    kind: str
    low: int = 1
    high: int = 1
    mean: float = 1.0
    median: float = 1.0
    sigma: float = LONG_TAIL_SIGMA

    @classmethod
    def clipped(cls, low: int, high: int, median: float, sigma: float = 0.9) -> LengthDistribution:
        return cls("clipped", low=low, high=high, median=median, sigma=sigma)

    def sample(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            return self.low
        if self.kind == "uniform":
            return rng.randint(self.low, self.high)
        if self.kind == "clipped":
            return int(min(max(rng.lognormvariate(math.log(self.median), self.sigma), self.low), self.high))
        mu = math.log(self.mean) - self.sigma**2 / 2  # so that the mean, not the median, is ``mean``
        return max(round(rng.lognormvariate(mu, self.sigma)), 1)


def parse_lengths(spec: str) -> LengthDistribution:
    """``"128"`` or ``"fixed:128"``, ``"uniform:16,512"``, ``"longtail:338"`` (the mean)."""
    kind, _, args = spec.partition(":") if ":" in spec else ("fixed", "", spec)
    try:
        numbers = [float(x) for x in args.split(",")]
        if kind == "fixed" and len(numbers) == 1 and numbers[0] >= 1:
            return LengthDistribution("fixed", low=int(numbers[0]))
        if kind == "uniform" and len(numbers) == 2 and 1 <= numbers[0] <= numbers[1]:
            return LengthDistribution("uniform", low=int(numbers[0]), high=int(numbers[1]))
        if kind == "longtail" and len(numbers) == 1 and numbers[0] >= 1:
            return LengthDistribution("longtail", mean=numbers[0])
    except ValueError:
        pass
    raise ValueError(f"lengths: {spec!r} is not N, fixed:N, uniform:LOW,HIGH or longtail:MEAN (all >= 1)")


def arrival_times(num_requests: int, rate: float, rng: random.Random, burstiness: float = 1.0) -> list[float]:
    """Gaps drawn from a gamma distribution of mean 1/rate, as vLLM's benchmarks do.

    ``burstiness`` is the gamma's shape: 1 is a Poisson process, below 1 burstier,
    above 1 more even. ``rate`` infinite: everyone arrives at once, at 0.
    """
    if rate <= 0 or burstiness <= 0:
        raise ValueError(f"request rate and burstiness must be > 0, got {rate} and {burstiness}")
    if math.isinf(rate):
        return [0.0] * num_requests
    times, now = [], 0.0
    for _ in range(num_requests):
        times.append(now)
        now += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
    return times


def synthetic_workload(
    num_requests: int,
    rate: float,
    prompt_lengths: LengthDistribution,
    output_lengths: LengthDistribution,
    seed: int = 0,
    burstiness: float = 1.0,
) -> list[WorkloadRequest]:
    lengths_rng = random.Random(f"{seed}:lengths")
    times = arrival_times(num_requests, rate, random.Random(f"{seed}:arrivals"), burstiness)
    return [
        WorkloadRequest(at, prompt_lengths.sample(lengths_rng), output_lengths.sample(lengths_rng)) for at in times
    ]


def shared_prefix_requests(
    num_requests: int,
    seed: int,
    num_prefixes: int = 8,
    prefix_range: tuple[int, int] = (400, 800),
    question_range: tuple[int, int] = (16, 48),
    output_len: int = 64,
) -> list[WorkloadRequest]:
    """Requests at once over ``num_prefixes`` shared prefixes (request ``i`` uses prefix ``i % num_prefixes``),
    each with a question of its own: the shape of ``bench throughput --workload shared-prefix``."""
    rng = random.Random(f"{seed}:shared-prefix-lengths")
    prefix_lens = [rng.randint(*prefix_range) for _ in range(num_prefixes)]
    requests = []
    for i in range(num_requests):
        prefix = i % num_prefixes
        prompt_len = prefix_lens[prefix] + rng.randint(*question_range)
        requests.append(WorkloadRequest(0.0, prompt_len, output_len, shared_prefix_id=prefix,
                                        shared_prefix_len=prefix_lens[prefix]))
    return requests


@dataclass(frozen=True, slots=True)
class ConversationShape:
    """A multi-turn chat's lengths: each turn resends the system prompt and every earlier question and answer,
    then its own question; the next turn is sent when the answer is complete."""

    system_len: int
    question_lens: tuple[int, ...]
    output_len: int
    arrival_time: float = 0.0
    system_id: int | None = None  # conversations with the same id share one system prompt; None: its own


def multi_turn_shapes(
    num_conversations: int,
    seed: int,
    num_turns: int = 6,
    system_range: tuple[int, int] = (200, 400),
    question_range: tuple[int, int] = (32, 96),
    output_len: int = 64,
    num_system_prompts: int = 0,
) -> list[ConversationShape]:
    """Conversations all starting at once: the shape of ``bench throughput --workload multi-turn``.

    ``num_system_prompts`` > 0: conversation ``c`` opens with shared system prompt ``c % num_system_prompts``
    (one chat application's instructions, sent by all its users), whose length is drawn once; 0: every
    conversation has its own."""
    if num_system_prompts < 0:
        raise ValueError(f"num_system_prompts must be >= 0, got {num_system_prompts}")
    rng = random.Random(f"{seed}:multi-turn-lengths")
    shared = random.Random(f"{seed}:multi-turn-system-prompts")
    shared_lens = [shared.randint(*system_range) for _ in range(num_system_prompts)]
    shapes = []
    for index in range(num_conversations):
        own_len = rng.randint(*system_range)
        questions = tuple(rng.randint(*question_range) for _ in range(num_turns))
        if num_system_prompts:
            system_id = index % num_system_prompts
            shapes.append(ConversationShape(shared_lens[system_id], questions, output_len, system_id=system_id))
        else:
            shapes.append(ConversationShape(own_len, questions, output_len))
    return shapes


def read_trace_file(path: str | Path) -> list[WorkloadRequest]:
    """A CSV (with a header row) or JSON-lines file of arrival_time, prompt_tokens, output_tokens and optionally
    priority; sorted by time."""
    path = Path(path)
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f)) if path.suffix == ".csv" else [json.loads(line) for line in f if line.strip()]
    requests = []
    for number, row in enumerate(rows, start=1):
        try:
            request = WorkloadRequest(
                float(row["arrival_time"]),
                int(row["prompt_tokens"]),
                int(row["output_tokens"]),
                int(row.get("priority") or 0),
            )
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"{path}: request {number} lacks numeric {', '.join(TRACE_FIELDS)}") from None
        if request.prompt_len < 1 or request.output_len < 1 or request.arrival_time < 0:
            raise ValueError(f"{path}: request {number} needs lengths >= 1 and a time >= 0, got {row}")
        requests.append(request)
    return sorted(requests, key=lambda r: r.arrival_time)


def write_trace_file(requests: list[WorkloadRequest], path: str | Path) -> None:
    """The JSON-lines form :func:`read_trace_file` reads."""
    with open(path, "w") as f:
        for r in requests:
            row = dict(zip(TRACE_FIELDS, (r.arrival_time, r.prompt_len, r.output_len)))
            f.write(json.dumps(row | ({"priority": r.priority} if r.priority else {})) + "\n")


def multi_tenant_requests(
    num_requests: int,
    rate: float,
    seed: int,
    num_tenants: int = 150,
    context_len: int = 6000,
    question_range: tuple[int, int] = (600, 1200),
    output_len: int = 256,
    burstiness: float = 1.0,
) -> list[WorkloadRequest]:
    """Requests from ``num_tenants`` tenants, each with a long context of its own (a system prompt, documents)
    that all its requests start with, then a question: the shape of llm-d's prefix-routing benchmark.

    Each request's tenant is drawn uniformly; arrivals are Poisson (or gamma, with ``burstiness``) at ``rate``.
    """
    if num_tenants < 1:
        raise ValueError(f"--num-tenants must be >= 1, got {num_tenants}")
    rng = random.Random(f"{seed}:multi-tenant")
    times = arrival_times(num_requests, rate, random.Random(f"{seed}:arrivals"), burstiness)
    requests = []
    for at in times:
        tenant = rng.randrange(num_tenants)
        prompt_len = context_len + rng.randint(*question_range)
        requests.append(WorkloadRequest(at, prompt_len, output_len, shared_prefix_id=tenant,
                                        shared_prefix_len=context_len, tenant=f"tenant-{tenant}"))
    return requests
