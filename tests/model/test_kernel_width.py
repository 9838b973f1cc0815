"""Which vector width the engine's native kernels run at: the widest the build has, or the one
``CONVEYOR_KERNEL_WIDTH`` forces; a forced width the CPU lacks is refused with the feature named."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from conveyor.model.native.kernels import WIDTH_ENV, candidate_widths, kernel_width

AVX2_BUILD = SimpleNamespace(kernel_widths=lambda: [256])
AVX512_BUILD = SimpleNamespace(kernel_widths=lambda: [256, 512])


def test_the_default_is_the_widest_the_build_has(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(WIDTH_ENV, raising=False)
    assert kernel_width(AVX2_BUILD) == 256
    assert kernel_width(AVX512_BUILD) == 512


def test_a_forced_width_is_taken(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(WIDTH_ENV, "256")
    assert kernel_width(AVX512_BUILD) == 256
    monkeypatch.setenv(WIDTH_ENV, "512")
    assert kernel_width(AVX512_BUILD) == 512


def test_auto_times_every_width_unless_one_is_forced(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(WIDTH_ENV, raising=False)
    assert candidate_widths(AVX512_BUILD) == [256, 512]
    assert candidate_widths(AVX2_BUILD) == [256]
    monkeypatch.setenv(WIDTH_ENV, "256")
    assert candidate_widths(AVX512_BUILD) == [256]
    monkeypatch.setenv(WIDTH_ENV, "512")
    with pytest.raises(ValueError, match="lacks avx512f"):
        candidate_widths(AVX2_BUILD)


def test_a_forced_width_the_cpu_lacks_names_the_missing_feature(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(WIDTH_ENV, "512")
    with pytest.raises(ValueError, match="lacks avx512f"):
        kernel_width(AVX2_BUILD)


@pytest.mark.parametrize("value", ["128", "wide", "-1"])
def test_a_width_that_is_no_width_is_refused(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv(WIDTH_ENV, value)
    with pytest.raises(ValueError, match="expected one of"):
        kernel_width(AVX512_BUILD)
