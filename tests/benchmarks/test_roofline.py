"""The roofline's arithmetic by hand, and ``conveyor roofline`` end to end on the tiny model."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest

from conveyor.benchmarks.machine import MachineFigures, ReadProbe, fastest_gemm, measure_int8_gemm, measure_native_gemm
from conveyor.benchmarks.roofline import decode_point, machine_cost_model
from conveyor.core.formats import WeightFormat
from conveyor.entrypoints.cli import main
from conveyor.sim.hardware import load_model_config

MACHINE = MachineFigures(
    memory_bandwidth=20e9, gemm_flops=100e9, dtype="float32", threads=2, cpu="test", measured_at="now"
)


def test_batch_one_reads_every_weight_once():
    smol = load_model_config("SmolLM2-135M")
    cost = machine_cost_model(smol, MACHINE)
    # 30 layers x (q, o 576x576; k, v 576x192; gate, up, down 576x1536) + the tied 49152x576 LM head.
    weights = 30 * (2 * 576 * 576 + 2 * 576 * 192 + 3 * 576 * 1536) + 49152 * 576
    point = decode_point(cost, batch_size=1, context_len=0)
    assert point.flops == pytest.approx(2 * weights)
    assert point.bytes_moved == pytest.approx(4 * weights + cost.kv_bytes_per_token)  # + one token's K/V written
    assert point.intensity == pytest.approx(0.5, rel=0.01)  # 2 FLOP per 4-byte weight
    assert point.bound_tokens_per_s == pytest.approx(20e9 / point.bytes_moved, rel=0.01)


def test_intensity_grows_with_the_batch_until_compute_bound():
    cost = machine_cost_model(load_model_config("SmolLM2-135M"), MACHINE)
    points = [decode_point(cost, b, 128) for b in (1, 4, 16, 64, 256)]
    intensities = [p.intensity for p in points]
    assert intensities == sorted(intensities)
    assert intensities[3] / intensities[0] > 20  # batch 64: about 30x the FLOPs per byte of batch 1
    bounds = [p.bound_tokens_per_s for p in points]
    assert bounds[1] / bounds[0] > 3.5  # memory-bound: 4 requests cost about as much as one
    assert bounds[4] / bounds[3] < 2  # past the ridge point: compute-bound, little gain left


def test_roofline_command_on_the_tiny_model(tiny_model_dir, tmp_path, monkeypatch, capsys):
    machine_json = tmp_path / "machine.json"
    monkeypatch.setattr("conveyor.benchmarks.machine.machine_file", lambda: machine_json)
    picture, table = tmp_path / "roof.png", tmp_path / "roof.json"
    argv = ["roofline", "--model", str(tiny_model_dir), "--batch-sizes", "1,3", "--context-lens", "64",
            "--measured-context-len", "16", "--steps", "2", "-o", str(picture), "--json", str(table),
            "--num-kv-blocks", "64"]
    monkeypatch.setenv("CONVEYOR_CACHE_DIR", str(tmp_path))  # a first start: --kernels auto measures
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert re.search(r"^kernels: (native, (256|512)-bit vectors|torch ops)", out, re.MULTILINE)
    assert re.search(r"^kernels: native, .*; auto \(measured in", out, re.MULTILINE)
    assert re.search(r"^\| lm_head +\| 65\+ +\|.*\| (native-(256|512)|torch) +\|$", out, re.MULTILINE), out
    assert picture.stat().st_size > 10_000
    saved = json.loads(table.read_text())
    measured = [p for p in saved["points"] if p["measured_tokens_per_s"] is not None]
    assert [p["batch_size"] for p in measured] == [1, 3]
    assert all(p["context_len"] == 16 and p["measured_tokens_per_s"] > 0 for p in measured)
    assert all(p["read_bandwidth"] > 1e9 for p in measured), "the roof read again around each measurement"
    assert all(p["read_bandwidth"] is None for p in saved["points"] if p["measured_tokens_per_s"] is None)
    assert len(saved["points"]) == 4  # two batch sizes at each of two contexts
    assert MachineFigures.load(machine_json).gemm_flops > 0  # the figures the simulator's cpu-local reads
    assert set(saved["kernel_choice"]["seconds"]) == {"qkv", "o", "gate_up", "down", "lm_head"}
    assert saved["machine"]["bandwidth_by"] in ("torch sum", "native 256-bit GEMV", "native 512-bit GEMV")
    assert saved["machine"]["gemm_by"] in ("torch", "native 256-bit", "native 512-bit")


def test_the_bandwidth_roof_is_the_fastest_read_the_machine_has():
    """Both reads are timed and the faster is the roof: a native GEMV that streams faster than torch's sum
    would otherwise put batch 1 over 100% of its bound."""
    bandwidth, by = ReadProbe(num_bytes=64 * 2**20).measure(repeats=2)
    assert bandwidth > 1e9
    assert by == "torch sum" or re.fullmatch(r"native (256|512)-bit GEMV", by)


def test_the_compute_roof_is_the_fastest_gemm_the_machine_has(monkeypatch):
    """Where the engine's own GEMM beats torch's, the roof is the engine's: a bound it beats would read over 100%."""
    native = measure_native_gemm(size=256, repeats=1)
    if native is None:
        pytest.skip("the native kernels cannot be built here (no C++ compiler)")
    assert native[0] > 0 and native[1].startswith("native ")
    monkeypatch.setattr("conveyor.benchmarks.machine.measure_gemm", lambda dtype: 50e9)
    monkeypatch.setattr("conveyor.benchmarks.machine.measure_native_gemm",
                        lambda bfloat16: (160e9, "native 512-bit bf16") if bfloat16 else (80e9, "native 512-bit"))
    assert fastest_gemm("float32") == (80e9, "native 512-bit")
    assert fastest_gemm("bfloat16") == (160e9, "native 512-bit bf16")
    assert fastest_gemm("float16") == (50e9, "torch")  # no native float16 GEMM
    monkeypatch.setattr("conveyor.benchmarks.machine.measure_gemm", lambda dtype: 90e9)
    assert fastest_gemm("float32") == (90e9, "torch")


def test_the_native_bf16_gemm_is_timed_where_the_cpu_has_it(kernels):
    from conveyor.model.native.kernels import BF16_FEATURE

    measured = measure_native_gemm(size=256, repeats=1, bfloat16=True)
    if not kernels.has_bfloat16():
        assert measured is None, f"no {BF16_FEATURE}: no native bf16 GEMM to time"
        return
    assert measured[0] > 0 and measured[1] == "native 512-bit bf16"


def test_quantized_weights_have_the_int8_roof():
    """Batch 64 on Q4_1 weights is held to the int8 kernels' rate, not to a float32 GEMM it does not run."""
    smol = load_model_config("SmolLM2-135M")
    q4 = WeightFormat("Q4_1/Q8_0", 5.0, 8.5)
    with_int8 = dataclasses.replace(MACHINE, int8_ops=400e9, int8_by="native int8 (vnni512)")
    float_roof = decode_point(machine_cost_model(smol, MACHINE, q4), 64, 128).bound_tokens_per_s
    int8_roof = decode_point(machine_cost_model(smol, with_int8, q4), 64, 128).bound_tokens_per_s
    assert int8_roof > 2 * float_roof  # compute-bound at 64 rows: 4x the roof, more than twice the bound
    float32 = WeightFormat("float32", 32.0, 32.0)  # float weights keep the GEMM's roof
    assert decode_point(machine_cost_model(smol, with_int8, float32), 64, 128).bound_tokens_per_s == pytest.approx(
        decode_point(machine_cost_model(smol, MACHINE, float32), 64, 128).bound_tokens_per_s)


def test_int8_gemm_measures_the_quantized_kernels():
    measured = measure_int8_gemm(size=512, rows=64, repeats=2)
    if measured is None:
        pytest.skip("no native kernels")
    ops, name = measured
    assert ops > 1e8 and name.startswith("native int8 (")  # a floor far below any AVX2 machine's rate
    assert name.endswith((", int8)", ", Q4_K)")), name  # the faster of the two weight forms, named
