"""``conveyor simulate calibrate``: time the real engine's steps over a grid of shapes and fit a step profile.

The grid covers what the scheduler produces: decode batches from 1 to ``max_num_seqs`` over short,
medium and long contexts; prompts of 16 to a full token budget, alone and several in one step; steps
that mix a prompt chunk with running decodes; and a prompt longer than the budget, whose first chunk
samples nothing. Every step of every probe is one sample (its work, from the scheduler's output, and
its wall time around ``Engine.step``, which is what the simulator's clock stands for), so the decode
probes' own prompt steps count too. The fit is :func:`conveyor.sim.profile.fit_step_times`; the price of
a swapped token is not fitted (no grid step swaps) but taken from this machine's measured copy
bandwidth: a swap is a copy within the same memory, a read and a write. For a mixture of experts, each step's
distinct experts per layer are counted as the model ran it, and set beside the count the simulator expects
of uniform routing (sim.cost.expected_experts), by the step's tokens: the profile's ``fit["experts"]``. The
machine's read bandwidth is measured before and after the grid (``fit["read_gb_s"]``): on a host whose memory
changes speed from one minute to the next, a profile holds for the minutes that read as it did.

This module imports torch (through the engine); the simulator itself does not.
"""

from __future__ import annotations

import dataclasses
import functools
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

from conveyor.benchmarks.machine import ReadProbe
from conveyor.benchmarks.report import format_table
from conveyor.core.config import EngineConfig
from conveyor.core.sampling import SamplingParams
from conveyor.engine import Engine, RequestOutput
from conveyor.sim.cost import CostModel, StepWork, expected_experts, step_work
from conveyor.sim.hardware import load_hardware, machine_file
from conveyor.sim.profile import (
    StepProfile,
    fit_step_times,
    model_experts,
    new_profile,
    save_profile,
    this_machine,
)

DECODE_CONTEXTS = ((48, None), (320, 32), (1000, 8))  # (prompt tokens, largest batch decoded over it)
DECODE_OUTPUT = 10  # tokens each decode probe's requests produce: 9 decode steps
SHARED_PREFIX_KEYS = 1280  # the shared-prefix probes' prefixes, in all (4 of 320, or 1 of 1280)
SHARED_PREFIX_OWN = 32  # and each request's own tokens after its prefix
# Prompt steps: powers of two (the table's entries) and sizes between them, where the table interpolates.
PROMPT_SIZES = (16, 48, 64, 96, 128, 200, 256, 384, 512, 768, 1024, 1536, 2048)


@dataclass(frozen=True, slots=True)
class Probe:
    """Requests that join at given steps: ``(join step, prompt tokens, output tokens)`` each. With ``prefixes``
    (token counts), request ``i``'s prompt begins with prefix ``i % len(prefixes)``, the same tokens in every
    request that has it: prefix caching computes it once and the decodes share its blocks."""

    name: str
    requests: tuple[tuple[int, int, int], ...]
    prefixes: tuple[int, ...] = ()


def profiling_grid(max_num_seqs: int, token_budget: int, max_model_len: int = 1 << 30) -> list[Probe]:
    """The probes, for an engine of these limits (prompts cut to fit ``max_model_len`` with their outputs)."""
    probes = _grid(max_num_seqs, token_budget)
    return [dataclasses.replace(p, requests=tuple((join, min(prompt, max_model_len - output), output)
                                                  for join, prompt, output in p.requests)) for p in probes]


def _grid(max_num_seqs: int, token_budget: int) -> list[Probe]:
    batches = sorted({b for b in (1, 2, 4, 8, 16, 32, 64) if b <= max_num_seqs} | {max_num_seqs})
    probes = []
    for prompt, largest in DECODE_CONTEXTS:
        for batch in batches:
            if largest is None or batch <= largest:
                probes.append(Probe(f"decode {batch} x context {prompt}", ((0, prompt, DECODE_OUTPUT),) * batch))
    for tokens in PROMPT_SIZES:
        if tokens <= token_budget:
            probes.append(Probe(f"prompt of {tokens}", ((0, tokens, 1),)))
            if tokens in (128, 256, 512, 1024, 2048) and max_num_seqs >= 8:
                probes.append(Probe(f"8 prompts of {tokens // 8}", ((0, tokens // 8, 1),) * 8))
    mixed_batch = min(8, max_num_seqs - 2)
    if mixed_batch >= 1:
        probes.append(Probe(f"{mixed_batch} decodes + prompts joining", (
            *((0, 200, 14),) * mixed_batch, (4, min(512, token_budget), 2), (8, 96, 2))))
    probes.append(Probe("prompt over the budget + decodes", (
        (0, 64, 8), (0, 64, 8), (2, token_budget + token_budget // 2, 2))))
    probes.append(mixed_traffic(max_num_seqs))
    probes.extend(shared_prefix_probes(max_num_seqs))
    return probes


def shared_prefix_probes(max_num_seqs: int) -> list[Probe]:
    """Decodes whose prompts share a cached prefix (several prefixes, and one long one): the price of a key that
    an earlier decode of the step read too (``StepWork.shared_decode_blocks``)."""
    probes = []
    for batch, prefixes in ((min(16, max_num_seqs), 4), (min(8, max_num_seqs), 1)):
        if batch >= 2 * prefixes:
            length = SHARED_PREFIX_KEYS // prefixes
            shared = f"{prefixes} shared prefixes" if prefixes > 1 else "a shared prefix"
            probes.append(Probe(f"decode {batch} over {shared} of {length}",
                                ((0, length + SHARED_PREFIX_OWN, DECODE_OUTPUT),) * batch, (length,) * prefixes))
    return probes


def mixed_traffic(max_num_seqs: int, seed: int = 7) -> Probe:
    """Requests of random lengths joining at random steps: decode batches over mixed contexts, prompts of any
    size beside them, and a KV pool in the state traffic leaves it (blocks of many requests, interleaved)."""
    rng = random.Random(seed)
    count = min(32, 2 * max_num_seqs)
    return Probe(f"{count} requests joining at random", tuple(
        sorted((rng.randrange(60), rng.randint(16, 600), rng.randint(8, 64)) for _ in range(count))))


def time_probe(engine: Engine, probe: Probe, rng: random.Random,
               experts: list[tuple[int, float]] | None = None) -> list[tuple[StepWork, float]]:
    """Run the probe to its end; each step's work and wall seconds (steps with nothing scheduled left out). With
    ``experts``, each such step's tokens and the distinct experts a mixture-of-experts layer of it ran, on
    average over its layers, are appended there."""
    vocab = engine.model_config.vocab_size
    prefixes = [[rng.randrange(vocab // 8, vocab) for _ in range(length)] for length in probe.prefixes]
    pending = sorted((join, index, prompt, output) for index, (join, prompt, output) in enumerate(probe.requests))
    samples, step = [], 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][0] <= step:
            _, index, prompt_len, output_len = pending.pop(0)
            prefix = prefixes[index % len(prefixes)][:prompt_len] if prefixes else []
            prompt = prefix + [rng.randrange(vocab // 8, vocab) for _ in range(prompt_len - len(prefix))]
            engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True))
        _, work, seconds = timed_step(engine)
        if work.num_tokens:
            samples.append((work, seconds))
            touched = engine.executor.model.step_experts() if experts is not None else []
            if touched:
                experts.append((work.num_tokens, sum(touched) / len(touched)))
        step += 1
    return samples


def timed_step(engine: Engine) -> tuple[list[RequestOutput], StepWork, float]:
    """One engine step: its outputs, its work (from the scheduler's output) and its wall seconds around
    ``Engine.step``, which is what the simulator's clock stands for."""
    start = time.perf_counter()
    outputs = engine.step()
    seconds = time.perf_counter() - start
    work, _ = step_work(engine.core.last_output)
    return outputs, work, seconds


def swap_price(engine: Engine, dtype: str) -> float:
    """Seconds per swapped token: its K/V bytes read and written at this machine's measured bandwidth."""
    ensure_machine_figures()
    cost = CostModel(engine.model_config, load_hardware("cpu-local"), dtype, kv_element_bytes=engine.runner.kv_itemsize)
    return 2 * cost.kv_bytes_per_token / cost.hardware.memory_bandwidth


def ensure_machine_figures() -> None:
    """Measure this machine's bandwidth and GEMM throughput if ``conveyor roofline`` has not yet."""
    if machine_file().is_file():
        return
    from conveyor.benchmarks.machine import measure_machine

    print("measuring this machine's memory bandwidth and GEMM FLOP/s ...", flush=True)
    measure_machine().save()


def calibration_config(config: EngineConfig) -> EngineConfig:
    """The engine the grid runs on: the user's, with a pool that holds every probe (no preemption, no swap)."""
    pool = max(int(config.kv_cache_memory or 0), 2 << 30)
    return dataclasses.replace(config, num_kv_blocks=None, kv_cache_memory=pool)


def calibrate(config: EngineConfig, seed: int = 0) -> StepProfile:
    """Time the grid, fit, save this machine's profile, and print measured against predicted per probe."""
    started = time.perf_counter()
    engine = Engine(calibration_config(config))
    bandwidth = ReadProbe()
    read_before = bandwidth.measure()[0]
    rng = random.Random(seed)
    time_probe(engine, Probe("warm-up", ((0, 64, 4),) * 4 + ((0, 512, 1),)), rng)
    probes = profiling_grid(config.max_num_seqs, config.max_num_batched_tokens, engine.max_model_len)
    timed: list[tuple[Probe, list[tuple[StepWork, float]]]] = []
    touched: list[tuple[int, float]] = []
    for probe in probes:
        samples = time_probe(engine, probe, rng, touched)
        timed.append((probe, samples))
        print(f"{probe.name}: {len(samples)} steps, {sum(s for _, s in samples):.2f} s", flush=True)
    fitted = fit_step_times([sample for _, samples in timed for sample in samples], block_size=config.block_size,
                            experts=model_experts(engine.model_config))
    threads = engine.runner.num_threads
    machine = this_machine(threads, engine.runner.device)
    profile = new_profile(fitted, swap_price(engine, config.dtype), machine, engine.model_config, config.dtype,
                          config.block_size, engine.runner.kv_itemsize)
    price = functools.partial(profile.step_time, block_size=profile.block_size)
    profile = dataclasses.replace(profile, fit={**profile.fit, **_fit_report(price, timed),
                                               **experts_report(touched, profile.experts),
                                               "read_gb_s": gb_s_readings(read_before, bandwidth.measure()[0]),
                                               "seconds": round(time.perf_counter() - started, 1)})
    path = save_profile(profile, engine.model_config)
    print_profile(profile)
    print(f"calibrated in {profile.fit['seconds']:.0f} s; saved to {path}")
    return profile


def _fit_report(price: Callable[[StepWork], float], timed: list[tuple[Probe, list[tuple[StepWork, float]]]]) -> dict:
    errors = sorted(abs(price(w) / s - 1) for _, samples in timed for w, s in samples)
    return {"median_step_error": errors[len(errors) // 2], "p90_step_error": errors[int(len(errors) * 0.9)],
            "probes": [{"probe": p.name, "steps": len(samples), "measured_s": sum(s for _, s in samples),
                        "predicted_s": sum(price(w) for w, _ in samples)} for p, samples in timed]}


def experts_report(touched: list[tuple[int, float]], experts: tuple[int, int] | None) -> dict:
    """The distinct experts per layer the steps ran, by step tokens in powers of two (1, 2-3, 4-7, ...), beside
    what uniform routing gives at the bucket's mean tokens; empty for a dense model."""
    if experts is None or not touched:
        return {}
    buckets: dict[int, list[tuple[int, float]]] = {}
    for tokens, count in touched:
        buckets.setdefault(1 << (tokens.bit_length() - 1), []).append((tokens, count))
    rows = []
    for low, steps in sorted(buckets.items()):
        tokens = sum(t for t, _ in steps) / len(steps)
        rows.append({"tokens_from": low, "steps": len(steps), "mean_tokens": round(tokens, 1),
                     "measured": round(sum(c for _, c in steps) / len(steps), 2),
                     "expected": round(expected_experts(experts[0], experts[1], round(tokens)), 2)})
    return {"experts": rows}


def print_profile(profile: StepProfile) -> None:
    """The profile, and how well it predicts each probe (``fit["probes"]``, as saved)."""
    rows = [[p["probe"], p["steps"], p["measured_s"], p["predicted_s"],
             f"{p['predicted_s'] / p['measured_s'] - 1:+.1%}"] for p in profile.fit["probes"]]
    print(format_table(["probe (all its steps)", "steps", "measured s", "predicted s", "error"], rows))
    print(format_table(["tokens in the step", "dense part + fixed cost, ms"],
                       [[t, s * 1000] for t, s in zip(profile.dense_tokens, profile.dense_s)]))
    if profile.fit.get("experts"):
        print(format_table(["step tokens from", "steps", "mean tokens", "distinct experts per layer, measured",
                            "expected of uniform routing"],
                           [[r["tokens_from"], r["steps"], r["mean_tokens"], r["measured"], r["expected"]]
                            for r in profile.fit["experts"]]))
    print(f"per request {profile.per_sequence_s * 1e6:.0f} us, per sampled row {profile.per_sampled_row_s * 1e6:.0f} "
          f"us, per decode key {'/'.join(f'{k * 1e9:.0f}' for k in profile.per_decode_key_s)} ns (1, 2-3, 4-7, "
          f"8-15, 16+ decode rows), {shared_key_price(profile)}, per prompt query-key pair "
          f"{profile.per_prompt_pair_s * 1e9:.2f} ns, per swapped token {profile.per_swapped_token_s * 1e9:.0f} ns; "
          f"median step error {profile.fit['median_step_error']:.1%}, p90 {profile.fit['p90_step_error']:.1%}; "
          f"memory read {read_gb_s(profile)} GB/s before and after")


def gb_s_readings(*bytes_per_s: float) -> list[float]:
    """Bandwidth readings (bytes a second) as GB/s to a tenth, as a profile stores them and reports print them."""
    return [round(reading / 1e9, 1) for reading in bytes_per_s]


def read_gb_s(profile: StepProfile) -> str:
    """The read bandwidth measured around the profile's grid, as 'before-after' (older profiles: '?')."""
    return "-".join(str(gb) for gb in profile.fit.get("read_gb_s", ["?"]))


def shared_key_price(profile: StepProfile) -> str:
    price = profile.per_shared_decode_key_s
    return "a decode key read again at the others' price" if price is None else (
        f"per decode key read again {price * 1e9:.0f} ns")
