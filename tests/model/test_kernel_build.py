"""The native kernels' build cache: keyed by what the binary depends on, and never waiting on a dead build."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conveyor.model.native.kernels import (
    LOCK_NAME,
    StaleBuildLock,
    build_key,
    compiler_target,
    load_built,
    source_bytes,
    wait_for_build_lock,
)
from tests.harness import cpu_flags

AVX2 = "c++ 12.2.0\n-march=znver3 -mavx2 -mfma -mno-avx512f"
AVX512 = "c++ 12.2.0\n-march=znver3 -mavx2 -mfma -mavx512f -mavx512bw"


def test_the_key_changes_with_the_target_isa_and_with_everything_else_the_binary_depends_on() -> None:
    base = build_key(b"source", AVX2, "2.13.0", "cpython-311")
    assert build_key(b"source", AVX512, "2.13.0", "cpython-311") != base, "an AVX-512 build must not serve AVX2"
    assert build_key(b"source", AVX2.replace("12.2.0", "13.1.0"), "2.13.0", "cpython-311") != base
    assert build_key(b"source!", AVX2, "2.13.0", "cpython-311") != base
    assert build_key(b"source", AVX2, "2.14.0", "cpython-311") != base
    assert build_key(b"source", AVX2, "2.13.0", "cpython-312") != base
    assert build_key(b"source", AVX2, "2.13.0", "cpython-311") == base


def test_the_sources_a_key_covers_are_the_unit_and_every_header_beside_it(tmp_path: Path) -> None:
    unit = tmp_path / "kernels.cpp"
    unit.write_text('#include "vec.h"')
    (tmp_path / "vec.h").write_text("int f();")
    before = source_bytes(unit)
    (tmp_path / "vec.h").write_text("int g();")
    assert source_bytes(unit) != before, "a header's change must make a new build"
    (tmp_path / "gemm.h").write_text("")
    assert b"gemm.h" in source_bytes(unit), "a new header counts too"
    assert b"vec.h" in source_bytes(), "the package's own unit has headers"


def test_the_compiler_target_names_this_cpus_instruction_set() -> None:
    target = compiler_target()
    assert "-march=" in target, target
    flags = cpu_flags()
    if "avx2" in flags:
        assert "-mavx2" in target.split()
    if flags and "avx512f" not in flags:
        assert "-mavx512f" not in target.split(), "a CPU without AVX-512 gets no AVX-512 code"


def test_a_planted_stale_lock_is_reported_not_waited_on(tmp_path: Path) -> None:
    lock = tmp_path / LOCK_NAME
    lock.touch()
    old = time.time() - 3600
    os.utime(lock, (old, old))
    started = time.monotonic()
    with pytest.raises(StaleBuildLock, match=r"60 minutes old.*killed.*Delete"):
        wait_for_build_lock(tmp_path, stale_after_s=600)
    assert time.monotonic() - started < 5


def test_a_fresh_lock_is_waited_on_until_the_build_releases_it(tmp_path: Path, caplog) -> None:
    lock = tmp_path / LOCK_NAME
    lock.touch()
    threading.Timer(0.3, lock.unlink).start()
    started = time.monotonic()
    with caplog.at_level("WARNING", logger="conveyor"):
        wait_for_build_lock(tmp_path, stale_after_s=600, poll_s=0.05)
    assert 0.25 < time.monotonic() - started < 5
    assert [r.message for r in caplog.records if "waiting for another process's build" in r.message], "said once"
    assert len(caplog.records) == 1
    wait_for_build_lock(tmp_path)  # no lock: returns at once


def test_a_built_extension_loads_without_the_lock_a_killed_start_left(kernels, tmp_path: Path) -> None:
    """Every torch ``load`` takes the build lock, even to find nothing to build; a start killed then (Ctrl-C
    while a server starts) left a lock that made the next start wait ten minutes. A binary already in the
    keyed folder is imported without it."""
    built = Path(kernels.__file__)
    folder = tmp_path / "kernels" / built.parent.name
    folder.mkdir(parents=True)
    shutil.copy(built, folder / built.name)
    (folder / LOCK_NAME).touch()  # fresh: a waiter would wait for it
    code = "import torch; from conveyor.model.native.kernels import native_kernels; print(native_kernels().__file__)"
    started = time.monotonic()
    out = subprocess.run([sys.executable, "-c", code], env=os.environ | {"CONVEYOR_CACHE_DIR": str(tmp_path)},
                         capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == str(folder / built.name), out.stderr
    assert time.monotonic() - started < 60, "loaded, not waited on the lock"


def test_a_binary_that_does_not_load_is_built_again(tmp_path: Path, caplog) -> None:
    (tmp_path / "conveyor_kernels_x.so").write_bytes(b"a link cut short")
    with caplog.at_level("WARNING", logger="conveyor"):
        assert load_built("conveyor_kernels_x", tmp_path) is None
    assert "do not load" in caplog.text and "building them again" in caplog.text
    assert load_built("conveyor_kernels_y", tmp_path) is None  # none built: nothing to say
