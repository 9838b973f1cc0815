"""Speculative decoding on the real model: greedy output identical with and without drafts (and to
transformers), in every way a step can be made (alone, batched, prefix caching, chunked prefill, recompute
and swap preemption, n > 1, max_tokens and stop strings inside an accepted draft), and for sampling the rule
that keeps the output's distribution: token frequencies with and without drafts agree (chi-square).

The default model (float32 folder, as transformers loads it) on prompts whose answers repeat their input:
drafts are accepted there, which the tests check, so none of them passes by never speculating.
"""

from __future__ import annotations

import math

import pytest
import torch

from conveyor import LLM
from conveyor.core.sampling import SamplingParams
from conveyor.core.scheduler.output import ScheduledRequest
from conveyor.engine.tokenizer import Tokenizer
from conveyor.executor.sampler import Sampler
from tests.harness import hf_greedy

SPEC = '{"method": "ngram", "num_speculative_tokens": 4, "draft_length": "fixed"}'
CODE = ("def area(width, height):\n    return width * height\n\n"
        "def perimeter(width, height):\n    return 2 * (width + height)\n")
CHATS = [
    f"Rewrite this code with the function area renamed to surface. Output only the code.\n\n{CODE}",
    "Repeat this sentence exactly: The quick brown fox jumps over the lazy dog near the river bank.",
    "Name three rivers.",  # no repetition to draft from
]
MAX_TOKENS = 40
# The engines' pool, unless a case sets its own: 4,096 tokens hold every batch here, where the default pool (1.5 GB,
# written through as each engine starts) would hold 128 requests.
POOL = {"num_kv_blocks": 256}


@pytest.fixture(scope="module")
def prompts(default_model_dir) -> list[list[int]]:
    tokenizer = Tokenizer(default_model_dir)
    return [tokenizer.apply_chat_template([{"role": "user", "content": chat}]) for chat in CHATS]


@pytest.fixture(scope="module")
def plain_llm(default_model_dir) -> LLM:
    """The default model without drafts."""
    return LLM(str(default_model_dir), **POOL)


@pytest.fixture(scope="module")
def spec_llm(default_model_dir) -> LLM:
    """The default model with drafts (SPEC), the engine options otherwise the defaults (but the pool: POOL)."""
    return _spec_llm(default_model_dir)


@pytest.fixture(scope="module")
def plain(plain_llm, prompts):
    """Greedy outputs without drafts, each prompt alone: what every speculative run must give."""
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    return [plain_llm.generate([p], params, use_tqdm=False)[0] for p in prompts]


def _spec_llm(default_model_dir, **options) -> LLM:
    return LLM(str(default_model_dir), speculative_config=SPEC, **(POOL | options))


def _accepted(llm: LLM) -> int:
    return llm.engine.core.scheduler.speculator.stats.num_accepted_tokens


def test_plain_output_is_transformers_own(default_model_dir, prompts, plain):
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    assert plain[0].token_ids == hf_greedy(hf, prompts[0], MAX_TOKENS)


@pytest.mark.parametrize(("options", "alone"), [
    ({}, True),  # prefix caching on (the default): the prompts' blocks are shared, drafts never indexed
    ({"enable_prefix_caching": False, "max_num_batched_tokens": 24}, True),  # chunked prefill beside drafted decodes
    ({"num_kv_blocks": 18, "block_size": 8, "max_model_len": 128}, False),  # recompute preemption, drafts in flight
    ({"num_kv_blocks": 18, "block_size": 8, "max_model_len": 128, "preemption_mode": "swap",
      "swap_space": "64MiB"}, False),
], ids=["prefix-caching", "chunked-prefill", "recompute", "swap"])
def test_greedy_output_is_the_same_with_drafts_alone_and_batched(default_model_dir, prompts, plain, options, alone):
    """Each prompt alone (where the pool holds them all), then all of them twice at once."""
    llm = _spec_llm(default_model_dir, **options)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    if alone:
        outputs = [llm.generate([p], params, use_tqdm=False)[0].token_ids for p in prompts]
        assert outputs == [o.token_ids for o in plain]
    batched = llm.generate(prompts * 2, params, use_tqdm=False)
    assert [o.token_ids for o in batched] == [o.token_ids for o in plain] * 2
    assert _accepted(llm) > 20
    if "num_kv_blocks" in options:
        assert llm.engine.stats().num_preemptions > 0


def test_n_sequences_and_max_tokens_inside_a_draft(spec_llm, prompts, plain):
    llm = spec_llm
    before = _accepted(llm)  # the engine is the module's: count this test's drafts only
    outputs = llm.generate([prompts[0]], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, n=2), use_tqdm=False)
    assert [o.token_ids for o in outputs] == [plain[0].token_ids] * 2
    for max_tokens in (1, 2, 6, 11):  # cut where a step of 1 + 4 tokens would run past it
        short = llm.generate([prompts[0]], SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False)[0]
        assert short.token_ids == plain[0].token_ids[:max_tokens] and short.finish_reason == "length"
    assert _accepted(llm) > before


def test_a_stop_string_inside_an_accepted_draft_ends_the_output_there(spec_llm, plain_llm, prompts, plain):
    llm, reference = spec_llm, plain_llm
    before = _accepted(llm)
    text = plain[0].text
    for at in (12, 30, 55, 80):  # stop strings that begin at several places of the repeated code
        stop = text[at:at + 6]
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, stop=[stop])
        expected = reference.generate([prompts[0]], params, use_tqdm=False)[0]
        got = llm.generate([prompts[0]], params, use_tqdm=False)[0]
        assert (got.text, got.token_ids, got.finish_reason, got.stop_reason) == (
            expected.text, expected.token_ids, "stop", stop)
    assert _accepted(llm) - before > 10


def test_seeded_sampling_with_drafts_is_reproducible(default_model_dir, prompts):
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=7, max_tokens=MAX_TOKENS)
    first = _spec_llm(default_model_dir).generate([prompts[1]], params, use_tqdm=False)[0]
    llm = _spec_llm(default_model_dir)  # another engine: nothing carried over from the first
    again = llm.generate([prompts[1], prompts[0]], params, use_tqdm=False)[0]
    assert first.token_ids == again.token_ids
    assert _accepted(llm) > 0


# ----- the sampled rule's distribution -------------------------------------------------


def _item(drafts: list[int], params: SamplingParams) -> ScheduledRequest:
    return ScheduledRequest("r", 10, [1, *drafts], [0], params, True, 3, num_draft_tokens=len(drafts))


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


# The 0.999 quantile of chi-square with 7 degrees of freedom: a correct rule fails once in a thousand runs.
CHI2_7_DOF_999 = 24.32


def test_sampled_tokens_follow_the_model_with_or_without_drafts():
    """Eight tokens, a draft the model finds likely (accepted often) and one it finds unlikely: the first token
    of each verify follows the first row's p, and the token after an accepted draft the second row's. 40,000
    draws: a shift of one percentage point in any token's probability fails the test (chi-square beyond
    ~40 where the bound is 24)."""
    torch.manual_seed(0)
    logits = torch.randn(2, 8) * 1.5
    params = SamplingParams(temperature=0.9, max_tokens=100)
    p = torch.softmax(logits / params.temperature, dim=-1)
    sampler = Sampler(seed=1)
    draws = 40_000
    for draft in (int(p[0].argmax()), int(p[0].argmin())):
        first = torch.zeros(8)
        after_accepted = torch.zeros(8)
        for _ in range(draws):
            accepted, token = sampler.verify(logits.clone(), _item([draft], params))
            first[draft if accepted else token] += 1
            if accepted:
                after_accepted[token] += 1
        assert _chi_square(first, p[0]) < CHI2_7_DOF_999
        assert _chi_square(after_accepted, p[1]) < CHI2_7_DOF_999
        assert math.isclose(float(after_accepted.sum()) / draws, float(p[0][draft]), abs_tol=0.01)
    # Plain sampling draws from the same p: the same check, as the reference the rule is measured against.
    plain = torch.zeros(8)
    for _ in range(draws):
        plain[sampler.sample(logits[:1].clone(), [params], [0])[0]] += 1
    assert _chi_square(plain, p[0]) < CHI2_7_DOF_999


def test_the_chi_square_check_sees_a_one_point_shift():
    """The check above is strong enough: the same draws with one token's probability moved by a percentage
    point fail it."""
    torch.manual_seed(0)
    p = torch.softmax(torch.randn(8) * 1.5 / 0.9, dim=-1)
    high, low = torch.topk(p, 2).indices.tolist()  # moved between the two likeliest: neither goes below 0
    shifted = p.clone()
    shifted[high] -= 0.01
    shifted[low] += 0.01
    counts = torch.bincount(torch.multinomial(shifted, 40_000, replacement=True), minlength=8).float()
    assert _chi_square(counts, p) > CHI2_7_DOF_999


def test_a_server_with_drafts_streams_the_plain_answer_and_counts_its_drafts(default_model_dir, plain):
    """``conveyor serve --speculative-config`` as a real process, the official client streaming: the text is the
    offline engine's without drafts, and /metrics counts the drafts (vLLM's names)."""
    from tests.serving import metric, openai_client, running_server

    with running_server(default_model_dir, "--speculative-config", SPEC, "--num-kv-blocks",
                        str(POOL["num_kv_blocks"])) as server:
        client = openai_client(server.base)
        stream = client.chat.completions.create(model=client.models.list().data[0].id, max_tokens=MAX_TOKENS,
                                                temperature=0, stream=True,
                                                messages=[{"role": "user", "content": CHATS[0]}])
        text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
        assert text == plain[0].text
        assert metric(server, "conveyor:spec_decode_num_accepted_tokens_total") > 10
        assert metric(server, "conveyor:spec_decode_num_accepted_tokens_per_pos_total{position=\"0\"}") > 0
