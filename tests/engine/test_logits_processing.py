"""Penalties, logit_bias and min_tokens: the vectorised sampler against a reference written here, token by
token, from the OpenAI and vLLM definitions; then batch invariance on the engine.

Reference definitions: presence and frequency (OpenAI): ``logit[j] -= count[j] * frequency + (count[j] > 0) *
presence`` over the output so far; repetition (vLLM, from CTRL): a token in the prompt or output has its
logit divided by the penalty when positive, multiplied when not; logit_bias adds its value; min_tokens makes
EOS and the stop tokens impossible until that many tokens are out. vLLM's order: min_tokens, bias, penalties.
"""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch

from conveyor import LLM, SamplingParams
from conveyor.core.scheduler.output import ScheduledRequest
from conveyor.executor.sampler import Sampler

VOCAB = 12
EOS = 0


def reference_logits(logits: list[float], prompt: list[int], output: list[int], p: SamplingParams) -> list[float]:
    out = list(logits)
    if len(output) < p.min_tokens:
        for token in [EOS, *p.stop_token_ids]:
            out[token] = -math.inf
    for token, bias in p.logit_bias:
        out[token] += bias
    for token in range(len(out)):
        if token in prompt or token in output:
            out[token] = out[token] / p.repetition_penalty if out[token] > 0 else out[token] * p.repetition_penalty
        count = output.count(token)
        out[token] -= count * p.frequency_penalty + (count > 0) * p.presence_penalty
    return out


def scheduled(i: int, params: SamplingParams, prompt: list[int], output: list[int]) -> ScheduledRequest:
    return ScheduledRequest(f"r{i}", len(prompt) + len(output) - 1, [0], [], params, True, len(output),
                            prompt, output, EOS)


def random_case(rng: random.Random, i: int) -> tuple[SamplingParams, list[int], list[int]]:
    params = SamplingParams(
        temperature=0.0, max_tokens=32,
        presence_penalty=rng.choice([0.0, rng.uniform(-2, 2)]),
        frequency_penalty=rng.choice([0.0, rng.uniform(-2, 2)]),
        repetition_penalty=rng.choice([1.0, rng.uniform(0.5, 2.0)]),
        logit_bias={rng.randrange(VOCAB): rng.uniform(-100, 100) for _ in range(rng.randrange(3))},
        min_tokens=rng.choice([0, rng.randrange(1, 8)]),
        stop_token_ids=rng.sample(range(1, VOCAB), rng.randrange(2)),
    )
    prompt = [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 8))]
    output = [rng.randrange(VOCAB) for _ in range(rng.randrange(0, 10))]
    return params, prompt, output


def test_processed_logits_equal_the_reference_on_random_mixed_batches() -> None:
    """Batches mixing plain rows with every combination of the parameters: each row's greedy pick (and so its
    processed logits' argmax) is the reference's; a tie-free check compares the logits themselves too."""
    rng = random.Random(0)
    for trial in range(40):
        cases = [random_case(rng, i) for i in range(rng.randrange(1, 10))]
        logits = torch.randn(len(cases), VOCAB, generator=torch.Generator().manual_seed(trial)) * 3
        expected = [reference_logits(logits[i].tolist(), prompt, output, p) for i, (p, prompt, output) in
                    enumerate(cases)]
        batch = [scheduled(i, p, prompt, output) for i, (p, prompt, output) in enumerate(cases)]
        processed = logits.clone()
        tokens, _ = Sampler().sample_batch(processed, batch)
        for row, want in enumerate(expected):
            assert processed[row].tolist() == pytest.approx(want, rel=1e-5, abs=1e-4)
            assert tokens[row] == max(range(VOCAB), key=lambda t: want[t])


def test_a_plain_batch_is_left_untouched() -> None:
    logits = torch.randn(4, VOCAB)
    batch = [scheduled(i, SamplingParams(temperature=0.0), [1, 2], [3, 3]) for i in range(4)]
    processed = logits.clone()
    tokens, logprobs = Sampler().sample_batch(processed, batch)
    assert torch.equal(processed, logits) and tokens == logits.argmax(-1).tolist() and logprobs == {}


def test_min_tokens_holds_back_eos_and_stop_tokens_then_lets_them_through() -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, EOS], logits[0, 5] = 10.0, 9.0  # EOS first, then a stop token, then everything else
    params = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[5], max_tokens=8)
    picks = [Sampler().sample_batch(logits.clone(), [scheduled(0, params, [1], [7] * n)])[0][0] for n in range(5)]
    assert picks[:3] != [EOS] * 3 and all(p not in (EOS, 5) for p in picks[:3])
    assert picks[3:] == [EOS, EOS]


@pytest.mark.parametrize(("field", "value"), [
    ("presence_penalty", 2.5), ("frequency_penalty", -3), ("repetition_penalty", 0), ("logit_bias", {1: 101}),
    ("logit_bias", {-1: 1}), ("min_tokens", -1), ("min_tokens", 99), ("logprobs", 21), ("prompt_logprobs", -1),
])
def test_bad_values_name_the_field(field, value) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(max_tokens=16, **{field: value})


# ----- the engine -------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_llm(tiny_model_dir: Path) -> LLM:
    return LLM(str(tiny_model_dir), num_kv_blocks=1024, max_num_seqs=64)


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1000, 40000) for _ in range(rng.randrange(4, 40))] for _ in range(n)]


def test_penalised_requests_are_batch_invariant(tiny_llm: LLM) -> None:
    """Each processed request alone equals it inside a batch of 32 that also holds plain requests; greedy and
    seeded random both. The tiny random model repeats itself, so the penalties change its output (checked)."""
    prompts = _prompts(32, seed=4)
    processed = {
        0: SamplingParams(temperature=0.0, max_tokens=12, repetition_penalty=1.8),
        5: SamplingParams(temperature=0.0, max_tokens=12, presence_penalty=1.5, frequency_penalty=1.0),
        9: SamplingParams(temperature=0.0, max_tokens=12, logit_bias={4321: 30.0}, min_tokens=4),
        17: SamplingParams(temperature=0.9, seed=7, max_tokens=12, frequency_penalty=2.0, repetition_penalty=1.3),
    }
    plain = SamplingParams(temperature=0.0, max_tokens=12)
    batch = tiny_llm.generate(prompts, [processed.get(i, plain) for i in range(32)], use_tqdm=False)
    for i, params in processed.items():
        alone = tiny_llm.generate([prompts[i]], params, use_tqdm=False)[0]
        assert batch[i].token_ids == alone.token_ids, i
    assert batch[9].token_ids == [4321] * 12, "a bias of 30 outweighs the tiny model's logits"
    assert len(set(batch[5].token_ids)) == len(batch[5].token_ids), "presence 1.5 + frequency 1 forbid repeats here"


def test_a_request_made_elsewhere_is_checked_against_this_models_vocabulary(tiny_llm: LLM) -> None:
    """A replicas front end makes requests without the model; the engine that takes one refuses a logit_bias
    outside its vocabulary before the request reaches a step (where it would fail the whole batch)."""
    engine = tiny_llm.engine
    made = engine.make_request([5, 6, 7], SamplingParams(max_tokens=2))
    made.sampling_params = SamplingParams(max_tokens=2, logit_bias={engine.model_config.vocab_size + 3: 5.0})
    with pytest.raises(ValueError, match="logit_bias: token ids must be below the vocabulary size"):
        engine.add_request(made)
    assert not engine.has_unfinished_requests()


def test_an_argmax_handed_in_counts_only_for_unprocessed_logits() -> None:
    """The native stack hands the sampler each row's argmax of the raw logits: a greedy batch takes it as
    it is, and a batch whose logits a bias changes picks from the changed logits instead."""
    logits = torch.tensor([[0.0, 5.0, 1.0, 2.0]])
    plain = SamplingParams(temperature=0.0, max_tokens=4)
    biased = SamplingParams(temperature=0.0, max_tokens=4, logit_bias={3: 10.0})
    assert Sampler().sample_batch(logits.clone(), [scheduled(0, plain, [2], [])], argmax=[1])[0] == [1]
    assert Sampler().sample_batch(logits.clone(), [scheduled(0, biased, [2], [])], argmax=[1])[0] == [3]


@pytest.mark.parametrize("kernels", ["torch", "auto"])
def test_processed_logits_with_logprobs_on_either_model_path(tiny_model_dir: Path, kernels: str) -> None:
    """Bias, penalties, logprobs and prompt logprobs change or read the logits in place on the PyTorch path
    (whose tensors come from inference mode) and on the native stack alike."""
    llm = LLM(str(tiny_model_dir), num_kv_blocks=128, kernels=kernels)
    params = SamplingParams(temperature=0.0, max_tokens=6, logit_bias={5: 100.0}, presence_penalty=0.5,
                            repetition_penalty=1.2, logprobs=2, prompt_logprobs=1)
    out = llm.generate([[1, 2, 3, 4]], params, use_tqdm=False)[0]
    assert out.token_ids == [5] * 6
    assert len(out.logprobs) == 6 and len(out.prompt_logprobs) == 4
