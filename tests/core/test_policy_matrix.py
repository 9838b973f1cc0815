"""Every policy combination gives the same greedy tokens, request by request, under memory pressure.

The policies decide who runs when, never what a request computes: static or
continuous, paged or contiguous, recompute or swap, FCFS, priority or slo must
all agree with an unconstrained run, token for token.
"""

from __future__ import annotations

import itertools
import random

import pytest

from conveyor import LLM, SamplingParams


def _workload():
    rng = random.Random(41)
    prompts = [[rng.randrange(1000, 40000) for _ in range(rng.randrange(2, 50))] for _ in range(10)]
    params = [SamplingParams(temperature=0.0, max_tokens=rng.randrange(2, 30), ignore_eos=True) for _ in prompts]
    priorities = [rng.randrange(0, 3) for _ in prompts]
    return prompts, params, priorities


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    prompts, params, _ = _workload()
    return [o.token_ids for o in LLM(str(tiny_model_dir), num_kv_blocks=1024).generate(prompts, params,
                                                                                       use_tqdm=False)]


COMBINATIONS = list(itertools.product(["continuous", "static"], ["paged", "contiguous"], ["recompute", "swap"],
                                      ["fcfs", "priority"]))


@pytest.mark.parametrize(("scheduler", "kv_layout", "preemption_mode", "policy"), COMBINATIONS,
                         ids=["-".join(c) for c in COMBINATIONS])
def test_policies_agree_token_for_token(tiny_model_dir, reference, scheduler, kv_layout, preemption_mode, policy):
    prompts, params, priorities = _workload()
    # Paged: 24 blocks of 4 cannot hold 4 growing requests, so requests are preempted.
    # Contiguous: room for 3 slabs of 32 slots, so admission is what the memory limits.
    llm = LLM(str(tiny_model_dir), scheduler=scheduler, kv_layout=kv_layout, preemption_mode=preemption_mode,
              scheduling_policy=policy, num_kv_blocks=24, block_size=4, max_model_len=80 if kv_layout == "paged"
              else 32, max_num_seqs=4, swap_space=40_000)
    if kv_layout == "contiguous":
        kept = [i for i, p in enumerate(prompts) if len(p) + params[i].max_tokens <= 32]
        prompts, params, priorities = [prompts[i] for i in kept], [params[i] for i in kept], [priorities[i]
                                                                                             for i in kept]
        expected = [reference[i] for i in kept]
    else:
        expected = reference
    outputs = llm.generate(prompts, params, use_tqdm=False, priority=priorities)
    assert [o.token_ids for o in outputs] == expected
    stats = llm.engine.stats()
    assert stats.num_free_kv_blocks == stats.num_kv_blocks
    if kv_layout == "paged":
        assert stats.num_preemptions > 0, "the small pool should force preemption"


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_slo_agrees_token_for_token_under_tight_targets(tiny_model_dir, reference, preemption_mode):
    """Targets so tight that the slo policy's every rule acts (late requests last, victims by slack, steps held
    short for the running): still the unconstrained run's tokens, and the pool whole at the end."""
    prompts, params, _ = _workload()
    llm = LLM(str(tiny_model_dir), scheduling_policy="slo", preemption_mode=preemption_mode, num_kv_blocks=24,
              block_size=4, max_model_len=80, max_num_seqs=4, swap_space=40_000, ttft_slo_ms=20, tpot_slo_ms=2)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in outputs] == reference
    stats = llm.engine.stats()
    assert stats.num_free_kv_blocks == stats.num_kv_blocks and stats.num_preemptions > 0
