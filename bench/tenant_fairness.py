"""Two tenants on the real engine: a heavy one that keeps a backlog well past the batch cap, a light one that
sends a short request every few seconds; first come, first served against ``fair`` (VTC), same sitting.

Part 1, the light tenant's wait: for each policy a fresh `conveyor serve` (the engine flags after ``--``, then
``--scheduling-policy``), warmed by a few requests; the heavy tenant (``user`` "heavy") keeps ``--heavy-inflight``
requests in flight for ``--seconds`` (each of ``--heavy-prompt`` random tokens, ``--heavy-output`` tokens
decoded), and the light tenant (``user`` "light") sends one request of ``--light-prompt`` tokens every
``--light-every`` seconds, streamed, its time to first token measured by the client. Printed: the light
tenant's TTFT p50 / p99 / max under each policy, and the ratio of the p99s (the aim: fair's at most a fifth of
fcfs's). With ``--repeats N``, N runs per policy, each on a fresh server, and the medians of their p99s.

The simulator's prediction of part 1: the same tenants (the heavy one as closed-loop senders, the light one's
requests at the same times) through the same scheduler on this machine's step profile (``conveyor simulate
calibrate``; without a current one the roofline prices the steps, which the line printed says), and its error
against each policy's measured p99 (the aim: within 15%; with ``--repeats``, in the median run). The profile times
the offline engine; what serving adds per token (the streams, and the clients sharing the machine) is measured on
each part-1 server before the light tenant comes: the heavy tenant alone for ``--overhead-seconds``, its output
tokens a second against the simulator's for the same run, the difference in seconds per token added to every
simulated step per token it samples; and the clients' mean TTFT in that run less the engine's own (its /metrics
histogram, over the same requests), the time a request spends outside the engine (the HTTP request's way in, the
first token's way out), added to every simulated request's TTFT.

Part 2, weighted shares: ``fair`` with ``--tenant-weights {"a": 2, "b": 1}``, both tenants backlogged (each
``--heavy-inflight`` in flight) for ``--seconds``; the tokens each was served over the run, counted as VTC
counts them (a prompt token 1, an output token 2; from the server's per-tenant counters), and their split
against the weights' 2:1 (the aim: within 10%).

    .venv/bin/python bench/tenant_fairness.py [--seconds 60] -- --max-num-seqs 16
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import random
import statistics
import sys
import time
from collections.abc import AsyncIterator

import httpx

from conveyor.benchmarks.local_server import local_server, save_results, server_script_parser
from conveyor.benchmarks.serve import stream_request
from conveyor.benchmarks.workload import SyntheticRequest
from conveyor.observe.figures import percentile

WARM_REQUESTS = 8  # each server's first requests, before anything is measured


def _prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(1000, 40000) for _ in range(length)]


async def _request(client: httpx.AsyncClient, base: str, user: str, prompt: list[int], max_tokens: int) -> float:
    """One streamed completion for ``user``; its time to first token (seconds)."""
    timing = await stream_request(client, f"{base}/v1/completions", None, SyntheticRequest(prompt, max_tokens), {},
                                  {"user": user})
    if timing.error is not None:
        raise RuntimeError(timing.error)
    return timing.ttft


async def _backlog(client: httpx.AsyncClient, base: str, user: str, args: argparse.Namespace, until: float,
                   seed: int) -> list[float]:
    """``--heavy-inflight`` closed-loop senders for ``user`` until ``until``; every request's TTFT (client's)."""
    waits: list[float] = []

    async def sender(index: int) -> None:
        rng = random.Random(seed * 1000 + index)
        while time.perf_counter() < until:
            waits.append(await _request(client, base, user, _prompt(rng, args.heavy_prompt), args.heavy_output))

    await asyncio.gather(*(sender(i) for i in range(args.heavy_inflight)))
    return waits


@contextlib.asynccontextmanager
async def _warmed_client(base: str) -> AsyncIterator[httpx.AsyncClient]:
    """A client without connection limits, on a server warmed by a few requests of tenant "warm"."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None), limits=limits) as client:
        warm = random.Random(99)
        await asyncio.gather(*(_request(client, base, "warm", _prompt(warm, 64), 8) for _ in range(WARM_REQUESTS)))
        yield client


@dataclasses.dataclass(frozen=True)
class ServingOverheadRun:
    """The heavy tenant alone on a part-1 server, before the light tenant comes: what the simulator's serving
    overhead is fitted to."""

    output_tokens_per_s: float
    seconds_per_request: float  # the clients' mean TTFT less the engine's (its /metrics histogram), same requests


async def light_tenant_wait(base: str, args: argparse.Namespace) -> tuple[list[float], ServingOverheadRun]:
    """Part 1 on one server: the heavy tenant alone for ``--overhead-seconds`` (the serving overhead's run),
    then the light tenant's TTFTs while the heavy tenant keeps its backlog."""
    async with _warmed_client(base) as client:
        engine_before = await _engine_ttft_after(base, WARM_REQUESTS)  # the server is fresh: the warm-up's alone
        before, start = _generated(base), time.perf_counter()
        heavy_waits = await _backlog(client, base, "heavy", args, start + args.overhead_seconds, seed=4)
        alone = ServingOverheadRun((_generated(base) - before) / (time.perf_counter() - start),
                                   await _outside_engine(base, heavy_waits, engine_before))
        until = time.perf_counter() + args.seconds
        heavy = asyncio.create_task(_backlog(client, base, "heavy", args, until, seed=1))
        await asyncio.sleep(args.light_every)  # the backlog builds first
        rng, light = random.Random(7), []
        while time.perf_counter() < until:
            light.append(asyncio.create_task(_request(client, base, "light", _prompt(rng, args.light_prompt), 8)))
            await asyncio.sleep(args.light_every)
        waits = list(await asyncio.gather(*light))
        await heavy
    return waits, alone


def _samples(base: str, *names: str) -> list[tuple[str, dict[str, str], float]]:
    """Every sample of the counters ``names`` in one read of the server's /metrics: name, labels, value."""
    samples = []
    for line in httpx.get(f"{base}/metrics", timeout=10).text.splitlines():
        name, _, rest = line.partition("{")
        if name in names:
            labels, value = rest.rsplit("} ", 1)
            samples.append((name, {k: v.strip('"') for k, v in (part.split("=", 1) for part in labels.split(","))},
                            float(value)))
    return samples


def _engine_ttft(base: str) -> tuple[float, float]:
    """The server's TTFT histogram so far, as the engine measures it (from the request's hand-over to the engine,
    after the HTTP request was read, to its first token): the sum of its observations and their count."""
    sums = dict.fromkeys(("conveyor:time_to_first_token_seconds_sum", "conveyor:time_to_first_token_seconds_count"),
                         0.0)
    for name, _, value in _samples(base, *sums):
        sums[name] += value
    return sums["conveyor:time_to_first_token_seconds_sum"], sums["conveyor:time_to_first_token_seconds_count"]


async def _engine_ttft_after(base: str, num_requests: int, before: tuple[float, float] = (0.0, 0.0)
                             ) -> tuple[float, float]:
    """The engine's TTFT histogram (``_engine_ttft``) once it counts ``num_requests`` more than ``before``: the
    server records a request as its stream ends, so its count may trail the client's for a moment."""
    for _ in range(50):
        now = _engine_ttft(base)
        if now[1] - before[1] >= num_requests:
            break
        await asyncio.sleep(0.02)
    if now[1] - before[1] != num_requests:
        raise RuntimeError(f"the server counted {now[1] - before[1]:.0f} first tokens for {num_requests} requests")
    return now


async def _outside_engine(base: str, client_waits: list[float], engine_before: tuple[float, float]) -> float:
    """Mean seconds a request's TTFT at the client exceeds the engine's for ``client_waits``' requests, the
    only ones the server finished since ``engine_before``: the HTTP request's way in and the first token's way
    out."""
    engine_sum = (await _engine_ttft_after(base, len(client_waits), engine_before))[0] - engine_before[0]
    return max(0.0, (sum(client_waits) - engine_sum) / len(client_waits))


def _generated(base: str) -> float:
    """Output tokens the server has generated so far."""
    return sum(value for _, _, value in _samples(base, "conveyor:generation_tokens_total"))


def light_arrivals(args: argparse.Namespace) -> list[float]:
    """When the light tenant sends, seconds from the heavy tenant's start: every ``--light-every`` from the
    first until ``--seconds`` (what ``light_tenant_wait`` does on the wall clock)."""
    return [args.light_every * k for k in range(1, int(args.seconds / args.light_every) + 1)
            if args.light_every * k < args.seconds]


class Simulated:
    """The benchmark's runs in the simulator, with the engine configuration `conveyor serve` builds from the same
    flags, its steps priced by this machine's profile (plus ``serving_s_per_token`` once it is fitted)."""

    def __init__(self, args: argparse.Namespace) -> None:
        from conveyor.entrypoints.args import engine_config
        from conveyor.entrypoints.cli import build_parser
        from conveyor.model.weights.paths import resolve_model
        from conveyor.sim.hardware import load_hardware, load_model_config
        from conveyor.sim.profile import step_cost_model

        self.args = args
        self.config = engine_config(build_parser().parse_args(["serve", *args.engine_flags]))
        model = load_model_config(str(resolve_model(self.config.model)))
        self.profiled, self.priced_by = step_cost_model(model, load_hardware("cpu-local"), self.config.dtype,
                                                        threads=self.config.num_threads,
                                                        kv_element_bytes=self.config.kv_cache_element_bytes(
                                                            model.gguf_file))
        self.cost = self.profiled

    def run(self, policy: str, light: bool, until: float) -> dict:
        from conveyor.sim.simulator import simulate
        from conveyor.sim.workload import SenderShape, WorkloadRequest

        args = self.args
        config = dataclasses.replace(self.config, scheduling_policy=policy)
        arrivals = [WorkloadRequest(at, args.light_prompt, 8, tenant="light") for at in light_arrivals(args)]
        heavy = SenderShape("heavy", args.heavy_inflight, args.heavy_prompt, args.heavy_output, until=until)
        return simulate(config, self.cost, arrivals if light else [], senders=[heavy])[0]

    def fit_serving_overhead(self, alone: ServingOverheadRun) -> tuple[float, float]:
        """What serving adds, from the heavy tenant alone: per token, its output tokens a second measured against
        simulated on the profile alone; per request, as measured. The later runs use both. Returns the seconds a
        token, and the rate the simulator then gives."""
        from conveyor.sim.cost import with_serving_overhead

        self.cost = self.profiled
        simulated = self.run("fcfs", light=False, until=self.args.overhead_seconds)["output_tokens_per_s"]
        seconds = max(0.0, 1 / alone.output_tokens_per_s - 1 / simulated)
        self.cost = with_serving_overhead(self.profiled, seconds, alone.seconds_per_request)
        return seconds, self.run("fcfs", light=False, until=self.args.overhead_seconds)["output_tokens_per_s"]


def light_tenant_part(args: argparse.Namespace, policy: str, simulated: Simulated) -> dict[str, object]:
    """Part 1 under ``policy``: measured on a fresh server, then predicted by the simulator with the serving
    overhead fitted from that server's own heavy-alone run (the machine's pace drifts within a sitting)."""
    with local_server([*args.engine_flags, "--scheduling-policy", policy]) as base:
        waits, alone = asyncio.run(light_tenant_wait(base, args))
    result: dict[str, object] = {"light_ttft_p50_s": statistics.median(waits), "light_ttft_p99_s":
                                 percentile(waits, 99), "light_ttft_max_s": max(waits), "light_requests": len(waits)}
    print(f"{policy}: light tenant TTFT p50 {result['light_ttft_p50_s']:.3f} s, p99 {result['light_ttft_p99_s']:.3f} s "
          f"over {len(waits)} requests", flush=True)
    overhead, check = simulated.fit_serving_overhead(alone)
    predicted = simulated.run(policy, light=True, until=args.seconds)["tenants"]["light"]
    off = predicted["ttft_p99_s"] / result["light_ttft_p99_s"] - 1
    result["serving_overhead"] = {"heavy_alone_tokens_per_s": alone.output_tokens_per_s, "seconds_per_token":
                                  overhead, "simulated_tokens_per_s": check,
                                  "seconds_per_request": alone.seconds_per_request}
    result["simulated"] = predicted
    print(f"  heavy tenant alone first: {alone.output_tokens_per_s:.1f} output tok/s, so serving adds "
          f"{overhead * 1e3:.3f} ms a token (the simulator then gives {check:.1f}), and "
          f"{alone.seconds_per_request * 1e3:.1f} ms a request outside the engine; simulated: light tenant TTFT "
          f"p50 {predicted['ttft_p50_s']:.3f} s, "
          f"p99 {predicted['ttft_p99_s']:.3f} s ({off * 100:+.1f}% of the measured p99; the aim: within 15%)",
          flush=True)
    return result


def median_run(policy: str, runs: list[dict]) -> dict[str, object]:
    """Several part-1 runs of ``policy``, each on a fresh server with its own serving overhead: the median of the
    runs' errors (each prediction against its own server's measurement, the aim), and beside it the medians of the
    measured and of the simulated p99s taken apart (which pair one server's prediction with another's measurement
    where the machine's pace moved between them). One run's p99 moves by a fifth with the machine's pace."""
    measured = statistics.median(run["light_ttft_p99_s"] for run in runs)
    predicted = statistics.median(run["simulated"]["ttft_p99_s"] for run in runs)
    error = statistics.median(run["simulated"]["ttft_p99_s"] / run["light_ttft_p99_s"] - 1 for run in runs)
    print(f"{policy}, {len(runs)} runs: the simulator's p99 off by {error * 100:+.1f}% in the median run (the aim: "
          f"within 15%); medians apart: light tenant TTFT p99 {measured:.3f} s, simulated {predicted:.3f} s "
          f"({(predicted / measured - 1) * 100:+.1f}%)", flush=True)
    return {"light_ttft_p99_s": measured, "simulated_ttft_p99_s": predicted, "simulated_off_by_median": error,
            "runs": runs}


def _tenant_counters(base: str) -> dict[str, float]:
    """VTC-weighted tokens served per tenant so far (a prompt token 1, an output token 2), from /metrics."""
    weights = {"conveyor:tenant_prompt_tokens_total": 1, "conveyor:tenant_generation_tokens_total": 2}
    served: dict[str, float] = {}
    for name, labels, value in _samples(base, *weights):
        served[labels["tenant"]] = served.get(labels["tenant"], 0.0) + weights[name] * value
    return served


async def weighted_shares(base: str, args: argparse.Namespace) -> dict[str, float]:
    """Part 2 on one server: both tenants backlogged; the tokens each was served during the run."""
    async with _warmed_client(base) as client:
        before = _tenant_counters(base)
        until = time.perf_counter() + args.seconds
        await asyncio.gather(_backlog(client, base, "a", args, until, seed=2),
                             _backlog(client, base, "b", args, until, seed=3))
        after = _tenant_counters(base)
    return {tenant: after.get(tenant, 0.0) - before.get(tenant, 0.0) for tenant in ("a", "b")}


def main() -> int:
    parser = server_script_parser(__doc__)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--heavy-inflight", type=int, default=64)
    parser.add_argument("--heavy-prompt", type=int, default=128)
    parser.add_argument("--heavy-output", type=int, default=64)
    parser.add_argument("--light-every", type=float, default=2.0)
    parser.add_argument("--light-prompt", type=int, default=32)
    parser.add_argument("--overhead-seconds", type=float, default=20.0)
    parser.add_argument("--repeats", type=int, default=1, help="part-1 runs per policy (medians compared)")
    args = parser.parse_args()
    results: dict[str, object] = {}
    simulated = Simulated(args)
    print(f"the simulator's steps priced by the {simulated.priced_by}", flush=True)
    for policy in ("fcfs", "fair"):
        runs = [light_tenant_part(args, policy, simulated) for _ in range(args.repeats)]
        results[policy] = runs[0] if args.repeats == 1 else median_run(policy, runs)
    ratio = results["fair"]["light_ttft_p99_s"] / results["fcfs"]["light_ttft_p99_s"]
    print(f"light tenant's TTFT p99, fair / fcfs: {ratio:.3f} (the aim: <= 0.2)")
    weights = '{"a": 2, "b": 1}'
    with local_server([*args.engine_flags, "--scheduling-policy", "fair", "--tenant-weights", weights]) as base:
        served = asyncio.run(weighted_shares(base, args))
    share = served["a"] / (served["a"] + served["b"])
    results["weighted"] = {"weights": json.loads(weights), "served": served, "share_a": share}
    print(f"weights 2:1, both backlogged: served a {served['a']:.0f}, b {served['b']:.0f} (VTC tokens); a's share "
          f"{share:.3f} against 0.667 ({(share / (2 / 3) - 1) * 100:+.1f}%)")
    save_results(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
