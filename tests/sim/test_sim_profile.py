"""The measured step profile: the fit recovers known timings, and a profile of something else is refused."""

from __future__ import annotations

import calendar
import dataclasses
import json
import random

import pytest

from conveyor.entrypoints.cli import main
from conveyor.sim.cost import CostModel, StepWork, chunk_attention_pairs
from conveyor.sim.hardware import load_hardware, load_model_config
from conveyor.sim.profile import (
    ProfiledCostModel,
    ProfileError,
    StepProfile,
    check_profile,
    decode_bucket,
    dense_weights,
    engine_fingerprint,
    fit_step_times,
    load_profile,
    new_profile,
    nonnegative_least_squares,
    profile_path,
    save_profile,
    step_cost_model,
    this_machine,
)

KNOTS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)
DENSE = (0.015, 0.0155, 0.016, 0.018, 0.022, 0.03, 0.05, 0.09, 0.17, 0.33, 0.65, 1.3)
TRUTH = {"per_sequence_s": 2e-4, "per_sampled_row_s": 5e-4, "per_prompt_pair_s": 3e-8,
         "per_decode_key_s": (8e-7, 5e-7, 3e-7, 2e-7, 2e-7)}  # by decode rows: 1, 2-3, 4-7, 8-15, 16+
MODEL = load_model_config("SmolLM2-135M")


def true_time(work: StepWork) -> float:
    dense = sum(w * DENSE[i] for i, w in dense_weights(KNOTS, work.num_tokens))
    return dense + (work.num_seqs * TRUTH["per_sequence_s"] + work.num_sampled * TRUTH["per_sampled_row_s"]
                    + work.decode_context * TRUTH["per_decode_key_s"][decode_bucket(work.decode_rows)]
                    + work.prompt_pairs * TRUTH["per_prompt_pair_s"])


def grid() -> list[StepWork]:
    """The shapes calibration times: decodes over three contexts, prompts alone and eight at once, mixes,
    and a chunk that samples nothing."""
    shapes = [StepWork(b, b, b, b * c, b * c, 0, b * c, b) for b in (1, 2, 4, 8, 16, 32) for c in (48, 320, 1000)]
    for n in (16, 64, 128, 256, 512, 1024, 2048):
        shapes.append(StepWork(1, n, 1, chunk_attention_pairs(0, n), n))
        shapes.append(StepWork(8, n, 8, 8 * chunk_attention_pairs(0, n // 8), n))
        shapes.append(StepWork(1, n, 0, chunk_attention_pairs(0, n), n))
        shapes.append(StepWork(9, n + 8, 9, chunk_attention_pairs(0, n) + 8 * 200, n + 8 * 201, 0, 8 * 200, 8))
    return shapes


def synthetic_profile(**changes) -> StepProfile:
    fitted = {"dense_tokens": KNOTS, "dense_s": DENSE, **TRUTH}
    profile = new_profile(fitted, 1e-6, this_machine(2), MODEL, "float32", 16)
    return dataclasses.replace(profile, **changes)


def test_the_fit_recovers_the_table_and_the_parts_that_made_the_times():
    rng = random.Random(0)
    samples = [(w, true_time(w) * (1 + rng.gauss(0, 0.01))) for w in grid() for _ in range(3)]
    fitted = fit_step_times(samples)
    assert fitted["dense_tokens"] == KNOTS
    for got, want in zip(fitted["dense_s"], DENSE):
        assert got == pytest.approx(want, rel=0.08)
    assert fitted["per_decode_key_s"] == pytest.approx(TRUTH["per_decode_key_s"], rel=0.15)
    # Requests and sampled rows come together in most steps: their sum is what the data pins down.
    together = fitted["per_sequence_s"] + fitted["per_sampled_row_s"]
    assert together == pytest.approx(TRUTH["per_sequence_s"] + TRUTH["per_sampled_row_s"], rel=0.2)
    profile = new_profile(fitted, 0.0, this_machine(2), MODEL, "float32", 16)
    errors = [abs(profile.step_time(w) / true_time(w) - 1) for w in grid()]
    assert max(errors) < 0.05


def test_keys_in_blocks_an_earlier_decode_read_get_a_price_of_their_own():
    """Decodes over shared prefixes: the fit finds the price of a key read again apart from the others', and
    a profile measured without such steps prices them as the others."""
    rng, again = random.Random(1), 1.2e-7

    def timed(work: StepWork) -> float:
        shared = 16 * work.shared_decode_blocks
        return true_time(work) - shared * (TRUTH["per_decode_key_s"][decode_bucket(work.decode_rows)] - again)

    prefixed = [StepWork(b, b, b, b * 352, b * 352, 0, b * 352, b, (b - p) * 20) for b, p in ((16, 4), (8, 1))]
    # Nine steps of each prefixed shape, as a probe decodes nine.
    samples = [(w, timed(w)) for w in grid() for _ in range(3)] + [(w, timed(w)) for w in prefixed for _ in range(9)]
    fitted = fit_step_times(samples)
    assert fitted["per_shared_decode_key_s"] == pytest.approx(again, rel=1e-3)
    # The keys read again are a few percent of a step: with 1% noise on every step their own price is loose,
    # and the steps' prices still hold.
    noisy = new_profile(fit_step_times([(w, t * (1 + rng.gauss(0, 0.01))) for w, t in samples]), 0.0,
                        this_machine(2), MODEL, "float32", 16)
    for work in prefixed:
        assert noisy.step_time(work) == pytest.approx(timed(work), rel=0.03)
    profile = new_profile(fitted, 0.0, this_machine(2), MODEL, "float32", 16)
    unmeasured = new_profile(fit_step_times(samples[: 3 * len(grid())]), 0.0, this_machine(2), MODEL, "float32", 16)
    assert unmeasured.per_shared_decode_key_s is None
    alike = dataclasses.replace(prefixed[0], shared_decode_blocks=0)
    assert unmeasured.step_time(prefixed[0]) == unmeasured.step_time(alike)
    assert StepProfile.from_json(profile.to_json()) == profile


def test_steps_a_stray_process_slowed_are_dropped_from_the_fit():
    samples = [(w, true_time(w)) for w in grid() for _ in range(5)]  # a decode probe times nine steps of a shape
    slowed = [(w, 3 * t) for w, t in samples[::50]]
    fitted = fit_step_times(samples + slowed)
    assert fitted["fit"]["outliers_dropped"] == len(slowed)
    assert fitted["dense_s"][0] == pytest.approx(DENSE[0], rel=0.02)


def test_nonnegative_least_squares_clamps_what_plain_least_squares_would_make_negative():
    # b = 2 * col0 exactly: x = (2, 0).
    rows = [[1.0, 1.0], [2.0, 1.0], [3.0, 1.0]]
    assert nonnegative_least_squares(rows, [2.0, 4.0, 6.0]) == pytest.approx([2.0, 0.0], abs=1e-6)
    # Unconstrained, b = 1 - col0 would need a negative slope; the best x >= 0 puts it to 0.
    x = nonnegative_least_squares(rows, [0.0, -1.0, -2.0])
    assert x[0] == 0.0 and x[1] >= 0.0


def test_decode_keys_are_priced_by_how_many_decode_rows_share_the_step():
    assert [decode_bucket(rows) for rows in (0, 1, 2, 3, 4, 7, 8, 15, 16, 200)] == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]
    profile = synthetic_profile()
    alone, shared = StepWork(1, 1, 1, 500, 500, 0, 500, 1), StepWork(1, 1, 1, 500, 500, 0, 500, 16)
    assert profile.step_time(alone) - profile.step_time(shared) == pytest.approx(500 * (8e-7 - 2e-7))
    raw = profile.to_json() | {"per_decode_key_s": 2e-7}  # a profile from before the buckets
    with pytest.raises(ProfileError, match="one price per bucket"):
        StepProfile.from_json(raw)


def test_the_dense_table_interpolates_and_extends_its_last_segment():
    profile = synthetic_profile()
    assert profile.dense_time(128) == pytest.approx(0.09)
    assert profile.dense_time(96) == pytest.approx((0.05 + 0.09) / 2)
    assert profile.dense_time(4096) == pytest.approx(1.3 + (1.3 - 0.65) * 2)
    swap_only = StepWork(swap_blocks=3)
    assert profile.step_time(swap_only, block_size=16) == pytest.approx(3 * 16 * 1e-6)


def test_a_profile_of_another_model_dtype_or_engine_version_is_refused(monkeypatch):
    profile = synthetic_profile()
    check_profile(profile, MODEL, "float32")
    with pytest.raises(ProfileError, match="another model"):
        check_profile(profile, load_model_config("Llama-2-7B"), "float32")
    with pytest.raises(ProfileError, match="float32, not bfloat16"):
        check_profile(profile, MODEL, "bfloat16")
    with pytest.raises(ProfileError, match="tensor parallelism"):
        check_profile(profile, MODEL, "float32", tensor_parallel_size=2)
    check_profile(profile, MODEL, "float32", kv_element_bytes=4)  # the dtype's, as the profile timed
    with pytest.raises(ProfileError, match="KV cache of 4-byte elements, not 2"):
        check_profile(profile, MODEL, "float32", kv_element_bytes=2)  # a float16 cache reads half the bytes
    float16 = dataclasses.replace(profile, kv_element_bytes=2)
    check_profile(float16, MODEL, "float32", kv_element_bytes=2)
    with pytest.raises(ProfileError, match="KV cache of 2-byte elements, not 4"):
        check_profile(float16, MODEL, "float32")
    monkeypatch.setattr("conveyor.sim.profile.engine_version", lambda: "9.9.9")
    with pytest.raises(ProfileError, match=r"stale.*conveyor simulate calibrate"):
        check_profile(profile, MODEL, "float32")


def test_the_fingerprint_follows_the_engines_code(tmp_path):
    (tmp_path / "csrc").mkdir()
    (tmp_path / "csrc" / "kernels.cpp").write_text("int f() { return 1; }")
    before = engine_fingerprint(tmp_path)
    (tmp_path / "csrc" / "kernels.cpp").write_text("int f() { return 2; }")
    assert engine_fingerprint(tmp_path) != before
    (tmp_path / "sim").mkdir()
    after = engine_fingerprint(tmp_path)
    (tmp_path / "sim" / "cost.py").write_text("# the simulator is not the engine")
    assert engine_fingerprint(tmp_path) == after
    assert engine_fingerprint() != after  # the package's own code


def test_each_machine_isa_and_thread_count_has_its_own_profile_file():
    avx2 = {"cpu": "AMD EPYC", "isa": ["avx2", "fma"], "threads": 2, "device": "cpu"}
    avx512 = {**avx2, "isa": ["avx2", "fma", "avx512f"]}
    paths = {profile_path(m, MODEL, "float32") for m in (avx2, avx512, {**avx2, "threads": 1})}
    assert len(paths) == 3
    assert profile_path(avx2, MODEL, "float32") != profile_path(avx2, MODEL, "bfloat16")


def test_cpu_local_prices_steps_by_this_machines_current_profile_else_the_roofline(machine_cache, monkeypatch):
    cpu = load_hardware("cpu-local")
    cost, said = step_cost_model(MODEL, cpu, "float32", threads=2)
    assert type(cost) is CostModel and "no step profile" in said
    path = save_profile(synthetic_profile(), MODEL)
    cost, said = step_cost_model(MODEL, cpu, "float32", threads=2)
    assert isinstance(cost, ProfiledCostModel) and str(path) in said
    assert cost.step_time(StepWork(1, 1, 1, 10, 10, 0, 10, 1)) == pytest.approx(0.015 + 7e-4 + 8e-6)
    assert type(step_cost_model(MODEL, cpu, "float32", threads=1)[0]) is CostModel  # measured with 2 threads
    assert type(step_cost_model(MODEL, load_hardware("A100-80GB"), "float32", threads=2)[0]) is CostModel
    assert type(step_cost_model(MODEL, cpu, "float32", step_profile="none", threads=2)[0]) is CostModel
    monkeypatch.setattr("conveyor.sim.profile.engine_version", lambda: "9.9.9")  # the engine changed since
    cost, said = step_cost_model(MODEL, cpu, "float32", threads=2)
    assert type(cost) is CostModel and "stale" in said
    with pytest.raises(ProfileError, match="stale"):
        step_cost_model(MODEL, cpu, "float32", step_profile=str(path))


def test_a_profile_file_prices_any_hardware_the_simulator_names(machine_cache, capsys):
    path = save_profile(synthetic_profile(), MODEL)
    assert load_profile(path) == synthetic_profile(measured_at=load_profile(path).measured_at)
    args = ["simulate", "--hardware", "A100-80GB", "--model-config", "SmolLM2-135M", "--dtype", "float32",
            "--num-requests", "20", "--json", str(machine_cache / "out.json")]
    assert main([*args, "--step-profile", str(path)]) == 0
    profiled = json.loads((machine_cache / "out.json").read_text())
    assert f"steps priced by the step profile {path}" in capsys.readouterr().err
    assert main(args) == 0
    roofline = json.loads((machine_cache / "out.json").read_text())
    assert profiled["steps_priced_by"] == f"step profile {path}" and roofline["steps_priced_by"] == "roofline"
    assert profiled["output_tokens_per_s"] < roofline["output_tokens_per_s"] / 10  # a CPU's steps, not an A100's
    (machine_cache / "bad.json").write_text("{}")
    assert main([*args, "--step-profile", str(machine_cache / "bad.json")]) == 2
    assert "not a step profile" in capsys.readouterr().err


def test_a_profiles_age_is_read_from_its_stamp_and_an_unreadable_stamp_has_none():
    stamped = synthetic_profile(measured_at="2026-12-03T06:00:00Z")
    assert stamped.age_s(now=calendar.timegm((2026, 12, 3, 6, 30, 0, 0, 0, 0))) == 1800.0
    assert synthetic_profile(measured_at="").age_s() is None
    assert synthetic_profile(measured_at="now").age_s() is None  # edited by hand: no age, no failure


def test_a_mixture_of_experts_prices_a_step_between_entries_by_the_experts_it_touches():
    """Decode steps whose time is the shared weights plus each distinct expert read (64 experts, top-8):
    priced from the entries at 8 and 16 tokens, a 12-token step comes out as the experts it touches say; placed
    by its tokens instead, as a dense model's is, it would be 3% off."""
    from conveyor.sim.cost import expected_experts

    experts = (64, 8)
    knots = (1, 2, 4, 8, 16, 32)

    def step_s(tokens: int) -> float:
        return 0.004 + 0.0004 * expected_experts(*experts, tokens)

    profile = synthetic_profile(dense_tokens=knots, dense_s=tuple(step_s(t) for t in knots), experts=experts)
    assert profile.dense_time(12) == pytest.approx(step_s(12), rel=1e-9)
    by_tokens = sum(w * step_s(knots[i]) for i, w in dense_weights(knots, 12))
    assert abs(by_tokens / step_s(12) - 1) > 0.03
    assert profile.dense_time(64) == pytest.approx(step_s(32) + (step_s(32) - step_s(16)) * 2, rel=1e-9)
    assert StepProfile.from_json(json.loads(json.dumps(profile.to_json()))).experts == experts
    samples = [(StepWork(b, b, b, 0, 0, 0, 0, b), step_s(b)) for b in range(1, 33)]
    fitted = fit_step_times(samples, experts=experts)
    fitted_profile = new_profile(fitted, 0.0, this_machine(2), MODEL, "float32", 16)
    assert fitted_profile.experts == experts
    assert max(abs(fitted_profile.dense_time(b) + fitted_profile.per_sequence_s * b
                   + fitted_profile.per_sampled_row_s * b - step_s(b)) / step_s(b) for b in range(1, 33)) < 0.02
