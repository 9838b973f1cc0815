"""Logprobs against transformers on the same weights: each chosen token's logprob is log_softmax of
transformers' logits at that position, the alternatives are the top of that distribution in order, and the
prompt's logprobs are those of the prompt tokens. Tolerance: 1e-4 absolute (float32, two implementations
of the same network; their logits agree to about 1e-5)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conveyor import LLM, SamplingParams

TOLERANCE = 1e-4
PROMPTS = [[5012, 318, 257, 1332, 13, 383, 3329], [1000 + 37 * i for i in range(23)], [48000, 7, 7, 7]]


@pytest.fixture(scope="module")
def tiny_llm(tiny_model_dir: Path) -> LLM:
    return LLM(str(tiny_model_dir), num_kv_blocks=512)


def hf_logprobs(hf_model, token_ids: list[int]) -> torch.Tensor:
    """[len(token_ids), vocab]: row i is the distribution of the token after token_ids[: i + 1]."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([token_ids])).logits[0]
    return logits.float().log_softmax(-1)


def test_sampled_and_top_logprobs_equal_transformers(tiny_llm: LLM, tiny_hf_model) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=10, logprobs=5, ignore_eos=True)
    for out in tiny_llm.generate(PROMPTS, params, use_tqdm=False):
        assert len(out.logprobs) == len(out.token_ids) == 10
        reference = hf_logprobs(tiny_hf_model, out.prompt_token_ids + out.token_ids)
        for i, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
            row = reference[len(out.prompt_token_ids) - 1 + i]
            assert entry.token_id == token and entry.rank == 1  # greedy picks the top token
            assert entry.logprob == pytest.approx(row[token].item(), abs=TOLERANCE)
            values = [value for _, value in entry.top]
            assert values == sorted(values, reverse=True) and len(values) == 5
            assert values == pytest.approx(row.topk(5).values.tolist(), abs=TOLERANCE)
            assert entry.top[0][0] == token


def test_logprobs_come_from_the_raw_distribution_with_rank(tiny_llm: LLM, tiny_hf_model) -> None:
    """A bias that forces a token changes what is drawn, not the logprobs reported: they are the model's."""
    forced = 4321
    params = SamplingParams(temperature=0.0, max_tokens=3, logprobs=0, logit_bias={forced: 100.0})
    out = tiny_llm.generate([PROMPTS[0]], params, use_tqdm=False)[0]
    assert out.token_ids == [forced] * 3
    reference = hf_logprobs(tiny_hf_model, out.prompt_token_ids + out.token_ids)
    for i, entry in enumerate(out.logprobs):
        row = reference[len(out.prompt_token_ids) - 1 + i]
        assert entry.logprob == pytest.approx(row[forced].item(), abs=TOLERANCE) and entry.top == ()
        assert entry.rank == int((row > row[forced]).sum()) + 1 > 1


def test_prompt_logprobs_equal_transformers_even_with_a_cached_prefix(tiny_llm: LLM, tiny_hf_model) -> None:
    prompt = PROMPTS[1]
    tiny_llm.generate([prompt], SamplingParams(max_tokens=1), use_tqdm=False)  # its blocks are in the cache now
    out = tiny_llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=3), use_tqdm=False)[0]
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    reference = hf_logprobs(tiny_hf_model, prompt)
    for position, entry in enumerate(out.prompt_logprobs[1:], start=1):
        assert entry.token_id == prompt[position]
        assert entry.logprob == pytest.approx(reference[position - 1, prompt[position]].item(), abs=TOLERANCE)
        assert [v for _, v in entry.top] == pytest.approx(reference[position - 1].topk(3).values.tolist(),
                                                          abs=TOLERANCE)


def test_prompt_logprobs_survive_chunked_prefill(tiny_model_dir: Path, tiny_hf_model) -> None:
    """A prompt computed in chunks of 8 tokens still gets every position's logprob."""
    llm = LLM(str(tiny_model_dir), num_kv_blocks=256, max_num_batched_tokens=8, max_num_seqs=2)
    prompt = PROMPTS[1]
    out = llm.generate([prompt], SamplingParams(max_tokens=2, prompt_logprobs=0), use_tqdm=False)[0]
    reference = hf_logprobs(tiny_hf_model, prompt)
    got = [entry.logprob for entry in out.prompt_logprobs[1:]]
    assert got == pytest.approx([reference[p - 1, prompt[p]].item() for p in range(1, len(prompt))], abs=TOLERANCE)
