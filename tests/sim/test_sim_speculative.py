"""Speculative decoding in the simulator: drafts and acceptance from a measured profile, priced by the cost
model, chosen by the engine's own scheduler (see conveyor/sim/speculative.py)."""

from __future__ import annotations

import json

import pytest

from conveyor.core.config import EngineConfig
from conveyor.core.spec import SpecDecodeStats
from conveyor.sim.cost import CostModel
from conveyor.sim.hardware import load_hardware, load_model_config
from conveyor.sim.simulator import simulate
from conveyor.sim.speculative import AcceptanceProfile, DraftAcceptance
from conveyor.sim.workload import WorkloadRequest

FIXED = '{"method": "ngram", "num_speculative_tokens": 4, "draft_length": "fixed"}'
AUTO = '{"method": "ngram", "num_speculative_tokens": 4}'


def _cost() -> CostModel:
    return CostModel(load_model_config("Llama-2-7B"), load_hardware("A100-80GB"), "float16")


def _run(spec: str | None, profile: AcceptanceProfile | None, requests: list[WorkloadRequest]) -> dict:
    config = EngineConfig(speculative_config=spec, kv_cache_memory="8GiB", enable_prefix_caching=False)
    return simulate(config, _cost(), requests, acceptance=profile)[0]


def test_a_profile_is_what_the_engines_counters_saw():
    stats = SpecDecodeStats(num_drafts=10, num_draft_tokens=30, num_accepted_tokens=15,
                            accepted_per_position=[8, 5, 2], carried_per_position=[10, 10, 10],
                            proposal_lengths=[5, 0, 0, 15])
    profile = AcceptanceProfile.from_stats(stats)
    assert profile.proposal_lengths == (0.25, 0.0, 0.0, 0.75)
    assert profile.acceptance == (0.8, 0.5, 0.2)
    assert profile.conditional() == pytest.approx((0.8, 0.625, 0.4))
    draws = DraftAcceptance(profile, seed=3)
    counts = [draws.accepted(3) for _ in range(20_000)]
    for position, share in enumerate(profile.acceptance):  # each position accepted as often as measured
        assert sum(c > position for c in counts) / len(counts) == pytest.approx(share, abs=0.015)


def test_bad_profiles_are_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="one entry more"):
        AcceptanceProfile((1.0,), (0.5,))
    with pytest.raises(ValueError, match="sum to 1"):
        AcceptanceProfile((0.5, 0.2), (0.5,))
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"acceptance": [0.5]}))
    with pytest.raises(ValueError, match="not a profile written by"):
        AcceptanceProfile.read(path)
    with pytest.raises(ValueError, match="needs an acceptance profile"):
        _run(FIXED, None, [WorkloadRequest(0.0, 100, 10)])


def test_drafts_that_are_always_accepted_pay_at_one_request_where_a_step_reads_the_weights():
    """One request on a memory-bound device: four drafts always offered and accepted make a step yield five
    tokens at about one step's cost."""
    always = AcceptanceProfile((0.0, 0.0, 0.0, 0.0, 1.0), (1.0, 1.0, 1.0, 1.0))
    requests = [WorkloadRequest(0.0, 200, 400)]
    plain, drafted = _run(None, None, requests), _run(FIXED, always, requests)
    assert plain["output_tokens_per_s"] * 3.5 < drafted["output_tokens_per_s"]
    assert drafted["spec_decode_acceptance_rate"] == 1.0 and drafted["spec_decode_tokens_per_drafted_step"] > 4.9


def test_auto_carries_drafts_that_are_never_accepted_only_while_it_learns_that():
    never = AcceptanceProfile((0.0, 0.0, 0.0, 0.0, 1.0), (0.0, 0.0, 0.0, 0.0))
    requests = [WorkloadRequest(0.0, 200, 100) for _ in range(64)]
    plain = _run(None, None, requests)
    fixed, auto = _run(FIXED, never, requests), _run(AUTO, never, requests)
    assert fixed["output_tokens_per_s"] < plain["output_tokens_per_s"]
    assert auto["output_tokens_per_s"] > 0.95 * plain["output_tokens_per_s"]
    assert auto["spec_decode_num_draft_tokens"] < fixed["spec_decode_num_draft_tokens"] / 10
