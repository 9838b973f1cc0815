"""The native CPU kernels (``conveyor/model/native/csrc``: kernels.cpp and its headers), built on first use and cached.

The build takes about a minute once per machine and source version; later
starts load it in a fraction of a second. The build folder lives in
Conveyor's cache directory under a key of everything the binary depends on:
the sources, the instruction set the compiler targets (``-march=native``
means different code on an AVX2 and an AVX-512 CPU, and a cache shared
between machines must never hand one the other's binary: that ends in
SIGILL, which no ``except`` catches), the compiler, torch and the Python
ABI. Without a C++ compiler the engine falls back to plain PyTorch ops,
with a warning.

The kernels come in vector widths: 256 bits everywhere (AVX2, or split
into what another target has, NEON's 128 on ARM: the portable path) and 512
bits where the compiler targets AVX-512F. The engine runs the widest the
build has; ``CONVEYOR_KERNEL_WIDTH=256`` (or ``512``) forces one, and a
width the CPU cannot run is refused, never swapped for another.

Where the compiler targets AVX512-BF16, the build also has GEMMs on
bfloat16 weights (512-bit, ``has_bfloat16()``): the engine runs them, with a
bfloat16 KV cache, for ``--dtype bfloat16``.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

from conveyor.core.model_config import ModelConfig
from conveyor.model.families import family_for
from conveyor.platform.cache_dir import cache_dir, make_cache_folder

logger = logging.getLogger("conveyor")
NATIVE_HEAD_SIZES = (8, 16, 32, 64, 96, 128, 256)  # attention is unrolled for these (csrc/attention.h, attend_fn)


def native_gaps(config: ModelConfig) -> list[str]:
    """What the native stack (native_decoder.h) lacks to run ``config`` (empty: it runs it). It has every
    family's layers here (set_family, set_layer_traits: QK-norm, (1 + w) and sandwich norms, GeGLU, the
    embedding and attention scales, a rope per layer kind, windows and KV groups, mixtures of experts, a
    QK-norm over each head or over the whole projection, OLMoE's clamp of Q, K and V); its attention is
    unrolled for some head sizes only."""
    family_for(config)
    if config.head_dim not in NATIVE_HEAD_SIZES:
        return [f"attention over heads of {config.head_dim} (it has {', '.join(map(str, NATIVE_HEAD_SIZES))})"]
    return []


SOURCE = Path(__file__).resolve().parent / "csrc" / "kernels.cpp"  # the one translation unit
TARGET_ENV = "CONVEYOR_KERNEL_TARGET"  # -march value to build for instead of this CPU (e.g. x86-64-v3: AVX2 only)
LOCK_NAME = "lock"  # torch.utils.cpp_extension's build lock, in the build folder
STALE_LOCK_S = 600.0  # a build takes one or two minutes; a lock this old was left by a killed one
WIDTH_ENV = "CONVEYOR_KERNEL_WIDTH"
WIDTH_FEATURES = {256: "avx2 or any other vector unit (portable)", 512: "avx512f"}  # what each width needs
BF16_FEATURE = "avx512_bf16"  # what the bfloat16 GEMMs need (the /proc/cpuinfo flag)
BF16_WIDTH = 512  # the bfloat16 GEMMs' only width


class StaleBuildLock(RuntimeError):
    """A build lock that nobody releases: the build that took it was killed."""


def kernel_cflags() -> tuple[str, ...]:
    """The compiler flags of the build: for this CPU (``-march=native``), or for the target named by
    ``CONVEYOR_KERNEL_TARGET``: a build for ``x86-64-v3`` has the AVX2 kernels and none of AVX-512's, which is
    how an AVX-512 machine builds and tests what an AVX2-only one runs.

    Loops start on 64-byte lines: the super-block kernels' speed moved by up to 14% with where their loops
    happened to fall (a Zen 4, `kernel_check bench 1024 1024 Q4_K,Q6_K vnni512`: Q6_K at 8 rows 62 us aligned,
    72 us as one unrelated line elsewhere in the file placed it), and aligned they no longer move."""
    return ("-O3", f"-march={os.environ.get(TARGET_ENV) or 'native'}", "-fopenmp", "-falign-loops=64")


def compiler_target(compiler: str | None = None) -> str:
    """What the build's ``-march`` means to the compiler on this machine: its version and the target options it
    expands to (the CPU name and every ISA extension), or a note that it could not be asked."""
    compiler = compiler or os.environ.get("CXX", "c++")  # the compiler torch's extension builder uses
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
        # -v prints the cc1 command line, where -march=native has become -march=<cpu> -m<feature> ...
        expanded = subprocess.run([compiler, *kernel_cflags(), "-E", "-v", "-x", "c++", "-"], input="",
                                  capture_output=True,
                                  text=True, timeout=30).stderr
    except (OSError, subprocess.SubprocessError) as error:
        return f"unknown compiler ({error})"
    target = [line for line in expanded.splitlines() if "cc1" in line and "-march=" in line]
    return (version.splitlines() or [""])[0] + "\n" + " ".join(_target_options(target[0] if target else expanded))


def _target_options(cc1_line: str) -> list[str]:
    """The target-specific options of a cc1 command line (-march=..., -mavx2, -mno-avx512f, --param cache sizes)."""
    return [option for option in cc1_line.split() if option.startswith(("-march=", "-mtune=", "-m"))]


def source_bytes(source: Path | None = None) -> bytes:
    """The translation unit and every header beside it, in a fixed order: what the build compiles."""
    source = source or SOURCE
    files = [source, *sorted(source.parent.glob("*.h"))]
    return b"".join(path.name.encode() + b"\0" + path.read_bytes() for path in files)


def build_key(source: bytes, target: str, torch_version: str, python_abi: str) -> str:
    """The build folder's name: a digest of everything the compiled binary depends on."""
    digest = hashlib.sha256()
    for part in (source, target.encode(), torch_version.encode(), python_abi.encode()):
        digest.update(hashlib.sha256(part).digest())
    return digest.hexdigest()[:16]


def wait_for_build_lock(build_dir: Path, stale_after_s: float = STALE_LOCK_S, poll_s: float = 1.0) -> None:
    """Wait while another process builds into ``build_dir`` (saying so once); raise StaleBuildLock for a lock
    older than ``stale_after_s`` (torch's own wait would spin on it forever)."""
    lock = build_dir / LOCK_NAME
    said = False
    while True:
        try:
            age = time.time() - lock.stat().st_mtime
        except FileNotFoundError:
            return
        if age > stale_after_s:
            raise StaleBuildLock(
                f"the native kernels' build lock {lock} is {age / 60:.0f} minutes old: the build that took it "
                f"was killed. Delete that file (or the folder {build_dir}) and start again to rebuild."
            )
        if not said:
            logger.warning("waiting for another process's build of the native kernels (lock %s, %.0f s old; "
                           "one older than %.0f minutes is reported as left by a killed build)",
                           lock, age, stale_after_s / 60)
            said = True
        time.sleep(poll_s)


def load_built(name: str, build_dir: Path) -> ModuleType | None:
    """The extension already built in ``build_dir``, imported without torch's build lock; None when there is
    none, or what is there does not load (a link cut short). The folder's key covers everything the binary
    depends on, so a binary in it is this source's: no rebuild check is needed, and a start killed while
    loading cannot leave behind a lock that the next start would wait on."""
    import importlib.util

    library = build_dir / f"{name}.so"
    if not library.is_file():
        return None
    try:
        spec = importlib.util.spec_from_file_location(name, library)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except (ImportError, OSError) as error:
        logger.warning("the native kernels built in %s do not load (%s); building them again", build_dir, error)
        return None
    return module


@functools.cache
def native_kernels() -> ModuleType | None:
    """The compiled extension module, or None when it cannot be built here."""
    import torch
    from torch.utils.cpp_extension import load

    target = " ".join([compiler_target(), *kernel_cflags()])  # the flags too: the binary depends on them
    key = build_key(source_bytes(), target, torch.__version__, sys.implementation.cache_tag)
    build_dir = cache_dir() / "kernels" / key
    name = f"conveyor_kernels_{key}"
    try:
        make_cache_folder(build_dir)
        if (built := load_built(name, build_dir)) is not None:
            return built
        wait_for_build_lock(build_dir)
        if not any(build_dir.glob("*.so")):
            # Warning level: the default, and a first start that pauses for a minute should say why.
            logger.warning("building the native kernels for this CPU in %s (once, about a minute)", build_dir)
        return load(
            name=name,
            sources=[str(SOURCE)],
            # -fopenmp: ATen's parallel_for is OpenMP pragmas in a header, so without it the kernels run
            # on one thread. The library it links is torch's own libgomp, already loaded under that name.
            extra_cflags=list(kernel_cflags()),
            extra_ldflags=["-fopenmp"],
            build_directory=str(build_dir),
            verbose=os.environ.get("CONVEYOR_VERBOSE_BUILD") == "1",
        )
    except Exception as error:  # no compiler, ninja, cache folder; a stale lock; another platform: torch ops
        logger.warning("native kernels unavailable (%s); using PyTorch ops", error)
        return None


def kernel_width(kernels: ModuleType) -> int:
    """The vector width in bits the native kernels run at: ``CONVEYOR_KERNEL_WIDTH`` when set, else the widest
    this build has (512 on an AVX-512 CPU, else 256). A forced width the build lacks raises ValueError."""
    available = list(kernels.kernel_widths())
    wanted = os.environ.get(WIDTH_ENV, "").strip()
    if not wanted:
        return max(available)
    if not wanted.isdigit() or int(wanted) not in WIDTH_FEATURES:
        raise ValueError(f"{WIDTH_ENV}={wanted!r}: expected one of {sorted(WIDTH_FEATURES)}")
    if int(wanted) not in available:
        raise ValueError(
            f"{WIDTH_ENV}={wanted}: this CPU lacks {WIDTH_FEATURES[int(wanted)]} (the kernels have {available} bits)"
        )
    return int(wanted)


def candidate_widths(kernels: ModuleType) -> list[int]:
    """The widths ``--kernels auto`` may choose between: the forced one alone (``CONVEYOR_KERNEL_WIDTH``), else
    every width this build has."""
    return [kernel_width(kernels)] if os.environ.get(WIDTH_ENV, "").strip() else list(kernels.kernel_widths())


def bfloat16_unavailable(kernels: ModuleType, width: int) -> str | None:
    """Why the native stack cannot run bfloat16 weights here (None: it can). Without the bfloat16 GEMMs in the
    build (a CPU without avx512_bf16, or a compiler that does not target it), or with a width forced below
    theirs."""
    if not getattr(kernels, "has_bfloat16", lambda: False)():
        return f"this CPU lacks {BF16_FEATURE} (or the compiler does not target it)"
    if width != BF16_WIDTH:
        return f"the bfloat16 kernels are {BF16_WIDTH}-bit and {WIDTH_ENV}={width}"
    return None
