"""Partial prefills side by side and the fair policy change when tokens are computed, never which: greedy tokens
equal an unconstrained run's, request by request, on the tiny model."""

from __future__ import annotations

import random

import pytest

from conveyor import LLM, SamplingParams


def _workload():
    rng = random.Random(7)
    lengths = [300, 8, 5, 200, 12, 3, 40, 9]
    prompts = [[rng.randrange(1000, 40000) for _ in range(n)] for n in lengths]
    params = [SamplingParams(temperature=0.0, max_tokens=rng.randrange(2, 12), ignore_eos=True) for _ in prompts]
    return prompts, params


@pytest.mark.parametrize("options", [
    {"max_num_partial_prefills": 4, "max_long_partial_prefills": 1, "long_prefill_token_threshold": 32},
    {"max_num_partial_prefills": 2, "max_long_partial_prefills": 2, "scheduling_policy": "fair"},
], ids=["four-partial-prefills", "two-partial-prefills-fair"])
def test_partial_prefills_give_the_same_greedy_tokens(tiny_model_dir, options):
    prompts, params = _workload()
    reference = LLM(str(tiny_model_dir), num_kv_blocks=1024).generate(prompts, params, use_tqdm=False)
    llm = LLM(str(tiny_model_dir), num_kv_blocks=1024, max_num_batched_tokens=64, **options)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in reference]
