"""Bad input is refused up front, with an error that names the offending field, and harms nobody else.

A serving engine shares one batch among many callers: a request that fails half-way through a step would
take the others down with it. So every check must fire before anything is added to the engine, and the
requests already there must finish exactly as if the bad one had never been tried.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from conveyor import LLM, SamplingParams
from conveyor.engine import RequestOutput
from conveyor.entrypoints import cli

MAX_MODEL_LEN = 128
VOCAB_SIZE = 49152  # the tiny model's (tests/conftest.py)
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
GOOD_A = [1000 + 37 * i for i in range(11)]
GOOD_B = [2000 + 53 * i for i in range(23)]


@pytest.fixture(scope="module")
def llm(tiny_model_dir: Path) -> LLM:
    return LLM(
        str(tiny_model_dir), num_kv_blocks=64, block_size=16, max_num_seqs=8,
        max_num_batched_tokens=256, max_model_len=MAX_MODEL_LEN,
    )


@pytest.fixture(scope="module")
def reference(llm: LLM) -> list[list[int]]:
    """The two good requests' greedy tokens, run together with nothing else around."""
    return [o.token_ids for o in llm.generate([GOOD_A, GOOD_B], GREEDY, use_tqdm=False)]


def run_to_completion(llm: LLM) -> dict[str, RequestOutput]:
    """Step the engine until it is empty; the final output of every request, by id."""
    done: dict[str, RequestOutput] = {}
    while llm.engine.has_unfinished_requests():
        for output in llm.engine.step():
            if output.finished:
                done[output.request_id] = output
    return done


BadCall = tuple[Any, SamplingParams | None, str]


def serve_two(llm: LLM, bad_calls: list[BadCall]) -> dict[str, RequestOutput]:
    """good-a starts generating, good-b queues, then each bad call is tried and must raise; run to the end.

    The schedule is the same with or without bad calls, so the outputs must be identical token for token.
    """
    engine = llm.engine
    engine.add_request(GOOD_A, GREEDY, request_id="good-a")
    engine.step()  # good-a is now running, with its first token
    engine.add_request(GOOD_B, GREEDY, request_id="good-b")
    for prompt, params, request_id in bad_calls:
        with pytest.raises(ValueError):
            engine.add_request(prompt, params, request_id=request_id)
    assert engine.stats().num_unfinished == 2
    return run_to_completion(llm)


# ----- SamplingParams -------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "options"),
    [
        ("max_tokens", {"max_tokens": 0}),
        ("max_tokens", {"max_tokens": -3}),
        ("max_tokens", {"max_tokens": 2.5}),
        ("max_tokens", {"max_tokens": "8"}),
        ("temperature", {"temperature": -0.1}),
        ("temperature", {"temperature": math.nan}),
        ("top_p", {"top_p": 0.0}),
        ("top_p", {"top_p": -0.5}),
        ("top_p", {"top_p": 1.01}),
        ("top_p", {"top_p": math.nan}),
        ("min_p", {"min_p": -0.1}),
        ("min_p", {"min_p": 1.5}),
        ("min_p", {"min_p": math.nan}),
        ("top_k", {"top_k": -2}),
        ("top_k", {"top_k": 1.5}),
        ("seed", {"seed": 1.5}),
        ("seed", {"seed": "42"}),
        ("stop", {"stop": ""}),
        ("stop", {"stop": ["ok", ""]}),
        ("stop_token_ids", {"stop_token_ids": [-1]}),
    ],
)
def test_bad_sampling_params_name_the_field(field: str, options: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**options)


def test_good_sampling_params_are_accepted() -> None:
    """The boundaries of each range are valid; -1 is an alias for 'top-k disabled'."""
    params = SamplingParams(max_tokens=1, temperature=0.0, top_p=1.0, top_k=-1, min_p=1.0, seed=0, stop="x")
    assert params.top_k == 0
    assert params.stop == ("x",)
    assert params.greedy


# ----- prompts --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("prompt", "words"),
    [
        ("", ["prompt", "empty"]),
        ([], ["prompt", "empty"]),
        ([1000, VOCAB_SIZE], ["prompt", str(VOCAB_SIZE)]),
        ([1000, -1, 1001], ["prompt", "-1"]),
        ([1000, 1.5], ["prompt"]),
        (list(range(1000, 1000 + MAX_MODEL_LEN)), ["prompt", str(MAX_MODEL_LEN)]),
        (list(range(1000, 1200)), ["prompt", "200", str(MAX_MODEL_LEN)]),
    ],
    ids=["empty-text", "empty-ids", "id-past-vocab", "negative-id", "float-id", "len-equal", "len-over"],
)
def test_bad_prompt_is_refused_and_nothing_is_added(llm: LLM, prompt: Any, words: list[str]) -> None:
    with pytest.raises(ValueError) as error:
        llm.generate([prompt], GREEDY, use_tqdm=False)
    for word in words:
        assert word in str(error.value)
    assert not llm.engine.has_unfinished_requests()


def test_sampling_params_list_of_wrong_length(llm: LLM) -> None:
    with pytest.raises(ValueError, match="sampling_params") as error:
        llm.generate([GOOD_A, GOOD_B], [GREEDY] * 3, use_tqdm=False)
    assert "3" in str(error.value) and "2" in str(error.value)
    assert not llm.engine.has_unfinished_requests()


def test_one_bad_prompt_refuses_the_whole_call(llm: LLM, reference: list[list[int]]) -> None:
    """generate([good, bad, good]) adds nothing; the engine then serves the good ones as before."""
    with pytest.raises(ValueError, match="prompt"):
        llm.generate([GOOD_A, [1000, VOCAB_SIZE + 5], GOOD_B], GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.stats().num_unfinished == 0
    assert [o.token_ids for o in llm.generate([GOOD_A, GOOD_B], GREEDY, use_tqdm=False)] == reference


def test_bad_add_request_leaves_queued_requests_untouched(llm: LLM) -> None:
    """Requests already queued, one already mid-generation, finish exactly as if the bad ones were never tried."""
    clean = serve_two(llm, [])
    bad_calls: list[BadCall] = [
        ([], GREEDY, "bad-1"),
        ([1000, VOCAB_SIZE], GREEDY, "bad-2"),
        (list(range(1000, 1000 + MAX_MODEL_LEN)), GREEDY, "bad-3"),
        ("", None, "bad-4"),
        (GOOD_B, GREEDY, "good-a"),  # an id already in the engine
    ]
    done = serve_two(llm, bad_calls)
    assert set(done) == {"good-a", "good-b"}
    assert {k: o.token_ids for k, o in done.items()} == {k: o.token_ids for k, o in clean.items()}
    assert all(len(o.token_ids) == GREEDY.max_tokens and o.finish_reason == "length" for o in done.values())


# ----- engine options -------------------------------------------------------------


def test_unknown_model_path() -> None:
    with pytest.raises(FileNotFoundError) as error:
        LLM("/no/such/model")
    assert "/no/such/model" in str(error.value) and "model" in str(error.value)


@pytest.mark.parametrize(
    ("field", "options"),
    [
        ("dtype", {"dtype": "int8"}),
        ("kv_cache_memory", {"kv_cache_memory": "lots"}),
        ("kv_cache_memory", {"kv_cache_memory": "1e999"}),  # overflows int()
        ("kv_cache_memory", {"kv_cache_memory": 0}),
        ("num_kv_blocks", {"num_kv_blocks": 0}),
        ("max_num_seqs", {"max_num_seqs": 0}),
        ("block_size", {"block_size": 0}),
        ("max_model_len", {"max_model_len": 0}),
    ],
)
def test_bad_engine_option_names_the_field(tiny_model_dir: Path, field: str, options: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=field):
        LLM(str(tiny_model_dir), **options)


def test_max_model_len_beyond_kv_capacity(tiny_model_dir: Path) -> None:
    """4 blocks of 16 hold 64 tokens: a 128-token max_model_len could never finish alone."""
    with pytest.raises(ValueError, match="max_model_len") as error:
        LLM(str(tiny_model_dir), num_kv_blocks=4, block_size=16, max_model_len=128)
    assert "128" in str(error.value) and "64" in str(error.value)


# ----- the command line ------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["generate", "--model", "/no/such", "--prompt", "hi"], ["/no/such"]),
        (["generate", "--model", "/no/such", "--prompt", "hi", "--max-tokens", "0"], ["max_tokens"]),
        (["generate", "--model", "/no/such", "--prompt", "hi", "--temperature", "-1"], ["temperature"]),
        (["generate", "--model", "/no/such", "--prompt", "hi", "--dtype", "float32", "--num-kv-blocks", "0"],
         ["num_kv_blocks"]),
        (["generate", "--model", "/no/such", "--prompt", "hi", "--kv-cache-memory", "lots"], ["lots"]),
    ],
    ids=["no-model", "max-tokens", "temperature", "num-kv-blocks", "kv-cache-memory"],
)
def test_cli_bad_value_exits_2_with_message(capsys: pytest.CaptureFixture[str], argv: list[str],
                                            words: list[str]) -> None:
    assert cli.main(argv) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("conveyor: error:")
    for word in words:
        assert word in captured.err
    assert "Traceback" not in captured.err


def test_get_tokenizer_is_the_engines_tokenizer(llm: LLM) -> None:
    tokenizer = llm.get_tokenizer()
    assert tokenizer is llm.engine.tokenizer
    assert tokenizer.decode(tokenizer.encode("hello world")) == "hello world"
