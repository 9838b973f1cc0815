"""``conveyor roofline``: the seed's first section as a measurement on this machine.

One decode step reads every weight once and multiplies it by the batch, so
its arithmetic intensity (FLOP per byte moved) grows about linearly with the
batch size until the step stops being bound by memory bandwidth and becomes
bound by compute. For each batch size this computes the step's FLOPs and
bytes (weights, K/V read, K/V written) from the loaded model's shape with
the simulator's cost model, the fastest the step could run on this machine
(its measured bandwidth and GEMM throughput), and the engine's real speed at
the same point.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from conveyor.benchmarks.decode import decode_slices, measure_decode
from conveyor.benchmarks.machine import MachineFigures, ReadProbe
from conveyor.benchmarks.report import format_table
from conveyor.core.formats import WeightFormat
from conveyor.core.model_config import ModelConfig
from conveyor.engine import Engine
from conveyor.model.quant.kernel_choice import KernelChoice
from conveyor.sim.cost import CostModel
from conveyor.sim.hardware import HardwareSpec

SLICES = 4  # runs of --steps steps per measured batch, with the machine's bandwidth read between them


@dataclass(frozen=True, slots=True)
class RooflinePoint:
    batch_size: int
    context_len: int
    flops: float  # per decode step
    bytes_moved: float  # per decode step: weights + K/V read + K/V written
    bound_tokens_per_s: float  # the machine's limit for this step
    measured_tokens_per_s: float | None = None
    read_bandwidth: float | None = None  # bytes/s: the roof read again around the measurement, which the bound uses

    @property
    def intensity(self) -> float:
        return self.flops / self.bytes_moved

    @property
    def share_of_bound(self) -> float | None:
        if self.measured_tokens_per_s is None:
            return None
        return self.measured_tokens_per_s / self.bound_tokens_per_s


def machine_cost_model(model: ModelConfig, machine: MachineFigures, weights: WeightFormat | None = None,
                       kv_element_bytes: int | None = None) -> CostModel:
    """The cost model at this machine's measured peaks, with no efficiency loss and no overhead: the bound, for
    weights stored as ``weights`` (None: in the machine figures' dtype) and K/V elements of ``kv_element_bytes``
    (None: that dtype's). Quantized weights are multiplied by the int8 kernels, so their compute roof is those
    kernels' rate where it was measured."""
    spec = HardwareSpec(
        name="this machine",
        peak_flops={machine.dtype: compute_roof(machine, weights)},
        memory_bandwidth=machine.memory_bandwidth,
        memory_capacity=0,
        host_link_bandwidth=machine.memory_bandwidth,
        default_dtype=machine.dtype,
        flops_efficiency=1.0,
        bandwidth_efficiency=1.0,
        step_overhead_s=0.0,
    )
    return CostModel(model, spec, machine.dtype, weights=weights, kv_element_bytes=kv_element_bytes)


def compute_roof(machine: MachineFigures, weights: WeightFormat | None) -> float:
    """Operations/s the step's products can reach: the int8 kernels' for quantized weights, else the GEMM's."""
    if weights is not None and weights.quantized and machine.int8_ops:
        return machine.int8_ops
    return machine.gemm_flops


def decode_point(cost: CostModel, batch_size: int, context_len: int) -> RooflinePoint:
    """Work and bound of a step in which ``batch_size`` requests each add one token after ``context_len``."""
    keys = batch_size * context_len
    flops = (
        batch_size * (cost.dense_flops_per_token + cost.lm_head_flops_per_row)
        + keys * cost.attention_flops_per_pair
    )
    moved = cost.weights_read(batch_size) + cost.lm_head_bytes + (keys + batch_size) * cost.kv_bytes_per_token
    return RooflinePoint(batch_size, context_len, flops, moved, batch_size / cost.decode_time(batch_size, keys))


def run_roofline(
    engine: Engine,
    machine: MachineFigures,
    batch_sizes: list[int],
    context_lens: list[int],
    measured_context_len: int,
    steps: int,
    seed: int = 0,
    probe: ReadProbe | None = None,
) -> list[RooflinePoint]:
    """Bounds at every (batch, context); the engine measured at ``measured_context_len``. With a ``probe``,
    the bandwidth roof is read again around each run of steps measured and that run is held against what was
    read (_measured_point): the machine's bandwidth drifts, and a roof read minutes earlier can be half off."""
    cost = machine_cost_model(engine.model_config, machine, engine.runner.weight_format, engine.runner.kv_itemsize)
    points = []
    for context_len in context_lens:
        for batch_size in batch_sizes:
            point = decode_point(cost, batch_size, context_len)
            if context_len == measured_context_len:
                point = _measured_point(engine, machine, point, steps, seed, probe)
                print(f"batch {batch_size}: {point.measured_tokens_per_s:.1f} tok/s "
                      f"({point.share_of_bound:.0%} of bound)", flush=True)
            points.append(point)
    return points


def _measured_point(engine: Engine, machine: MachineFigures, point: RooflinePoint, steps: int, seed: int,
                    probe: ReadProbe | None) -> RooflinePoint:
    """The engine's decode speed at the point (the context grows by one token a step: measured around the
    nominal length), and with a probe, the point's bound at the bandwidth read around it. The steps then run
    in SLICES runs with the bandwidth read between them: this machine's memory can change speed by half
    within seconds, and each run is held against the bandwidth read on either side of it (the bound is the
    time the machine at its roof would take for all the runs' tokens)."""
    if probe is None:
        prompt_len = max(point.context_len - steps // 2, 1)
        return replace(point, measured_tokens_per_s=measure_decode(engine, point.batch_size, prompt_len, steps, seed))
    prompt_len = max(point.context_len - SLICES * steps // 2, 1)
    tokens = seconds = bound_seconds = bandwidth_x_seconds = 0.0
    before = probe.measure()[0]
    for slice_tokens, slice_seconds in decode_slices(engine, point.batch_size, prompt_len, steps, seed, SLICES):
        after = probe.measure()[0]
        bandwidth = (before + after) / 2
        cost = machine_cost_model(engine.model_config, replace(machine, memory_bandwidth=bandwidth),
                                  engine.runner.weight_format, engine.runner.kv_itemsize)
        bound = decode_point(cost, point.batch_size, point.context_len).bound_tokens_per_s
        tokens, seconds = tokens + slice_tokens, seconds + slice_seconds
        bound_seconds += slice_tokens / bound
        bandwidth_x_seconds += bandwidth * slice_seconds
        before = after
    return replace(point, bound_tokens_per_s=tokens / bound_seconds, measured_tokens_per_s=tokens / seconds,
                   read_bandwidth=bandwidth_x_seconds / seconds)


def format_roofline(points: list[RooflinePoint], machine: MachineFigures) -> str:
    header = (
        f"machine: {machine.cpu}, {machine.threads} threads: {machine.memory_bandwidth / 1e9:.1f} GB/s read "
        f"({machine.bandwidth_by}), "
        f"{machine.gemm_flops / 1e9:.0f} GFLOP/s {machine.dtype} GEMM ({machine.gemm_by}), "
        f"ridge {machine.ridge_point:.1f} FLOP/byte"
    )
    if machine.int8_ops:
        header += (f"; {machine.int8_ops / 1e9:.0f} GOP/s int8 ({machine.int8_by}), ridge "
                   f"{machine.int8_ops / machine.memory_bandwidth:.1f} op/byte, the roof of quantized weights")
    rows = []
    for p in points:
        measured = "" if p.measured_tokens_per_s is None else round(p.measured_tokens_per_s, 1)
        share = "" if p.share_of_bound is None else f"{p.share_of_bound:.0%}"
        read = "" if p.read_bandwidth is None else round(p.read_bandwidth / 1e9, 1)
        rows.append([p.batch_size, p.context_len, round(p.intensity, 2), read, round(p.bound_tokens_per_s, 1),
                     measured, share])
    table = format_table(
        ["batch", "context", "FLOP/byte", "read GB/s", "bound tok/s", "measured tok/s", "% of bound"], rows
    )
    return f"{header}\n\n{table}"


def format_kernel_choice(choice: KernelChoice) -> str:
    """``--kernels auto``'s measurement: microseconds per call of each candidate GEMM, by projection and
    row count, and which one runs."""
    rows = choice.table()
    candidates = sorted({key for row in rows for key in row} - {"projection", "rows", "chosen"})
    headers = ["projection", "rows", *(f"{c} (us)" for c in candidates), "chosen"]
    body = [[row["projection"], row["rows"], *(row.get(c, "") for c in candidates), row["chosen"]] for row in rows]
    return format_table(headers, body)
