"""Prefix caching on the real engine: greedy tokens equal transformers' with cached prefixes, whatever the shape.

Prefixes end mid-block and exactly on a block boundary; one request is nothing but a cached prefix; prompts
are chunked over a cached prefix; a tiny pool forces preemption (recompute or swap) and re-admission;
block sizes 1 and 16; the native kernels and the torch ops.
"""

from __future__ import annotations

import random

import pytest

from conveyor import LLM, SamplingParams
from tests.harness import hf_greedy

GREEDY = SamplingParams(temperature=0.0, max_tokens=12)


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1000, 40000) for _ in range(n)]


def _shared_prompts(seed: int) -> list[list[int]]:
    """Prompts over two prefixes (32 tokens: on a 16-block boundary; 37: mid-block), one equal to a prefix."""
    rng = random.Random(seed)
    on_boundary, mid_block = _tokens(rng, 32), _tokens(rng, 37)
    return [
        on_boundary + _tokens(rng, 5),
        mid_block + _tokens(rng, 1),
        on_boundary,  # entirely a cached prefix: its last block is computed again for logits
        mid_block + _tokens(rng, 40),
        on_boundary + _tokens(rng, 17),
        mid_block,
    ]


@pytest.fixture(scope="module")
def reference(tiny_hf_model):
    cache: dict[tuple[int, ...], list[int]] = {}

    def tokens(prompt: list[int]) -> list[int]:
        if tuple(prompt) not in cache:
            cache[tuple(prompt)] = hf_greedy(tiny_hf_model, prompt, GREEDY.max_tokens)
        return cache[tuple(prompt)]

    return tokens


@pytest.mark.parametrize(
    "options",
    [
        dict(block_size=16),
        dict(block_size=1),
        dict(block_size=16, max_num_batched_tokens=20),  # chunked prefill over a cached prefix
        dict(block_size=4, num_kv_blocks=40, max_num_batched_tokens=64),  # preemption, re-admission
        dict(block_size=4, num_kv_blocks=40, max_num_batched_tokens=64, preemption_mode="swap"),
        dict(block_size=16, kernels="torch"),
    ],
    ids=["bs16", "bs1", "chunked", "tiny-pool-recompute", "tiny-pool-swap", "torch-bs16"],
)
def test_cached_prefixes_give_transformers_tokens(tiny_model_dir, reference, options):
    options.setdefault("num_kv_blocks", 1024)
    llm = LLM(str(tiny_model_dir), enable_prefix_caching=True, max_model_len=160, **options)
    prompts = _shared_prompts(seed=5)
    warm = llm.generate(prompts[:2], GREEDY, use_tqdm=False)  # fills the cache with both prefixes
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    for prompt, output in zip(prompts[:2] + prompts, warm + outputs):
        assert output.token_ids == reference(prompt), f"prompt of {len(prompt)} tokens"
    assert sum(o.num_cached_tokens for o in outputs) > 0, "the second batch should find the prefixes"
    if options["num_kv_blocks"] > 40:  # a repeated prompt is found up to its last token, in whole blocks
        block_size = options["block_size"]
        assert outputs[0].num_cached_tokens == (len(prompts[0]) - 1) // block_size * block_size
    stats = llm.engine.stats()
    assert stats.num_free_kv_blocks == stats.num_kv_blocks, "every block free (or cached) at the end"
    if options["num_kv_blocks"] == 40:
        assert sum(o.metrics.num_preemptions for o in warm + outputs) > 0, "the tiny pool should preempt"


def test_caching_on_and_off_give_the_same_tokens_and_on_computes_less(tiny_model_dir):
    rng = random.Random(9)
    system = _tokens(rng, 100)
    prompts = [system + _tokens(rng, rng.randint(1, 30)) for _ in range(12)]
    runs = {}
    for caching in (False, True):
        llm = LLM(str(tiny_model_dir), enable_prefix_caching=caching, num_kv_blocks=512)
        first = llm.generate(prompts[:1], GREEDY, use_tqdm=False)
        runs[caching] = (first + llm.generate(prompts[1:], GREEDY, use_tqdm=False), llm.engine.stats())
    (plain, plain_stats), (cached, cached_stats) = runs[False], runs[True]
    assert [o.token_ids for o in cached] == [o.token_ids for o in plain]
    assert sum(o.num_cached_tokens for o in plain) == 0 and plain_stats.prefix_cache_queries == 0
    assert all(o.num_cached_tokens == 96 for o in cached[1:]), "six full blocks of the 100-token system prompt"
    assert cached_stats.prefix_cache_hits == 11 * 96
    assert cached_stats.prefix_cache_queries == sum(len(p) for p in prompts)
