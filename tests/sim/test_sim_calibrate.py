"""Calibration and validation against a real (tiny) engine: the grid is timed, the profile saved and used."""

from __future__ import annotations

import json
import math
import re

from conveyor.benchmarks.calibrate import Probe, calibrate, profiling_grid, time_probe
from conveyor.benchmarks.sim_validation import print_errors, run_pace, validate_suite
from conveyor.core.config import EngineConfig
from conveyor.engine import Engine
from conveyor.sim.cost import StepWork
from conveyor.sim.hardware import load_hardware
from conveyor.sim.profile import ProfiledCostModel, load_profile, step_cost_model
from conveyor.sim.validation import CASE_NAMES, FIGURES


def test_the_grid_covers_decode_batches_contexts_prompts_and_mixed_steps():
    names = [probe.name for probe in profiling_grid(32, 2048)]
    assert [n for n in names if n.startswith("decode") and n.endswith("context 48")] == [
        f"decode {b} x context 48" for b in (1, 2, 4, 8, 16, 32)]
    assert "decode 8 x context 1000" in names and "decode 16 x context 1000" not in names
    assert "prompt of 2048" in names and "8 prompts of 256" in names
    assert any("joining" in n for n in names) and any("over the budget" in n for n in names)
    assert all(prompt + output <= 300 for p in profiling_grid(4, 256, 300) for _, prompt, output in p.requests)
    shared = {p.name: p for p in profiling_grid(32, 2048) if p.prefixes}
    assert list(shared) == ["decode 16 over 4 shared prefixes of 320", "decode 8 over a shared prefix of 1280"]
    assert all(prompt > p.prefixes[0] for p in shared.values() for _, prompt, _ in p.requests)


def test_a_runs_pace_is_its_steps_time_over_their_price_and_each_kind_is_held_against_it():
    # A cost model whose price is a step's token count in seconds: the arithmetic can be checked by hand.
    class TokensPriced:
        def step_time(self, work: StepWork, block_size: int = 16) -> float:
            return float(work.num_tokens)

    decodes = StepWork(num_seqs=4, num_tokens=4, decode_rows=4)
    mixed = StepWork(num_seqs=2, num_tokens=10, decode_rows=1)
    # Steps started at 0.0 and 0.5 s (the first window: pace 1.5), then at 1.2 s (the second: pace 1.0).
    pace = run_pace([(decodes, 6.0, 0.0), (decodes, 6.0, 0.5), (mixed, 10.0, 1.2)], TokensPriced(), 16)
    assert pace["pace"] == 22.0 / 18.0
    assert pace["decodes"] == (12.0 / 8.0) / pace["pace"] and pace["with prompts"] == 1.0 / pace["pace"]
    assert math.isclose(pace["variation"], 0.25 / 1.25)  # windows at 1.5 and 1.0: deviation 0.25 about 1.25
    assert math.isnan(pace["few decodes"]) and math.isnan(pace["many decodes"])  # four rows: neither
    alone = run_pace([(decodes, 2.0, 0.0)], TokensPriced(), 16)
    assert alone["pace"] == 0.5 and alone["decodes"] == 1.0 and math.isnan(alone["with prompts"])
    assert alone["variation"] == 0.0  # one window: nothing to vary
    # Batches of one decode faster than their price, batches of 16 slower: the profile's shape has moved.
    one, many = StepWork(num_seqs=1, num_tokens=1, decode_rows=1), StepWork(num_seqs=16, num_tokens=16, decode_rows=16)
    split = run_pace([(one, 0.8, 0.0), (one, 0.8, 0.1), (many, 19.2, 0.2), (mixed, 10.0, 0.3)], TokensPriced(), 16)
    assert math.isclose(split["pace"], 30.8 / 28.0)
    assert math.isclose(split["few decodes"], 0.8 / split["pace"])
    assert math.isclose(split["many decodes"], 1.2 / split["pace"])


def test_an_error_is_marked_where_the_simulator_lies_among_the_real_runs(capsys):
    def result(runs: list[float], predicted: float) -> dict:
        figures = {key: 1.0 for _, key, _ in FIGURES}
        measured = {**figures, "ttft_mean_s": sorted(runs)[len(runs) // 2],
                    "runs": [{**figures, "ttft_mean_s": r, "pace": 1.0} for r in runs]}
        return {"case": "c", "measured": measured, "predicted": {**figures, "ttft_mean_s": predicted}}

    print_errors([result([1.0, 1.2, 2.0], 1.6), result([1.0, 1.2, 2.0], 2.1), result([1.0], 1.0)])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| c ")]
    ttft = [row.split("|")[3].strip() for row in rows]
    assert ttft == ["+33.3% *", "+75.0%", "+0.0%"]  # inside the range; outside it; one run has no range


def test_a_probe_times_every_step_with_its_work(tiny_model_dir):
    engine = Engine(EngineConfig(model=str(tiny_model_dir), max_num_seqs=4, max_num_batched_tokens=64))
    samples = time_probe(engine, Probe("p", ((0, 100, 3), (1, 10, 2))), __import__("random").Random(0))
    works = [work for work, _ in samples]
    assert works[0].num_tokens == 64 and works[0].num_sampled == 0  # the long prompt's first chunk
    assert sum(w.num_tokens for w in works) == 100 + 10 + 2 + 1  # prompts, then each decode
    assert all(seconds > 0 for _, seconds in samples)
    # Over a shared prefix of 32 (two blocks of 16): computed once, and the decodes read its blocks together.
    samples = time_probe(engine, Probe("s", ((0, 40, 3),) * 3, (32,)), __import__("random").Random(1))
    assert sum(w.num_tokens for w, _ in samples) == 40 + 2 * 8 + 3 * 2
    assert max(w.shared_decode_blocks for w, _ in samples) == 2 * 2


def test_calibrate_then_validate_against_the_real_engine(tiny_model_dir, tmp_path, monkeypatch, capsys):
    # Only the simulator's files move to tmp_path: the engine keeps its cache (compiled kernels, models).
    monkeypatch.setattr("conveyor.sim.hardware.cache_dir", lambda: tmp_path)
    monkeypatch.setattr("conveyor.sim.profile.cache_dir", lambda: tmp_path)
    (tmp_path / "machine.json").write_text(json.dumps({
        "memory_bandwidth": 1e10, "gemm_flops": 5e10, "dtype": "float32", "threads": 2, "cpu": "test",
        "measured_at": "now"}))
    config = EngineConfig(model=str(tiny_model_dir), max_num_seqs=4, max_num_batched_tokens=256, num_threads=1)
    profile = calibrate(config)
    saved = list((tmp_path / "sim" / "profiles").iterdir())
    assert len(saved) == 1 and load_profile(saved[0]) == profile
    assert profile.machine["threads"] == 1 and profile.fit["samples"] > 50
    assert profile.per_swapped_token_s > 0 and all(s >= 0 for s in profile.dense_s)
    # Decodes over a shared prefix were timed: their keys read again are priced.
    assert profile.per_shared_decode_key_s is not None
    out = capsys.readouterr().out
    assert "decode 4 x context 1000" in out and "calibrated in" in out
    engine_model = Engine(config).model_config
    cost, said = step_cost_model(engine_model, load_hardware("cpu-local"), "float32", threads=1)
    assert isinstance(cost, ProfiledCostModel), said

    results = validate_suite(config, num=6, seed=0, repeats=2)
    assert [r["case"] for r in results] == list(CASE_NAMES)
    for result in results:
        measured, predicted = result["measured"], result["predicted"]
        assert measured["num_requests"] == predicted["num_requests"] == 6
        assert measured["output_tokens"] == predicted["output_tokens"]
        assert result["priced_by"].startswith("step profile")
        assert [run["output_tokens"] for run in measured["runs"]] == [measured["output_tokens"]] * 2
        assert all(0.05 < run["pace"] < 20 for run in measured["runs"]), "each real run's pace, over its own steps"
    swap = results[-1]
    assert swap["measured"]["preemptions"] > 0 and swap["predicted"]["preemptions"] > 0
    out = capsys.readouterr().out
    assert "within 10% / 15%" in out and "shared-prefix" in out and "the machine's pace in each real run" in out
    assert "steps of decodes alone" in out and "its variation within the run" in out and "of 1-3 rows" in out
    assert re.search(r"steps priced by the step profile \S+, measured \d+ min ago", out)
    assert "lies within the range of the real runs' figures" in out
