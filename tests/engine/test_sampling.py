"""Sampling and stopping: the Sampler on hand-made logits, then the engine's end-to-end contracts.

The Sampler tests use logits whose probabilities are known, so each filter (top-k, top-p, temperature) is
checked against what it must allow, not against another implementation. The engine tests check the promises
users build on: a seeded request is reproducible whatever shares its batch (even across preemption and
recompute), and every way a request can end (max_tokens, stop token, stop string, EOS, max_model_len) ends it
with the right finish_reason, stop_reason and output.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from conveyor import LLM, SamplingParams
from conveyor.engine import RequestOutput
from conveyor.executor.sampler import Sampler, argmax_rows

GREEDY = SamplingParams(temperature=0.0, max_tokens=16)
MAX_MODEL_LEN = 128


# ----- helpers --------------------------------------------------------------


def draw(sampler: Sampler, row: torch.Tensor, params: SamplingParams, n: int) -> list[int]:
    """``n`` independent draws from one row of logits, made as one batch of ``n`` identical rows."""
    logits = row.unsqueeze(0).expand(n, -1).contiguous()
    return sampler.sample(logits, [params] * n, list(range(n)))


def logits_of(probs: Sequence[float]) -> torch.Tensor:
    """Logits whose softmax is exactly ``probs`` (up to float32 rounding)."""
    return torch.tensor(probs, dtype=torch.float32).log()


def token_ids(n: int, seed: int) -> list[int]:
    """A reproducible prompt of ``n`` ordinary token ids (the tiny model is random; text would be gibberish)."""
    rng = random.Random(seed)
    return [rng.randrange(1000, 40000) for _ in range(n)]


def generate(llm: LLM, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[RequestOutput]:
    return llm.generate(prompts, params, use_tqdm=False)


# ----- the Sampler on hand-made logits ---------------------------------------


def test_greedy_picks_argmax_even_beside_random_rows() -> None:
    """Greedy rows must be argmax whether or not other rows in the same batch sample randomly."""
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(8, 300, generator=gen)
    expected = logits.argmax(-1).tolist()
    sampler = Sampler(seed=0)
    assert sampler.sample(logits, [GREEDY] * 8, [0] * 8) == expected
    mixed = [GREEDY if i % 2 == 0 else SamplingParams(temperature=1.5) for i in range(8)]
    got = sampler.sample(logits, mixed, [0] * 8)
    assert [got[i] for i in range(0, 8, 2)] == expected[0::2]


def test_top_k_one_is_greedy_at_high_temperature() -> None:
    """top_k=1 leaves a single candidate, so even a flattening temperature cannot pick another token."""
    row = torch.randn(500, generator=torch.Generator().manual_seed(2))
    params = SamplingParams(temperature=100.0, top_k=1)
    assert set(draw(Sampler(seed=0), row, params, 400)) == {int(row.argmax())}


def test_top_k_never_leaves_the_k_largest_logits() -> None:
    """Over many draws at a high temperature (where every token is likely) only the k largest logits appear."""
    row = torch.randn(60, generator=torch.Generator().manual_seed(3))
    k = 5
    allowed = set(torch.topk(row, k).indices.tolist())
    drawn = set(draw(Sampler(seed=0), row, SamplingParams(temperature=5.0, top_k=k), 3000))
    assert drawn == allowed  # a subset: the filter works; all of them: it is not stricter than k


@pytest.mark.parametrize(
    ("top_p", "allowed"),
    [
        (0.4, {1}),  # 0.5 alone reaches 0.4
        (0.7, {1, 3}),  # 0.5 + 0.3 is the smallest set reaching 0.7
        (0.9, {0, 1, 3}),  # 0.5 + 0.3 + 0.15
        (1.0, {0, 1, 2, 3}),  # disabled
    ],
)
def test_top_p_keeps_the_smallest_set_reaching_top_p(top_p: float, allowed: set[int]) -> None:
    """Probabilities are deliberately not in sorted order, so a wrong scatter back to vocab order shows too."""
    row = logits_of([0.15, 0.5, 0.05, 0.3])
    drawn = Counter(draw(Sampler(seed=0), row, SamplingParams(temperature=1.0, top_p=top_p), 4000))
    assert set(drawn) == allowed
    if allowed == {1, 3}:
        # Renormalised over the kept set: 0.5 / 0.8.
        assert abs(drawn[1] / 4000 - 0.625) < 0.04


@pytest.mark.parametrize("shape", ["peaked", "flat", "masked"])
@pytest.mark.parametrize("top_p", [0.5, 0.9, 0.99])
def test_top_p_over_a_whole_vocabulary_keeps_what_sorting_it_keeps(shape: str, top_p: float) -> None:
    """On a 49k-token vocabulary top-p ranks the likeliest 256 first and sorts everything only when they fall
    short of top_p (the flat rows): either way the kept set is the one the whole sort defines."""
    from conveyor.executor.sampler import TOP_P_CANDIDATES, _top_p_drops

    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(49152, generator=generator) * (6.0 if shape == "peaked" else 0.5)
    if shape == "masked":  # what top-k leaves: all but 300 tokens at -inf
        logits[torch.randperm(49152, generator=generator)[300:]] = float("-inf")
    probs = logits.softmax(-1)
    ranked, order = torch.sort(probs, descending=True)
    kept = ranked.cumsum(-1) - ranked < top_p
    kept[0] = True
    expected = torch.ones(49152, dtype=torch.bool)
    expected[order] = ~kept
    assert torch.equal(_top_p_drops(logits, top_p), expected)
    if shape == "flat":
        assert int(kept.sum()) > TOP_P_CANDIDATES, "the whole sort was needed"


def test_top_p_over_tied_probabilities_keeps_as_many_as_sorting_does_lowest_ids_first() -> None:
    """A uniform row (every probability tied): as many tokens kept as the sort's rule gives, and which of the
    tied ones is decided by id, so the same row always keeps the same tokens."""
    from conveyor.executor.sampler import _top_p_drops

    logits = torch.zeros(49152)
    ranked = torch.sort(logits.softmax(-1), descending=True).values
    count = int((ranked.cumsum(-1) - ranked < 0.5).sum())
    kept = (~_top_p_drops(logits, 0.5)).nonzero().flatten()
    assert torch.equal(kept, torch.arange(count))


def test_a_draw_never_picks_a_token_of_zero_weight() -> None:
    """Tokens top-k, top-p or a rejected draft leave at zero are never drawn, the last token included, however
    the uniform number falls."""
    from conveyor.executor.sampler import _draw

    probs = torch.zeros(49152)
    probs[[5, 17, 40000]] = torch.tensor([0.25, 0.5, 0.25])
    generator = torch.Generator().manual_seed(0)
    drawn = Counter(_draw(probs, generator) for _ in range(2000))
    assert set(drawn) == {5, 17, 40000}
    assert abs(drawn[17] / 2000 - 0.5) < 0.05


def test_seeded_draw_ignores_batch_neighbours_and_row_position() -> None:
    """A seeded request's token depends only on (seed, token index, its logits): not on the other rows."""
    gen = torch.Generator().manual_seed(4)
    row = torch.randn(1000, generator=gen) * 0.3  # flat: the draw is genuinely random
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=7)
    others = torch.randn(3, 1000, generator=gen)
    other_params = [SamplingParams(temperature=1.0), GREEDY, SamplingParams(temperature=0.7, seed=99)]

    alone = [Sampler(seed=0).sample(row[None], [seeded], [t])[0] for t in range(12)]
    sampler = Sampler(seed=5)
    for t in range(12):
        # The seeded row first, last, and in the middle of a batch whose other rows consume random numbers.
        for position in (0, 1, 3):
            rows = list(others)
            params = list(other_params)
            rows.insert(position, row)
            params.insert(position, seeded)
            indices = [t + 40, t + 3, t, t + 17]
            indices[position] = t
            got = sampler.sample(torch.stack(rows), params, indices)
            assert got[position] == alone[t], (t, position)
    assert len(set(alone)) > 6  # successive tokens use fresh random numbers
    other_seed = [Sampler(seed=0).sample(row[None], [SamplingParams(temperature=1.0, top_p=0.95, seed=8)], [t])[0]
                  for t in range(12)]
    assert other_seed != alone


def test_tiny_positive_temperature_still_picks_the_argmax() -> None:
    """temperature -> 0 is the greedy limit; dividing by a tiny temperature must not overflow into NaN.

    With T = 1e-40, logits / T overflow float32 to inf, softmax of inf is NaN, and a NaN argmax falls on
    token 0, whatever the logits say.
    """
    row = torch.tensor([0.5, 3.0, 1.0, 2.0])
    for temperature in (1e-6, 1e-30, 1e-40):
        drawn = set(draw(Sampler(seed=0), row, SamplingParams(temperature=temperature), 50))
        assert drawn == {1}, temperature


def chi_square(counts: Counter[int], probs: torch.Tensor, n: int) -> float:
    expected = (probs * n).tolist()
    return sum((counts[i] - e) ** 2 / e for i, e in enumerate(expected))


def test_temperature_sampling_matches_softmax_of_scaled_logits() -> None:
    """Frequencies follow softmax(logits / T) (and clearly not softmax(logits)); the sampler seed fixes the draws.

    Five degrees of freedom: chi-square above 25 has probability < 2e-4 under the right distribution.
    """
    row = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0])
    temperature, n = 0.7, 12000
    counts = Counter(draw(Sampler(seed=11), row, SamplingParams(temperature=temperature), n))
    assert chi_square(counts, (row / temperature).softmax(-1), n) < 25
    assert chi_square(counts, row.softmax(-1), n) > 200  # the temperature really was applied


# ----- the engine -------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_llm(tiny_model_dir: Path) -> LLM:
    """Room for 17 requests at once without preemption, and a short max_model_len to reach."""
    return LLM(
        str(tiny_model_dir), num_kv_blocks=160, block_size=16, max_num_seqs=32,
        max_num_batched_tokens=256, max_model_len=MAX_MODEL_LEN,
    )


SEEDED = SamplingParams(temperature=0.8, top_p=0.9, seed=123, max_tokens=16, ignore_eos=True)
SEEDED_PROMPT = token_ids(12, seed=0)


def crowd() -> tuple[list[list[int]], list[SamplingParams]]:
    """16 requests of various lengths and params: greedy, random, seeded, top-k, top-p, short and long."""
    rng = random.Random(1)
    prompts, params = [], []
    for i in range(16):
        prompts.append(token_ids(rng.randrange(3, 60), seed=100 + i))
        params.append(SamplingParams(
            temperature=rng.choice([0.0, 0.5, 1.0, 1.5]), top_k=rng.choice([0, 5, 50]),
            top_p=rng.choice([1.0, 0.8]), seed=rng.choice([None, i]), max_tokens=rng.randrange(1, 10),
            ignore_eos=True,
        ))
    return prompts, params


def test_seeded_request_is_reproducible_in_a_batch(tiny_llm: LLM) -> None:
    """Same seed, same tokens: alone, and in the middle of a batch of 16 requests of mixed lengths and params."""
    alone = generate(tiny_llm, [SEEDED_PROMPT], SEEDED)[0].token_ids
    assert len(alone) == SEEDED.max_tokens

    prompts, params = crowd()
    batch = generate(tiny_llm, [*prompts[:8], SEEDED_PROMPT, *prompts[8:]], [*params[:8], SEEDED, *params[8:]])
    assert batch[8].token_ids == alone
    assert all(o.metrics.num_preemptions == 0 for o in batch)


def test_seeded_request_is_reproducible_across_preemption(tiny_model_dir: Path, tiny_llm: LLM) -> None:
    """Same seed, same tokens after the request is preempted and recomputed.

    Eight blocks of 16 tokens: a long greedy request that arrived first (90 + 30 tokens, all 8 blocks at the
    end) and the seeded one (12 + 16 tokens) outgrow the pool about 7 tokens in; the seeded request, the later
    arrival, is the victim, and is recomputed from prompt + output once the long one is done. A short third
    request joins early and leaves before that, so it is not the victim.
    """
    alone = generate(tiny_llm, [SEEDED_PROMPT], SEEDED)[0].token_ids
    cramped = LLM(
        str(tiny_model_dir), num_kv_blocks=8, block_size=16, max_num_seqs=8,
        max_num_batched_tokens=256, max_model_len=MAX_MODEL_LEN,
    )
    long = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    short = SamplingParams(temperature=1.2, top_k=20, max_tokens=3, ignore_eos=True)
    outputs = generate(cramped, [token_ids(90, seed=3), SEEDED_PROMPT, token_ids(5, seed=4)], [long, SEEDED, short])
    assert outputs[1].metrics.num_preemptions > 0, "the scenario must preempt the seeded request"
    assert outputs[1].token_ids == alone


def test_max_tokens_is_honoured_exactly(tiny_llm: LLM) -> None:
    """With EOS ignored, a request yields exactly max_tokens tokens: not one short, not one over."""
    sizes = [1, 7, 20]
    params = [SamplingParams(temperature=1.0, max_tokens=n, ignore_eos=True) for n in sizes]
    outputs = generate(tiny_llm, [token_ids(10, seed=n) for n in sizes], params)
    assert [len(o.token_ids) for o in outputs] == sizes
    assert all(o.finish_reason == "length" and o.stop_reason is None for o in outputs)


def test_stop_token_ids_end_the_request_at_that_token(tiny_llm: LLM) -> None:
    """Take a token the model emits greedily a few tokens in, make it a stop token: output ends right there."""
    prompt = token_ids(9, seed=7)
    free = generate(tiny_llm, [prompt], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))[0]
    at = next(i for i in range(2, 12) if free.token_ids.index(free.token_ids[i]) == i)  # first occurrence
    stop_token = free.token_ids[at]

    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop_token_ids=[stop_token, 3])
    out = generate(tiny_llm, [prompt], params)[0]
    assert out.token_ids == free.token_ids[: at + 1]
    assert out.token_ids[-1] == stop_token
    assert out.finish_reason == "stop"
    assert out.stop_reason == stop_token


def test_max_model_len_ends_the_request_with_length(tiny_llm: LLM) -> None:
    """prompt + output never exceed max_model_len, whatever max_tokens allows."""
    params = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
    outputs = generate(tiny_llm, [token_ids(120, seed=1), token_ids(MAX_MODEL_LEN - 1, seed=2)], params)
    assert [len(o.token_ids) for o in outputs] == [MAX_MODEL_LEN - 120, 1]
    assert all(o.finish_reason == "length" for o in outputs)


@pytest.mark.parametrize(
    ("temperature", "min_p", "allowed"),
    [
        (1.0, 0.5, {1, 3}),  # p >= 0.25: 0.5 and 0.3
        (1.0, 0.2, {0, 1, 3}),  # p >= 0.1
        (1.0, 1.0, {1}),  # only the likeliest
        (1.0, 0.0, {0, 1, 2, 3}),  # disabled
        # After temperature, as vLLM applies it: at 2 the probabilities go as sqrt(p), 0.39 0.71 0.22 0.55 (/1.87),
        # so 0.5 of the likeliest keeps 0.15 too, which it dropped at temperature 1.
        (2.0, 0.5, {0, 1, 3}),
    ],
)
def test_min_p_drops_tokens_under_min_p_times_the_likeliest(temperature: float, min_p: float,
                                                            allowed: set[int]) -> None:
    row = logits_of([0.15, 0.5, 0.05, 0.3])
    drawn = Counter(draw(Sampler(seed=0), row, SamplingParams(temperature=temperature, min_p=min_p), 4000))
    assert set(drawn) == allowed
    if (temperature, allowed) == (1.0, {1, 3}):
        assert abs(drawn[1] / 4000 - 0.625) < 0.04  # renormalised over the kept set: 0.5 / 0.8


# ----- the real model: stop strings and EOS -----------------------------------

# A short system prompt keeps prefill cheap; each decode step of the real model costs a good fraction of a
# second on a small CPU, so generate no more than each check needs.
BRIEF = {"role": "system", "content": "Be brief."}
COUNT = [BRIEF, {"role": "user", "content": "Count from 1 to 10, separated by commas."}]
YES_NO = [BRIEF, {"role": "user", "content": "Is the sky blue? Answer yes or no."}]
COUNT_TOKENS = 7  # "1, 2, 3"
ANSWER_TOKENS = 5  # the greedy answer is two tokens, then EOS


StopRuns = tuple[str, list[RequestOutput]]


@pytest.fixture(scope="module")
def real_llm(default_model_dir: Path) -> LLM:
    """The default model, with a small KV pool: these prompts are short."""
    return LLM(str(default_model_dir), num_kv_blocks=64, max_model_len=1024)


@pytest.fixture(scope="module")
def free_runs(real_llm: LLM) -> list[RequestOutput]:
    """One batch: counting without stop strings, and a one-word answer with and without ignore_eos."""
    params = [
        SamplingParams(temperature=0.0, max_tokens=COUNT_TOKENS),
        SamplingParams(temperature=0.0, max_tokens=ANSWER_TOKENS),
        SamplingParams(temperature=0.0, max_tokens=ANSWER_TOKENS, ignore_eos=True),
    ]
    return real_llm.chat([COUNT, YES_NO, YES_NO], params, use_tqdm=False)


def first_completion(real_llm: LLM, tokens: list[int], stop: str) -> int:
    """How many output tokens it takes for ``stop`` to appear in the decoded text."""
    return next(n for n in range(1, len(tokens) + 1) if stop in real_llm.tokenizer.decode(tokens[:n]))


@pytest.fixture(scope="module")
def stop_string_runs(real_llm: LLM, free_runs: list[RequestOutput]) -> StopRuns:
    """Counting again with a stop string from the middle of the free text, spanning several tokens.

    The second request's max_tokens is exactly the token that completes the stop string, so the stop string
    and the length limit arrive together.
    """
    free = free_runs[0]
    start = len(free.text) // 3
    stop = free.text[start : start + 3]
    limit = first_completion(real_llm, free.token_ids, stop)
    assert limit < len(free.token_ids), f"pick a stop string that ends before the output does: {free.text!r}"
    params = [SamplingParams(temperature=0.0, max_tokens=COUNT_TOKENS, stop=[stop]),
              SamplingParams(temperature=0.0, max_tokens=limit, stop=[stop]),
              SamplingParams(temperature=0.0, max_tokens=COUNT_TOKENS, stop=[stop], include_stop_str_in_output=True)]
    return stop, real_llm.chat([COUNT, COUNT, COUNT], params, use_tqdm=False)


def test_stop_string_cuts_text_before_it(free_runs: list[RequestOutput], stop_string_runs: StopRuns) -> None:
    """The text is what came before the first stop string (which spans several tokens), and nothing more."""
    stop, outputs = stop_string_runs
    free_text = free_runs[0].text
    out = outputs[0]
    assert out.text == free_text[: free_text.find(stop)], (free_text, stop)
    assert stop not in out.text
    assert out.finish_reason == "stop"
    assert out.stop_reason == stop
    assert len(out.token_ids) < len(free_runs[0].token_ids)


def test_stop_string_on_the_last_allowed_token_still_stops(
    free_runs: list[RequestOutput], stop_string_runs: StopRuns
) -> None:
    """A stop string completed by the max_tokens-th token must still be cut: the text never contains it."""
    stop, outputs = stop_string_runs
    free_text = free_runs[0].text
    out = outputs[1]
    assert out.text == free_text[: free_text.find(stop)], (out.text, stop)
    assert out.finish_reason == "stop"
    assert out.stop_reason == stop


def test_include_stop_str_in_output_ends_the_text_after_it(
    free_runs: list[RequestOutput], stop_string_runs: StopRuns
) -> None:
    """vLLM's include_stop_str_in_output: the same stop, the text now ends with the stop string itself."""
    stop, outputs = stop_string_runs
    free_text = free_runs[0].text
    out = outputs[2]
    assert out.text == free_text[: free_text.find(stop) + len(stop)], (out.text, stop)
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.token_ids == outputs[0].token_ids  # the same tokens; only the text differs


def test_eos_stops_unless_ignored(real_llm: LLM, free_runs: list[RequestOutput]) -> None:
    """A short answer ends with EOS ("stop", no stop_reason); with ignore_eos it runs on to max_tokens."""
    eos = real_llm.tokenizer.eos_token_id
    _, answered, ignored = free_runs
    assert answered.finish_reason == "stop"
    assert answered.stop_reason is None
    assert answered.token_ids[-1] == eos
    assert len(answered.token_ids) < ANSWER_TOKENS  # so EOS really came before ignored's limit
    assert eos not in answered.token_ids[:-1]
    assert answered.text.strip()
    assert real_llm.tokenizer.decode([eos], skip_special_tokens=False) not in answered.text  # EOS is not text

    assert ignored.finish_reason == "length"
    assert len(ignored.token_ids) == ANSWER_TOKENS
    # The same greedy tokens up to EOS, which was produced and then ignored.
    assert ignored.token_ids[: len(answered.token_ids)] == answered.token_ids


def test_argmax_rows_agrees_with_torch_on_ties_and_nan():
    """The greedy pick (NumPy's argmax on CPU) is torch's: the first of equal logits, and a NaN wins."""
    torch.manual_seed(0)
    logits = torch.randn(6, 49152)
    logits[1, [7, 900]] = 50.0  # a tie: the first
    logits[2, 300] = float("nan")
    logits[3] = 0.0  # all equal: index 0
    logits[4, -1] = float("inf")
    assert argmax_rows(logits) == logits.argmax(dim=-1).tolist() == argmax_rows(logits[:, :].t().contiguous().t())
    assert argmax_rows(logits)[1:5] == [7, 300, 0, 49151]
    assert argmax_rows(logits.bfloat16()) == logits.bfloat16().argmax(dim=-1).tolist()
