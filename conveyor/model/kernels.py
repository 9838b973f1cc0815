"""The native CPU kernels (``conveyor/csrc/kernels.cpp``), built on first use and cached.

The build takes about a minute once per machine and source version (the
build folder lives in Conveyor's cache directory, keyed by the source's
hash); later starts load it in a fraction of a second. Without a C++
compiler the engine falls back to plain PyTorch ops, with a warning.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
from pathlib import Path
from types import ModuleType

from conveyor.core.cache_dir import cache_dir

logger = logging.getLogger("conveyor")
NATIVE_HEAD_SIZES = (8, 16, 32, 64, 96, 128)  # attention is unrolled for these (kernels.cpp, attend_fn)
SOURCE = Path(__file__).resolve().parent.parent / "csrc" / "kernels.cpp"


@functools.cache
def native_kernels() -> ModuleType | None:
    """The compiled extension module, or None when it cannot be built here."""
    from torch.utils.cpp_extension import load

    digest = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:12]
    build_dir = cache_dir() / "kernels" / digest
    build_dir.mkdir(parents=True, exist_ok=True)
    if not any(build_dir.glob("*.so")):
        logger.info("building native kernels in %s (once, about a minute)", build_dir)
    try:
        return load(
            name=f"conveyor_kernels_{digest}",
            sources=[str(SOURCE)],
            # -fopenmp: ATen's parallel_for is OpenMP pragmas in a header, so without it the kernels run
            # on one thread. The library it links is torch's own libgomp, already loaded under that name.
            extra_cflags=["-O3", "-march=native", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            build_directory=str(build_dir),
            verbose=os.environ.get("CONVEYOR_VERBOSE_BUILD") == "1",
        )
    except Exception as error:  # no compiler, no ninja, unsupported platform: run on torch ops instead
        logger.warning("native kernels unavailable (%s); using PyTorch ops", error)
        return None
