"""A cache folder that cannot be written: a clear error where the cache is needed, the engine on where not."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conveyor.model.quant.kernel_choice import choose_kernels
from conveyor.model.weights.paths import resolve_model
from conveyor.platform.cache_dir import CACHE_ENV, CacheDirError, make_cache_folder


@pytest.fixture
def blocked_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """CONVEYOR_CACHE_DIR set to a file: nothing can be created under it, whoever runs the tests (root too)."""
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    monkeypatch.setenv(CACHE_ENV, str(blocker))
    return blocker


def test_a_folder_that_cannot_be_made_is_named_with_the_way_out(blocked_cache: Path) -> None:
    with pytest.raises(CacheDirError, match=f"{blocked_cache}/models.*set {CACHE_ENV} to a folder it can write"):
        make_cache_folder(blocked_cache / "models")
    elsewhere = blocked_cache.parent / "another-file"
    elsewhere.write_text("")
    with pytest.raises(CacheDirError, match=r"another-file/x \(Not a directory\)$"):
        make_cache_folder(elsewhere / "x")  # outside the cache: no advice about CONVEYOR_CACHE_DIR
    assert make_cache_folder(blocked_cache.parent / "fine") == blocked_cache.parent / "fine"


def test_the_default_model_without_a_cache_to_convert_into_says_so(blocked_cache: Path) -> None:
    with pytest.raises(CacheDirError, match=CACHE_ENV):
        resolve_model(None)


def test_a_kernel_choice_that_cannot_be_stored_is_still_made(kernels, blocked_cache: Path, caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="conveyor"):
        choice = choose_kernels(kernels, {"o": torch.randn(64, 64)}, [256], False, blocked_cache / "choice.json")
    assert not choice.cached and choice.width == 256
    assert "could not be stored" in caplog.text and "measures it again" in caplog.text


def test_kernels_that_cannot_be_built_into_the_cache_fall_back_to_torch_ops(blocked_cache: Path) -> None:
    # In a process of its own: native_kernels() remembers its answer for the life of the process.
    code = "from conveyor.model.native.kernels import native_kernels; print('kernels:', native_kernels())"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env=os.environ | {CACHE_ENV: str(blocked_cache)})
    assert run.returncode == 0, run.stderr
    assert "kernels: None" in run.stdout
    assert "native kernels unavailable" in run.stderr and CACHE_ENV in run.stderr, run.stderr


def test_the_command_line_reports_it_as_an_error_not_a_traceback(blocked_cache: Path) -> None:
    run = subprocess.run([sys.executable, "-m", "conveyor", "generate", "--prompt", "hi"], capture_output=True,
                         text=True, timeout=300, env=os.environ | {CACHE_ENV: str(blocked_cache)})
    assert run.returncode == 2, run.stderr
    assert "conveyor: error: cannot create the folder" in run.stderr and "Traceback" not in run.stderr
