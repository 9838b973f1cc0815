"""The kernels as a plain C++ library: kernel_check.cpp builds with a C++ compiler alone (no torch headers on the
include path, no Python) and its test passes; only the torch binding's files include torch."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from conveyor.model.native.kernels import SOURCE

CSRC = SOURCE.parent
BINDING = {"kernels.cpp", "tensors.h", "native_decoder.h"}  # the torch module: tensors in, pointers out
COMPILER = os.environ.get("CXX", "c++")


def test_only_the_binding_includes_torch() -> None:
    torch_include = re.compile(r'#include\s*[<"](torch|ATen|c10)/')
    users = {path.name for path in CSRC.glob("*.[ch]*") if torch_include.search(path.read_text())}
    assert users - BINDING == {"parallel.h"}, "a kernel header includes torch"
    parallel = (CSRC / "parallel.h").read_text()
    assert "#if defined(CONVEYOR_ATEN)" in parallel.split("#include <ATen")[0], "parallel.h includes ATen unasked"


@pytest.mark.skipif(shutil.which(COMPILER) is None, reason=f"no C++ compiler ({COMPILER})")
def test_the_kernel_check_builds_without_torch_and_passes(tmp_path: Path) -> None:
    binary = tmp_path / "kernel_check"
    # -O0: what is checked is that the kernels build and compute right without torch; the optimiser's work is the
    # extension's (test_kernels and the rest run it). On a 2-core Zen 4 the build took 6 s at -O0, 29 s at -O2.
    build = subprocess.run([COMPILER, "-std=c++17", "-O0", "-march=native", "-fopenmp", "-Werror=return-type",
                            str(CSRC / "kernel_check.cpp"), "-o", str(binary)],
                           capture_output=True, text=True, timeout=600, env={**os.environ, "CPATH": ""})
    assert build.returncode == 0, build.stderr[-3000:]
    run = subprocess.run([str(binary), "test"], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "2"})
    assert run.returncode == 0 and run.stdout.rstrip().endswith("passed"), run.stdout[-3000:]
    assert "avx2" in run.stdout or "portable" in run.stdout
    bad = subprocess.run([str(binary), "bench", "100", "100"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "error:" in bad.stdout, "a shape the kernels refuse is a clear error"
