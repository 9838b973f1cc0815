"""A request's greedy tokens and logprobs are the same bits alone as in any batch: a property test.

Random mixes of 1-64 requests on the tiny model with prompts of 1-600 tokens, some sharing a prefix, with
prefix caching on and chunked prefill (48 tokens a step, so prompts are cut beside other requests' decodes), on
the native stack: float32 weights on the packed GEMMs, int8 weights on the quantized kernels, and int8 with
n-gram drafts verified in the step. Each request's tokens and sampled logprobs equal its run alone. The float
path runs `--kernels native`, since `--kernels auto` may give one row count torch's GEMM. One thread against two
is `kernel_check`'s (tests/model/test_kernel_library.py): the thread count is the process's.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conveyor.core.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=1)


DRAFTS = '{"method": "ngram", "prompt_lookup_min": 1, "draft_length": "fixed"}'


@pytest.fixture(scope="module", params=[("none", None), ("int8", None), ("int8", DRAFTS)],
                ids=["float32", "int8", "int8-drafts"])
def llm(request, tiny_model_dir):
    from conveyor.entrypoints.llm import LLM

    quantization, drafts = request.param
    return LLM(str(tiny_model_dir), num_kv_blocks=1024, kernels="native", quantization=quantization,
               max_num_batched_tokens=48, enable_prefix_caching=True, speculative_config=drafts)


@st.composite
def mixes(draw: st.DrawFn) -> list[list[int]]:
    """1-64 prompts of 1-600 tokens, some starting with a shared prefix of up to 200; lengths are drawn (and
    shrunk) by hypothesis, the tokens from a drawn seed (lists of hundreds of drawn tokens would be slow)."""
    rng = random.Random(draw(st.integers(0, 2**32 - 1)))

    def tokens(count: int) -> list[int]:
        return [rng.randrange(100, 40_000) for _ in range(count)]

    shared = tokens(draw(st.integers(0, 200)))
    return [(shared if draw(st.booleans()) else []) + tokens(draw(st.integers(1, 400)))
            for _ in range(draw(st.integers(1, 64)))]


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(prompts=mixes())
def test_each_request_alone_equals_its_run_in_the_batch(llm, prompts) -> None:
    together = llm.generate(prompts, GREEDY, use_tqdm=False)
    for prompt, batched in zip(prompts, together, strict=True):
        alone = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
        assert alone.token_ids == batched.token_ids
        assert alone.logprobs == batched.logprobs, "the same tokens, other logprob bits"
