"""Calibration: the fit recovers known efficiencies, and the whole command runs against a real (tiny) engine."""

from __future__ import annotations

import dataclasses
import json

import pytest

from conveyor.bench.calibrate import Measurement, calibrate, fit, validate
from conveyor.core.config import EngineConfig
from conveyor.sim.cost import CostModel, StepWork, chunk_attention_pairs
from conveyor.sim.hardware import HardwareSpec, load_hardware, load_model_config

CPU = HardwareSpec("test-cpu", {"float32": 1e11}, memory_bandwidth=2e10, memory_capacity=2**34,
                   host_link_bandwidth=1e10)
SHAPES = [
    StepWork(1, 1, 1, 70, 70),
    StepWork(8, 8, 8, 560, 560),
    StepWork(32, 32, 32, 2240, 2240),
    StepWork(4, 4, 4, 4 * 520, 4 * 520),  # long contexts: attention's share grows
    StepWork(1, 512, 1, chunk_attention_pairs(0, 512), 512),
]


def test_the_fit_recovers_the_efficiencies_and_overheads_that_made_the_times():
    model = load_model_config("SmolLM2-135M")
    truth = dataclasses.replace(CPU, flops_efficiency=0.3, bandwidth_efficiency=0.6, attention_efficiency=0.05,
                                step_overhead_s=0.02, per_sequence_overhead_s=0.001)
    cost = CostModel(model, truth, "float32")
    measurements = [Measurement(str(i), work, cost.step_time(work)) for i, work in enumerate(SHAPES)]
    fitted = fit(model, CPU, "float32", measurements)
    refit = CostModel(model, dataclasses.replace(CPU, **fitted), "float32")
    for m in measurements:
        assert refit.step_time(m.work) == pytest.approx(m.seconds, rel=0.03)
    assert fitted["flops_efficiency"] == pytest.approx(0.3, rel=0.1)
    assert fitted["bandwidth_efficiency"] == pytest.approx(0.6, rel=0.15)
    assert fitted["attention_efficiency"] == pytest.approx(0.05, rel=0.15)
    assert fitted["step_overhead_s"] == pytest.approx(0.02, rel=0.25)


def test_calibrate_and_validate_run_against_the_real_engine(tiny_model_dir, tmp_path, monkeypatch, capsys):
    # Only the simulator's files move to tmp_path: the engine keeps its cache (compiled kernels, models).
    monkeypatch.setattr("conveyor.sim.hardware.cache_dir", lambda: tmp_path)
    (tmp_path / "machine.json").write_text(json.dumps({
        "memory_bandwidth": 1e10, "gemm_flops": 5e10, "dtype": "float32", "threads": 2, "cpu": "test",
        "measured_at": "now"}))
    config = EngineConfig(model=str(tiny_model_dir), max_num_seqs=4, num_kv_blocks=256)
    calibrate(config, batch_sizes=[1, 4], prompt_len=8, steps=2, prefill_len=64, long_context=(2, 48))
    saved = json.loads((tmp_path / "cpu-local-calibration.json").read_text())
    assert [m["shape"] for m in saved["measurements"]] == [
        "decode, batch 1, context 12", "decode, batch 4, context 12", "decode, batch 2, context 52",
        "prefill, 64 tokens",
    ]
    assert all(m["measured_s"] > 0 for m in saved["measurements"])
    assert load_hardware("cpu-local").step_overhead_s == saved["step_overhead_s"]
    result = validate(config, num_prompts=4, seed=0, output_range=(2, 6))
    measured, predicted = result["measured"], result["predicted"]
    assert measured["output_tokens"] == predicted["output_tokens"]
    assert measured["num_requests"] == predicted["num_requests"] == 4
    assert "real engine" in capsys.readouterr().out
