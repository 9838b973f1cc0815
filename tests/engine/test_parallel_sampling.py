"""n > 1 (parallel sampling): n sequences per prompt that share the prompt's KV blocks.

Sequence 0 computes the prompt; the others join when it is computed and find it in the prefix cache.
Sequence ``i`` of a seeded request draws what a lone request with seed ``seed + i`` draws.
"""

from __future__ import annotations

import random

import pytest

from conveyor import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(str(tiny_model_dir), num_kv_blocks=512)


def _prompt(seed: int, n: int = 70) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 40000) for _ in range(n)]


def test_seeded_sequences_equal_lone_requests_with_consecutive_seeds(llm):
    prompts = [_prompt(1), _prompt(2, 33)]
    params = SamplingParams(n=3, temperature=1.0, top_p=0.9, seed=11, max_tokens=8)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.index for o in outputs] == [0, 1, 2, 0, 1, 2]
    for k, prompt in enumerate(prompts):
        alone = [llm.generate([prompt], SamplingParams(temperature=1.0, top_p=0.9, seed=11 + i, max_tokens=8),
                              use_tqdm=False)[0].token_ids for i in range(3)]
        assert [o.token_ids for o in outputs[3 * k : 3 * k + 3]] == alone
        assert all(o.prompt_token_ids == prompt for o in outputs[3 * k : 3 * k + 3])
    assert len({tuple(o.token_ids) for o in outputs[:3]}) > 1, "different seeds draw different tokens"


def test_the_other_sequences_find_the_prompt_in_the_cache(llm):
    prompt = _prompt(3)  # 70 tokens: 4 full blocks of 16
    outputs = llm.generate([prompt], SamplingParams(n=4, temperature=0.0, max_tokens=6), use_tqdm=False)
    assert outputs[0].num_cached_tokens == 0
    assert [o.num_cached_tokens for o in outputs[1:]] == [64, 64, 64]
    single = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=6), use_tqdm=False)[0]
    assert all(o.token_ids == single.token_ids for o in outputs), "greedy sequences are all the same"


def test_aborting_the_request_ends_every_sequence(llm):
    engine = llm.engine
    engine.add_request(_prompt(4), SamplingParams(n=3, temperature=1.0, max_tokens=50), request_id="fan")
    seen = set()
    while len(seen) < 3:
        seen |= {o.index for o in engine.step()}
    assert engine.abort_request("fan")
    assert not engine.has_unfinished_requests() and engine.stats().num_free_kv_blocks == 512
    assert not engine.abort_request("fan")
    with pytest.raises(ValueError, match="n must be an integer from 1 to 64"):
        SamplingParams(n=65)
