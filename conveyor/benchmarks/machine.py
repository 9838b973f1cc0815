"""This machine's roofline numbers: memory read bandwidth and GEMM throughput.

A decode step is bound by one of them: reading every weight once (bandwidth)
or multiplying them by the batch (compute). Both are measured with the same
torch build the engine runs on, and saved, so that the roofline table and the
simulator's ``cpu-local`` hardware use the figures of the machine they ran on.
Quantized weights have a compute roof of their own: their products are int8
dot products (64 multiply-adds in one AVX512-VNNI instruction against 16 in a
float32 FMA), so a batch that is compute-bound on float32 weights may not be
on int8 ones.
"""

from __future__ import annotations

import json
import math
import os
import platform
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from conveyor.core.formats import BLOCK_FORMATS
from conveyor.model.dtypes import DTYPES
from conveyor.model.quant.k_quants import RawBlocks
from conveyor.model.quant.kernel_choice import time_candidates
from conveyor.platform.cache_dir import write_cache_file
from conveyor.platform.cpu import this_cpu
from conveyor.sim.hardware import machine_file


@dataclass(frozen=True, slots=True)
class MachineFigures:
    memory_bandwidth: float  # bytes/s read from DRAM: the fastest read this machine showed (bandwidth_by)
    gemm_flops: float  # FLOP/s of a large square GEMM in ``dtype``: the fastest GEMM this machine has
    dtype: str
    threads: int
    cpu: str
    measured_at: str  # ISO time, UTC
    gemm_by: str = "torch"  # which GEMM set gemm_flops: "torch" or the native kernels ("native 512-bit")
    bandwidth_by: str = "torch sum"  # which read set memory_bandwidth: a torch sum or a native GEMV stream
    int8_ops: float | None = None  # multiply-adds x 2 per second of the quantized kernels (None: no kernels)
    int8_by: str = ""  # the dot-product kind that set int8_ops

    @property
    def ridge_point(self) -> float:
        """FLOP per byte above which a kernel is compute-bound."""
        return self.gemm_flops / self.memory_bandwidth

    def save(self, path: Path | None = None) -> Path:
        path = path or machine_file()
        write_cache_file(path, json.dumps(asdict(self), indent=2) + "\n")
        return path

    @classmethod
    def load(cls, path: Path | None = None) -> MachineFigures:
        return cls(**json.loads((path or machine_file()).read_text()))


def _best_seconds(fn, repeats: int) -> float:
    fn()  # warm-up: page faults, thread pool start
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


class ReadProbe:
    """The machine's bandwidth roof: the faster of a torch ``sum`` and the native kernels streaming a packed
    weight into one row (a decode step's GEMV), both over ``num_bytes``. A roof below what the engine's own
    stream reaches would put batch 1 over 100% of its bound (measured: the GEMV read 11-40% faster than the
    sum). Allocated once, so that a roofline can read again next to each measurement: this machine's
    bandwidth drifts from one minute to the next."""

    def __init__(self, num_bytes: int = 512 * 2**20) -> None:
        from conveyor.model.native.kernels import kernel_width, native_kernels

        data = torch.ones(num_bytes // 4, dtype=torch.float32)
        self.reads: dict[str, tuple[int, Callable[[], object]]] = {"torch sum": (num_bytes, data.sum)}
        kernels = native_kernels()
        if kernels is not None:
            width, k = kernel_width(kernels), 1024
            packed = kernels.pack_linear_weight(torch.zeros(num_bytes // 4 // k, k), width)
            x, n = torch.randn(1, k), packed.shape[0] * packed.shape[2]
            self.reads[f"native {width}-bit GEMV"] = (packed.numel() * 4,
                                                      lambda: kernels.packed_linear(x, packed, n))

    def measure(self, repeats: int = 5) -> tuple[float, str]:
        """Bytes/s of the faster read and its name; the reads take turns so that both see the same minute."""
        best = time_candidates({name: read for name, (_, read) in self.reads.items()}, repeats, budget_s=math.inf)
        return max((size / best[name], name) for name, (size, _) in self.reads.items())


def measure_gemm(dtype: torch.dtype = torch.float32, size: int = 2048, repeats: int = 3) -> float:
    """FLOP/s of one ``size``-cubed matrix product in torch."""
    a = torch.randn(size, size).to(dtype)
    b = torch.randn(size, size).to(dtype)
    return 2 * size**3 / _best_seconds(lambda: a @ b, repeats)


def measure_native_gemm(size: int = 2048, repeats: int = 3, bfloat16: bool = False) -> tuple[float, str] | None:
    """FLOP/s of the native kernels' GEMM on a ``size``-cubed product (on bfloat16 weights if asked), at the
    vector width the engine runs, and its name; None without the native kernels (or their bf16 GEMMs)."""
    from conveyor.model.native.kernels import BF16_WIDTH, bfloat16_unavailable, kernel_width, native_kernels

    kernels = native_kernels()
    if kernels is None or (bfloat16 and bfloat16_unavailable(kernels, BF16_WIDTH) is not None):
        return None
    width = BF16_WIDTH if bfloat16 else kernel_width(kernels)
    packed = kernels.pack_linear_weight(torch.randn(size, size), width, bfloat16)
    x = torch.randn(size, size)
    seconds = _best_seconds(lambda: kernels.packed_linear(x, packed, size, 0), repeats)
    return 2 * size**3 / seconds, f"native {width}-bit" + (" bf16" if bfloat16 else "")


def measure_int8_gemm(size: int = 2048, rows: int = 256, repeats: int = 3) -> tuple[float, str] | None:
    """Operations/s (2 per multiply-add, as FLOP count them) of the quantized kernels' int8 dot products: ``rows``
    activations through a ``size`` x ``size`` weight, the faster of one quantized to 8 bits (Q8_0's form) and one in
    Q4_K super-blocks, on the widest kind this build has (the last of ``quant_dots``, which lists them fastest of
    each width last). None without the native kernels. Rows are many enough that the weight is read once for much
    work (compute-bound), few enough that the activations stay in cache. Both forms, because a roof below the
    engine's own kernels puts a step over 100% of its bound: on a 2-core Zen 3 (AVX2, no VNNI) the 8-bit weight
    ran 142-174 G operations a second and the 8B-shaped Q4_K_M file's decode of 8 requests 147-195% of that bound
    (commit 3dbb2f7; docs/benchmarks/decode.md)."""
    from conveyor.model.native.kernels import native_kernels
    from conveyor.model.quant.formats import quantize_matrix
    from conveyor.model.quant.linear import native_weight

    kernels = native_kernels()
    if kernels is None:
        return None
    x = torch.randn(rows, size)
    dot = kernels.quant_dots()[-1]
    weights = {"int8": quantize_matrix(torch.randn(size, size).numpy(), "int8"), "Q4_K": _random_q4_k(size)}
    packed = {name: native_weight(kernels, matrix) for name, matrix in weights.items()}
    calls = {name: (lambda w=weight: kernels.quantized_linear(x, w, dot)) for name, weight in packed.items()}
    seconds = time_candidates(calls, repeats, budget_s=math.inf)  # in turns, so that both see the same minute
    name = min(seconds, key=seconds.get)
    return 2 * rows * size * size / seconds[name], f"native int8 ({dot}, {name})"


def _random_q4_k(size: int) -> RawBlocks:
    """A ``size`` x ``size`` Q4_K matrix of random codes and sub-block scales, each super-block's d and dmin 2^-10
    (float16, its first 4 bytes): the kernels' speed does not depend on the values."""
    q4_k = BLOCK_FORMATS["Q4_K"]
    blocks = size // q4_k.block
    raw = np.random.default_rng(0).integers(0, 256, (size, blocks, q4_k.file_bytes), dtype=np.uint8)
    raw[..., :4] = np.array([2.0**-10, 2.0**-10], dtype=np.float16).view(np.uint8)
    return RawBlocks.from_file(raw, "Q4_K", size, size)


def fastest_gemm(dtype: str) -> tuple[float, str]:
    """The machine's compute roof: the faster of torch's GEMM and, in float32 or bfloat16, the native kernels'.
    A roof below what the engine's own kernels reach would put the engine over 100% of its bound."""
    best = (measure_gemm(DTYPES[dtype]), "torch")
    native = measure_native_gemm(bfloat16=dtype == "bfloat16") if dtype in ("float32", "bfloat16") else None
    return max(best, native) if native is not None else best


def measure_machine(dtype: str = "float32", probe: ReadProbe | None = None) -> MachineFigures:
    gemm_flops, gemm_by = fastest_gemm(dtype)
    bandwidth, bandwidth_by = (probe or ReadProbe()).measure()
    int8_ops, int8_by = measure_int8_gemm() or (None, "")
    return MachineFigures(
        memory_bandwidth=bandwidth,
        gemm_flops=gemm_flops,
        dtype=dtype,
        threads=torch.get_num_threads(),
        cpu=_cpu_name(),
        measured_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        gemm_by=gemm_by,
        bandwidth_by=bandwidth_by,
        int8_ops=int8_ops,
        int8_by=int8_by,
    )


def _cpu_name() -> str:
    model = this_cpu().model
    return f"{model} ({os.cpu_count()} cores)" if model else platform.processor() or platform.machine()
