"""Fit cpu-local's efficiencies and overheads to the real engine, then check the simulator against it.

The real engine (on the default model, unless told otherwise) times a few
step shapes: decodes at several batch sizes, which the weight reads bound;
decodes over long contexts, which attention's K/V reads bound; and one long
prompt chunk, which the arithmetic bounds. The fit searches a grid of FLOP,
bandwidth and attention efficiencies and, for each, solves the fixed and
per-request overheads by least squares on relative error; the best fit is
saved next to the machine figures, where ``cpu-local`` reads it.

The validation then runs one seeded workload through the real engine and
through the simulator and prints both, with the error of each figure.
This module imports torch (through the engine); the rest of the simulator does not.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import time
from dataclasses import dataclass
from typing import Any

from conveyor.bench.decode import measure_decode
from conveyor.bench.report import format_table
from conveyor.bench.throughput import WorkloadSpec, run_throughput
from conveyor.bench.workload import long_tail_workload
from conveyor.core.config import EngineConfig
from conveyor.core.model_config import ModelConfig
from conveyor.core.sampling import SamplingParams
from conveyor.engine import Engine
from conveyor.sim.cost import CostModel, StepWork, chunk_attention_pairs
from conveyor.sim.hardware import CALIBRATED_FIELDS, HardwareSpec, calibration_file, load_hardware, machine_file
from conveyor.sim.simulator import simulate
from conveyor.sim.workload import WorkloadRequest

# A coarse grid (25% apart) of FLOP, bandwidth and attention efficiencies, then a fine one (2.5%) near the best.
EFFICIENCY_GRID = [0.01 * 1.25**i for i in range(24)]  # 0.01 .. ~1.7
ATTENTION_GRID = [0.001 * 1.25**i for i in range(35)]  # 0.001 .. ~2
FINE_STEPS = [1.025**i for i in range(-6, 7)]
WARMUP_DECODES = 2  # measure_decode's warm-up steps before timing


@dataclass(frozen=True, slots=True)
class Measurement:
    name: str
    work: StepWork
    seconds: float


def ensure_machine_figures() -> None:
    """Measure this machine's bandwidth and GEMM throughput if ``conveyor roofline`` has not yet."""
    if machine_file().is_file():
        return
    from conveyor.bench.machine import measure_machine

    print("measuring this machine's memory bandwidth and GEMM FLOP/s ...", flush=True)
    measure_machine().save()


def measure_steps(
    engine: Engine,
    batch_sizes: list[int],
    prompt_len: int,
    steps: int,
    prefill_len: int,
    long_context: tuple[int, int] = (4, 512),
    seed: int = 0,
) -> list[Measurement]:
    """Step times of decodes at each batch size after ``prompt_len`` tokens, of decodes at batch
    ``long_context[0]`` after ``long_context[1]`` tokens, and of one prompt chunk of ``prefill_len`` tokens."""
    shapes = [(batch, prompt_len) for batch in batch_sizes] + [long_context]
    measurements = []
    for batch, prompt in shapes:
        context = prompt + WARMUP_DECODES + steps // 2 + 1  # each row's keys, mid-way through the timed steps
        seconds = batch / measure_decode(engine, batch, prompt, steps, seed)
        work = StepWork(batch, batch, batch, batch * context, batch * context)
        measurements.append(Measurement(f"decode, batch {batch}, context {context}", work, seconds))
        print(f"decode at batch {batch}, context {context}: {seconds * 1000:.1f} ms/step", flush=True)
    seconds = _prefill_seconds(engine, prefill_len, seed)
    work = StepWork(1, prefill_len, 1, chunk_attention_pairs(0, prefill_len), prefill_len)
    measurements.append(Measurement(f"prefill, {prefill_len} tokens", work, seconds))
    print(f"prefill of {prefill_len} tokens: {seconds * 1000:.1f} ms", flush=True)
    return measurements


def _prefill_seconds(engine: Engine, prefill_len: int, seed: int, repeats: int = 2) -> float:
    """Best of ``repeats`` steps that each compute one whole prompt (and sample its first token)."""
    vocab = engine.model_config.vocab_size
    best = math.inf
    for repeat in range(repeats + 1):  # the first is a warm-up
        prompt = [(seed + repeat * 7919 + i * 104729) % (vocab // 2) + vocab // 4 for i in range(prefill_len)]
        engine.add_request(prompt, SamplingParams(max_tokens=1, ignore_eos=True), f"prefill-{repeat}")
        start = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        if repeat:
            best = min(best, time.perf_counter() - start)
    return best


def fit(model: ModelConfig, hardware: HardwareSpec, dtype: str, measurements: list[Measurement]) -> dict[str, float]:
    """The efficiencies and overheads that best predict the measured step times (least relative error)."""
    coarse = _search(model, hardware, dtype, measurements, EFFICIENCY_GRID, EFFICIENCY_GRID, ATTENTION_GRID)
    fine = [[coarse[name] * f for f in FINE_STEPS] for name in CALIBRATED_FIELDS[:3]]
    return _search(model, hardware, dtype, measurements, *fine)


def _search(
    model: ModelConfig,
    hardware: HardwareSpec,
    dtype: str,
    measurements: list[Measurement],
    flops_grid: list[float],
    bandwidth_grid: list[float],
    attention_grid: list[float],
) -> dict[str, float]:
    best: tuple[float, dict[str, float]] = (math.inf, {})
    for efficiencies in itertools.product(flops_grid, bandwidth_grid, attention_grid):
        trial = dataclasses.replace(
            hardware, **dict(zip(CALIBRATED_FIELDS, efficiencies)), step_overhead_s=0.0, per_sequence_overhead_s=0.0
        )
        cost = CostModel(model, trial, dtype)
        bare = [cost.step_time(m.work) for m in measurements]
        step_overhead, per_sequence = _fit_overheads(measurements, bare)
        predicted = [b + step_overhead + per_sequence * m.work.num_seqs for b, m in zip(bare, measurements)]
        error = sum(((p - m.seconds) / m.seconds) ** 2 for p, m in zip(predicted, measurements))
        if error < best[0]:
            best = (error, dict(zip(CALIBRATED_FIELDS, (*efficiencies, step_overhead, per_sequence))))
    return best[1]


def _fit_overheads(measurements: list[Measurement], bare: list[float]) -> tuple[float, float]:
    """Least squares, on relative error, of (measured - bare) = step + per_sequence * num_seqs; both >= 0."""
    rows = [(1 / m.seconds, m.work.num_seqs / m.seconds, (m.seconds - b) / m.seconds) for m, b in zip(measurements,
                                                                                                      bare)]
    a11 = sum(x * x for x, _, _ in rows)
    a12 = sum(x * y for x, y, _ in rows)
    a22 = sum(y * y for _, y, _ in rows)
    b1 = sum(x * r for x, _, r in rows)
    b2 = sum(y * r for _, y, r in rows)
    det = a11 * a22 - a12 * a12
    if det > 0:
        step, per_sequence = (b1 * a22 - b2 * a12) / det, (a11 * b2 - a12 * b1) / det
        if step >= 0 and per_sequence >= 0:
            return step, per_sequence
    # One of them would be negative: fit each alone and keep the better.
    step_only = (max(b1 / a11, 0.0), 0.0)
    per_sequence_only = (0.0, max(b2 / a22, 0.0))
    return min((step_only, per_sequence_only), key=lambda c: sum((r - c[0] * x - c[1] * y) ** 2 for x, y, r in rows))


def save_calibration(fitted: dict[str, float], model: str, dtype: str, measurements: list[Measurement],
                     predicted: list[float]) -> None:
    record = {
        **fitted,
        "model": model,
        "dtype": dtype,
        "fitted_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "measurements": [
            {"shape": m.name, "measured_s": m.seconds, "predicted_s": p} for m, p in zip(measurements, predicted)
        ],
    }
    path = calibration_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2) + "\n")


def calibrate(
    config: EngineConfig,
    batch_sizes: list[int],
    prompt_len: int,
    steps: int,
    prefill_len: int,
    long_context: tuple[int, int] = (4, 512),
) -> None:
    """Measure, fit, save, and print measured against predicted step times."""
    ensure_machine_figures()
    shapes_config = dataclasses.replace(
        config,
        max_num_seqs=max(config.max_num_seqs, *batch_sizes, long_context[0]),
        max_num_batched_tokens=max(config.max_num_batched_tokens, prefill_len, max(batch_sizes) * prompt_len),
    )
    engine = Engine(shapes_config)
    measurements = measure_steps(engine, batch_sizes, prompt_len, steps, prefill_len, long_context)
    hardware = load_hardware("cpu-local")
    fitted = fit(engine.model_config, hardware, config.dtype, measurements)
    cost = CostModel(engine.model_config, dataclasses.replace(hardware, **fitted), config.dtype)
    predicted = [cost.step_time(m.work) for m in measurements]
    save_calibration(fitted, str(engine.model_path), config.dtype, measurements, predicted)
    print(format_table(
        ["shape", "measured ms", "predicted ms", "error"],
        [[m.name, m.seconds * 1000, p * 1000, f"{p / m.seconds - 1:+.1%}"] for m, p in zip(measurements, predicted)],
    ))
    print("fitted: " + ", ".join(f"{name} {value:.4g}" for name, value in fitted.items()))
    print(f"saved to {calibration_file()}")


VALIDATED_FIGURES = {
    "output tokens/s": "output_tokens_per_s",
    "mean TTFT s": "ttft_mean_s",
    "mean latency s": "latency_mean_s",
    "p99 latency s": "latency_p99_s",
    "steps": "steps",
}


def validate(config: EngineConfig, num_prompts: int, seed: int, output_range: tuple[int, int]) -> dict[str, Any]:
    """The same seeded workload through the real engine and the calibrated simulator.

    Returns both results and both traces (``measured_trace``, ``predicted_trace``): the scheduler makes
    the same decisions in both, so the traces differ only in how long each step took.
    """
    engine = Engine(config)
    measured = run_throughput(engine, WorkloadSpec(num_prompts=num_prompts, seed=seed, output_range=output_range))
    synthetic = long_tail_workload(num_prompts, seed, engine.model_config.vocab_size, output_range=output_range)
    workload = [WorkloadRequest(0.0, len(r.prompt_token_ids), r.output_len) for r in synthetic]
    cost = CostModel(engine.model_config, load_hardware("cpu-local"), config.dtype)
    predicted, predicted_trace = simulate(config, cost, workload, record_trace=True)
    rows = [
        [label, measured[key], predicted[key], f"{predicted[key] / measured[key] - 1:+.1%}"]
        for label, key in VALIDATED_FIGURES.items()
    ]
    print(format_table(["figure", "real engine", "simulator", "error"], rows))
    return {"measured": measured, "predicted": predicted, "measured_trace": engine.trace,
            "predicted_trace": predicted_trace}
