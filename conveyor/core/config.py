"""Engine options, named as vLLM's flags where the meaning is the same."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "t": 10**12, "tb": 10**12}


def parse_bytes(value: str | int) -> int:
    """``"2GiB"``, ``"512MB"``, ``"1e9"`` or an int -> bytes."""
    if isinstance(value, int):
        return value
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*", str(value))
    number = float(match.group(1)) * _UNITS.get(match.group(2).lower(), math.nan) if match else math.nan
    if not math.isfinite(number):
        raise ValueError(f"not a size in bytes: {value!r} (examples: 2GiB, 512MB, 1000000)")
    return int(number)


@dataclass(slots=True)
class EngineConfig:
    model: str | None = None  # HF folder or .gguf file; None = the default model
    dtype: str = "float32"
    device: str = "auto"
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    kv_cache_memory: int | str = "2GiB"
    num_kv_blocks: int | None = None  # overrides kv_cache_memory
    max_model_len: int | None = None  # None = the model's own limit
    seed: int = 0
    scheduler: str = "continuous"  # or "static": request-level batching, the baseline
    scheduling_policy: str = "fcfs"  # or "priority": lower value first; may preempt less important requests
    preemption_mode: str = "recompute"  # or "swap": a victim's KV goes to CPU memory and comes back
    swap_space: int | str = "4GiB"  # CPU memory for swapped KV blocks (preemption_mode="swap")
    kv_layout: str = "paged"  # or "contiguous": a max_model_len slab reserved per request
    kernels: str = "native"  # or "torch": plain PyTorch ops (the reference; also used off float32 CPU)

    def __post_init__(self) -> None:
        for name in ("kv_cache_memory", "swap_space"):
            try:
                setattr(self, name, parse_bytes(getattr(self, name)))
            except ValueError as error:
                raise ValueError(f"{name}: {error}") from None
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "num_kv_blocks",
                     "max_model_len", "seed"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
                raise ValueError(f"{name} must be an integer, got {value!r}")
        if self.scheduler not in ("continuous", "static"):
            raise ValueError(f"scheduler must be continuous or static, got {self.scheduler!r}")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be fcfs or priority, got {self.scheduling_policy!r}")
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode must be recompute or swap, got {self.preemption_mode!r}")
        if self.kv_layout not in ("paged", "contiguous"):
            raise ValueError(f"kv_layout must be paged or contiguous, got {self.kv_layout!r}")
        if self.kernels not in ("native", "torch"):
            raise ValueError(f"kernels must be native or torch, got {self.kernels!r}")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "kv_cache_memory"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("num_kv_blocks", "max_model_len"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
