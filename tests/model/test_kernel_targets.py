"""The kernels built for another CPU than this one: an AVX-512 machine builds the AVX2-only binary (``-march=
x86-64-v3``: AVX2, FMA, F16C, none of AVX-512 or VNNI) and holds it to the same references, so the path an
AVX2-only CPU runs is compiled and tested wherever the CPU can execute it. Minutes (a second build of the
kernels, then the quantized and native-stack tests): ``make test-slow``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from conveyor.model.native.kernels import TARGET_ENV, kernel_cflags
from tests.harness import cpu_flags

ROOT = Path(__file__).resolve().parents[2]
AVX2_ONLY = "x86-64-v3"


def test_the_target_names_the_march_of_the_build(monkeypatch) -> None:
    monkeypatch.delenv(TARGET_ENV, raising=False)
    assert "-march=native" in kernel_cflags()
    monkeypatch.setenv(TARGET_ENV, AVX2_ONLY)
    assert f"-march={AVX2_ONLY}" in kernel_cflags()


@pytest.mark.slow
@pytest.mark.skipif(not {"avx2", "fma", "f16c"} <= cpu_flags(), reason="this CPU cannot run an AVX2 build")
def test_the_avx2_only_build_passes_the_quantized_and_native_tests() -> None:
    env = {**os.environ, TARGET_ENV: AVX2_ONLY}
    probe = subprocess.run(
        [sys.executable, "-c", "from conveyor.model.native.kernels import native_kernels as k; m = k(); "
         "print(m.quant_dots(), m.kernel_widths())"],
        env=env, capture_output=True, text=True, timeout=900, cwd=ROOT,
    )
    assert probe.returncode == 0, probe.stderr[-2000:]
    assert probe.stdout.strip().endswith("['portable', 'avx2'] [256]"), probe.stdout  # no VNNI, no 512 bits
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "tests/model/test_quantized.py",
         "tests/model/test_native_stack.py"],
        env=env, capture_output=True, text=True, timeout=3000, cwd=ROOT,
    )
    assert run.returncode == 0, run.stdout[-4000:]
