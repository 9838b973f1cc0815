"""Blocks of a request's own tokens indexed only if it is preempted (``Request.private_after``) against every
block indexed as it fills: identical simulations, request by request and step by step, on random workloads and
settings that force preemption, swap, prefix sharing and conversations."""

from __future__ import annotations

import dataclasses
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import conveyor.sim.simulator as simulator
from conveyor.core.config import EngineConfig
from conveyor.core.kv.prefix_cache import UNINDEXED
from tests.sim.test_sim_fast_forward import CONFIGS, _run, _workload, random_case


def _everything_indexed(monkeypatch: pytest.MonkeyPatch) -> None:
    plain = simulator.workload_request
    monkeypatch.setattr(simulator, "workload_request",
                        lambda *args: dataclasses.replace(plain(*args), private_after=None))


def _compare(config: EngineConfig, workload, conversations, fast_forward: bool) -> simulator.Simulation:
    held_back, figures, steps = _run(config, workload, conversations, fast_forward, True)
    with pytest.MonkeyPatch.context() as patch:
        _everything_indexed(patch)
        indexed, want_figures, want_steps = _run(config, workload, conversations, fast_forward, True)
    assert held_back.finished == indexed.finished
    assert figures == want_figures
    assert steps == want_steps
    return held_back


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(CONFIGS, st.integers(0, 10**6), st.booleans(), st.booleans())
def test_holding_back_own_blocks_changes_nothing_a_simulation_shows(options, seed, conversing, fast_forward):
    _compare(*random_case(options, seed, conversing), fast_forward)


def test_a_long_run_holds_back_blocks_and_indexes_them_for_preempted_requests():
    """A pool that runs short: requests are preempted (their blocks indexed as they leave, found again when
    they return) and others finish (their blocks cached unindexed, evicted in their turn)."""
    rng = random.Random(3)
    workload = _workload(rng, 120, 300, 400)
    config = EngineConfig(block_size=4, max_num_seqs=24, max_num_batched_tokens=64, num_kv_blocks=600,
                          max_model_len=1200)
    for fast_forward in (False, True):
        run = _compare(config, workload, None, fast_forward)
        assert run.finished.preemptions > 0 and run.finished.cached_tokens > 0
        pool = run.core.scheduler.kv_manager.pool
        unindexed = sum(1 for node in pool._node_of.values() if node is UNINDEXED)
        assert 0 < unindexed < pool.num_cached  # finished requests' own blocks, beside indexed shared ones
