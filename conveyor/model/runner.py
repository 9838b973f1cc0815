"""How and where the model runs: the one place that decides it.

The engine asks ``build_runner`` with its config and the model's shape and gets a plain RunnerPlan: the
device, the dtypes, whether the native kernels run the model and whether they keep its weights quantized.
``load`` then loads the model that way and completes the plan with what only the loaded model and this machine
tell: the kernels' vector width, the per-shape choices of ``--kernels auto``, and the weight format a step
reads. The engine decides nothing about kernels; the executor runs what it is handed.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from conveyor.core.config import EngineConfig, usable_cores
from conveyor.core.formats import KV_CACHE_BYTES, WeightFormat
from conveyor.core.model_config import ModelConfig
from conveyor.model.decoder import Decoder
from conveyor.model.dtypes import DTYPES, kv_cache_dtype
from conveyor.model.families import family_for
from conveyor.model.native.kernels import native_gaps
from conveyor.model.weights.loader import load_model, quantized_kinds
from conveyor.model.weights.paths import weight_file_bytes

if TYPE_CHECKING:
    from conveyor.model.quant.dot_choice import QuantDotChoice
    from conveyor.model.quant.kernel_choice import KernelChoice

logger = logging.getLogger("conveyor.engine")


@dataclasses.dataclass(frozen=True, slots=True)
class RunnerPlan:
    """How the model runs. Fields up to ``quantization`` are known before the weights load (build_runner);
    the rest once they have (load)."""

    device: str  # "cpu", "cuda", "cuda:1"
    dtype: str  # the model's compute dtype: float32, bfloat16, float16
    kv_cache_dtype: str  # what the KV cache stores, --kv-cache-dtype's auto resolved: float32, float16, fp8, ...
    model_path: Path  # the model folder (for a GGUF file, the folder that describes it)
    weight_file_bytes: int  # the weights as they lie on disk
    num_threads: int  # compute threads (torch's and the native kernels')
    native: bool  # the native kernels may run the model (else PyTorch ops)
    keep_quantized: bool  # a GGUF file's (or --quantization's) weights stay quantized
    quantization: str | None  # --quantization's scheme for a float checkpoint; None: the file's own formats
    kernel_width: int | None = None  # the native kernels' vector width in bits; None: PyTorch ops
    kernel_dtype: str | None = None  # what the native stack stores weights in: float32, bfloat16, "Q4_1+Q8_0"
    kernel_choice: KernelChoice | None = None  # --kernels auto on float weights: what this machine measured
    quant_choice: QuantDotChoice | None = None  # the same for quantized weights' dot products
    weight_format: WeightFormat | None = None  # what a step reads per weight: the cost model's (and roofline's)

    @property
    def kv_itemsize(self) -> int:
        """Bytes per KV cache element (the resolved kv_cache_dtype's)."""
        return KV_CACHE_BYTES[self.kv_cache_dtype]

    @property
    def summary(self) -> str:
        """One line: how the model runs."""
        kernels = self.native_kernels_summary
        how = f"native kernels: {kernels}" if kernels is not None else "PyTorch ops"
        return f"{self.device}, {self.dtype}, {how}, {self.num_threads} thread(s)"

    @property
    def native_kernels_summary(self) -> str | None:
        """The native stack's vector width, for bfloat16 what it stores in bf16, and with ``--kernels auto``
        where torch's GEMM runs instead; None on PyTorch ops."""
        if self.kernel_width is None:
            return None
        stored = {"bfloat16": ", bfloat16 weights and KV cache", "float32": ""}.get(
            self.kernel_dtype, f", {self.kernel_dtype} weights kept quantized")
        choice = self.kernel_choice or self.quant_choice
        chosen = f"; {choice.summary()}" if choice is not None else ""
        return f"{self.kernel_width}-bit vectors{stored}{chosen}"


def build_runner(config: EngineConfig, model_config: ModelConfig, folder: Path) -> RunnerPlan:
    """How the model of ``folder`` (shape ``model_config``) runs under ``config``. An architecture the layers
    lack is refused here, before anything loads; a model the native stack lacks something for runs on PyTorch
    ops, said once in a warning."""
    family_for(model_config)
    device = _device(config.device)
    dtype = DTYPES[config.dtype]
    wanted = config.kernels != "torch" and device.type == "cpu" and dtype in (torch.float32, torch.bfloat16)
    gaps = native_gaps(model_config)
    if gaps and wanted:
        logger.warning("%s runs on PyTorch ops, not the native kernels: the native stack lacks %s",
                       model_config.model_type, ", ".join(gaps))
    native = wanted and not gaps
    return RunnerPlan(
        device=str(device), dtype=config.dtype, kv_cache_dtype=config.kv_cache_format(model_config.gguf_file),
        model_path=folder,
        weight_file_bytes=weight_file_bytes(config.model), num_threads=_num_threads(config), native=native,
        keep_quantized=native and dtype == torch.float32,
        quantization=None if config.quantization == "none" else config.quantization,
    )


def load(plan: RunnerPlan, max_positions: int, kernels_mode: str) -> tuple[Decoder, RunnerPlan]:
    """The model loaded as ``plan`` says, on ``plan.num_threads`` threads, and the plan completed: the native
    kernels at this machine's width (with ``kernels_mode`` auto, each shape on the kernel measured fastest), or
    PyTorch ops where they cannot run it (a build without a compiler; bfloat16 without AVX512-BF16)."""
    torch.set_num_threads(plan.num_threads)
    dtype, device = DTYPES[plan.dtype], torch.device(plan.device)
    kernels = _native_kernels() if plan.native else None
    model = load_model(plan.model_path, dtype, device, max_positions, kernels if plan.keep_quantized else None,
                       plan.quantization)
    if kernels is not None:
        plan = _use_native_kernels(plan, model, kernels, kernels_mode == "auto")
    kernel_format = plan.kernel_dtype or plan.dtype
    plan = dataclasses.replace(plan, weight_format=WeightFormat(kernel_format, *model.stored_weight_bits()))
    logger.info("the model runs on %s", plan.summary)
    return model, plan


def kv_torch_dtype(plan: RunnerPlan) -> torch.dtype:
    """The KV cache tensor's dtype (uint8 holds fp8 e5m2 bits)."""
    return kv_cache_dtype(plan.kv_cache_dtype, DTYPES[plan.dtype])


def _use_native_kernels(plan: RunnerPlan, model: Decoder, kernels: Any, auto: bool) -> RunnerPlan:
    """The native stack takes the model: float32, or bfloat16 weights and KV cache where the build has the
    bfloat16 GEMMs (a bfloat16 run that cannot says why: PyTorch ops in bf16 are much slower). With ``auto``,
    each projection and batch size runs the GEMM (or the dot-product kind) this machine measured fastest."""
    from conveyor.model.native.kernels import bfloat16_unavailable, candidate_widths, kernel_width

    width, bfloat16 = kernel_width(kernels), plan.dtype == "bfloat16"
    if bfloat16 and (why := bfloat16_unavailable(kernels, width)) is not None:
        logger.warning("--dtype bfloat16 runs on PyTorch ops, not the native kernels: %s", why)
        return plan
    if model.quantized:
        quant_choice, dots = None, None
        if auto:
            from conveyor.model.quant.dot_choice import choose_quant_dots

            quant_choice = choose_quant_dots(kernels, model.quantized_weights())
            dots = quant_choice.ranges()
        model.use_native_kernels(kernels, width, quant_dots=dots)
        plan = dataclasses.replace(plan, kernel_width=width, kernel_dtype="+".join(sorted(quantized_kinds(model))),
                                   quant_choice=quant_choice)
        return plan
    kernel_choice, torch_rows, fused_rows = None, {}, None  # None: the stack's own rule for fusing SwiGLU
    if auto:
        from conveyor.model.quant.kernel_choice import choose_kernels

        widths = [width] if bfloat16 else candidate_widths(kernels)
        kernel_choice = choose_kernels(kernels, model.projection_weights(), widths, bfloat16)
        width, torch_rows, fused_rows = kernel_choice.width, kernel_choice.torch_rows(), kernel_choice.fused_rows()
    plan = dataclasses.replace(plan, kernel_width=width, kernel_dtype="bfloat16" if bfloat16 else "float32",
                               kernel_choice=kernel_choice)
    model.use_native_kernels(kernels, width, bfloat16, torch_rows, fused_rows)
    return plan


def _native_kernels() -> Any:
    """The built kernels module; None where it cannot be built (no compiler: the model runs on PyTorch ops)."""
    from conveyor.model.native.kernels import native_kernels

    return native_kernels()


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def _num_threads(config: EngineConfig) -> int:
    """--num-threads, else every core this process may use; more than that is allowed, with a warning."""
    threads = config.num_threads or usable_cores()
    if threads > usable_cores():
        logger.warning("--num-threads %d is more than the %d cores this process may use: threads will share "
                       "cores, and every parallel loop waits for its slowest (expect slower steps)",
                       threads, usable_cores())
    return threads
