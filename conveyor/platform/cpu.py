"""The CPU at hand as Linux names it (``/proc/cpuinfo``): its model name and the vector extensions that decide
which kernels can run and how fast. It labels what a measurement was taken on (the simulator's step profiles,
the roofline's machine figures) and keys what is cached per machine (``--kernels auto``'s choice).
Torch-free, so that the simulator reads the same identity as the engine.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8", "asimd", "sve")


@dataclass(frozen=True, slots=True)
class Cpu:
    model: str | None  # None where /proc/cpuinfo does not name it (another OS, some ARM kernels)
    isa: tuple[str, ...]  # which of ISA_FLAGS it has, in that order


def this_cpu() -> Cpu:
    """The model name and vector extensions of this machine's CPU."""
    model: str | None = None
    flags: set[str] = set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and model is None:
                model = value.strip()
            elif key.strip() in ("flags", "Features"):
                flags |= set(value.split())
    except OSError:
        pass
    return Cpu(model, tuple(flag for flag in ISA_FLAGS if flag in flags))


def available_memory_bytes() -> int | None:
    """The memory Linux can give this process without swapping (``MemAvailable``), None where it does not say.
    What sizes the default KV pool, with the weights' bytes taken off."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key == "MemAvailable":
                return int(value.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def resident_bytes() -> int | None:
    """This process's resident memory (``VmRSS``), None where Linux does not say."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def release_freed_memory() -> None:
    """Hand the heap's freed pages back to the system (glibc's ``malloc_trim``). Loading a model frees its read
    buffers and packing temporaries, and glibc keeps such pages as the process's own unless asked: 59 of the 395
    MiB a Llama 3.2 1B-shaped Q4_K_M file's engine held beside its weights and KV pool (Zen 4). Nothing where the
    C library has no ``malloc_trim``."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return
    trim(0)
