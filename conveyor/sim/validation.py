"""The validation workloads of the simulator, and the table of its errors: pure Python.

Six workloads, each exercising a different part of the model of a step and of the scheduler: long-tailed
requests all at once (W2's shape, smaller); Poisson arrivals at half and at nine tenths of the rate the
engine sustained on the first; requests over shared prefixes, with prefix caching; priorities arriving
faster than they are served in a small KV pool, so that important requests preempt others; and long
outputs all at once in a pool too small for them, preempting by swap. ``conveyor simulate validate``
(:mod:`conveyor.benchmarks.sim_validation`) runs each through the real engine and through the simulator.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from conveyor.sim.workload import LengthDistribution, WorkloadRequest, arrival_times, shared_prefix_requests

# Figure, its key, and how far the simulator may be off (None: reported, no bound).
FIGURES = (
    ("output tokens/s", "output_tokens_per_s", 0.10),
    ("mean TTFT s", "ttft_mean_s", 0.10),
    ("p90 TTFT s", "ttft_p90_s", 0.15),
    ("mean latency s", "latency_mean_s", 0.10),
    ("p90 latency s", "latency_p90_s", 0.15),
    ("preemptions", "preemptions", None),
    ("steps", "steps", None),
)
CASE_NAMES = ("longtail", "poisson-low", "poisson-high", "shared-prefix", "priority", "swap")


@dataclass(frozen=True, slots=True)
class ValidationCase:
    name: str
    description: str
    requests: tuple[WorkloadRequest, ...]
    overrides: dict[str, Any] = field(default_factory=dict)  # engine options of this case


def long_tail_requests(num: int, rng: random.Random, output: tuple[int, int, int] = (8, 128, 48),
                       arrivals: list[float] | None = None, priorities: bool = False) -> list[WorkloadRequest]:
    prompts = LengthDistribution.clipped(16, 512, 128)
    outputs = LengthDistribution.clipped(*output)
    times = arrivals or [0.0] * num
    return [WorkloadRequest(times[i], prompts.sample(rng), outputs.sample(rng),
                            priority=rng.randrange(3) if priorities else 0) for i in range(num)]


def validation_cases(num: int, seed: int, capacity: float, max_num_seqs: int) -> list[ValidationCase]:
    """The six workloads; Poisson rates are shares of ``capacity`` (requests/s the engine sustained at once)."""
    rng = lambda name: random.Random(f"{seed}:{name}")  # noqa: E731 - one seeded stream per case
    # Blocks: a third or so of what the requests would hold at once, and room for the longest one (48 blocks).
    small_pool = max(num * 3, 8 * max_num_seqs, 64)
    cases = [ValidationCase("longtail", f"{num} long-tailed requests at once", tuple(
        long_tail_requests(num, rng("longtail"))))]
    for name, share in (("poisson-low", 0.5), ("poisson-high", 0.9)):
        r = rng(name)
        cases.append(ValidationCase(name, f"Poisson arrivals at {share:g} x {capacity:.2f} req/s", tuple(
            long_tail_requests(num, r, arrivals=arrival_times(num, share * capacity, r)))))
    cases.append(ValidationCase("shared-prefix", f"{num} requests over 4 shared prefixes, prefix caching", tuple(
        shared_prefix_requests(num, seed, num_prefixes=4, prefix_range=(200, 400), output_len=48)),
        {"enable_prefix_caching": True}))
    r = rng("priority")
    cases.append(ValidationCase("priority", f"3 priorities at 1.5 x capacity, {small_pool} blocks", tuple(
        long_tail_requests(num, r, arrivals=arrival_times(num, 1.5 * capacity, r), priorities=True)),
        {"scheduling_policy": "priority", "num_kv_blocks": small_pool}))
    cases.append(ValidationCase("swap", f"long outputs at once, {small_pool} blocks, swap", tuple(
        long_tail_requests(num, rng("swap"), output=(32, 256, 128))),
        {"preemption_mode": "swap", "num_kv_blocks": small_pool}))
    return cases


def error(measured: float, predicted: float) -> float:
    return predicted / measured - 1 if measured else (0.0 if predicted == measured else float("inf"))
