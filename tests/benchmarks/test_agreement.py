"""``conveyor bench agreement``: the prompts it cuts, how it compares answers, and a whole run on the tiny model."""

from __future__ import annotations

from pathlib import Path

import pytest

from conveyor.benchmarks.agreement import (
    LLAMA_BIN,
    EngineAnswers,
    agreement_table,
    bench_agreement,
    compared,
    first_difference,
    text_prompts,
)
from conveyor.core.config import EngineConfig

TEXT = Path(__file__).resolve().parents[1] / "data" / "declaration-of-independence.txt"


def test_prompts_are_windows_spread_from_the_start_of_the_text_to_its_end() -> None:
    ids = list(range(100))
    prompts = text_prompts(ids, 4, 10)
    assert prompts == [ids[0:10], ids[30:40], ids[60:70], ids[90:100]]
    assert text_prompts(ids, 1, 100) == [ids]
    with pytest.raises(ValueError, match="fewer than one prompt of 101"):
        text_prompts(ids, 1, 101)
    with pytest.raises(ValueError, match=">= 1"):
        text_prompts(ids, 0, 10)


def test_first_difference_is_the_first_position_that_differs() -> None:
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [9, 2, 3]) == 0
    assert first_difference([1, 2, 3], [1, 2, 4]) == 2
    assert first_difference([1, 2], [1, 2, 3]) == 2  # one stopped early


def test_the_table_counts_equal_answers_and_where_the_others_part() -> None:
    reference = EngineAnswers("Conveyor", "float32", [[1, 2, 3], [4, 5, 6], [7, 8, 9]], 10.0, 0.0)
    quantized = EngineAnswers("Conveyor", "Q4_1+Q8_0", [[1, 2, 3], [4, 0, 0], [0, 8, 9]], 10.5, 0.0123)
    assert compared(quantized, reference) == (1, [1, 0])
    table = agreement_table(reference, [quantized], 3)
    lines = table.splitlines()
    assert "all 3 tokens equal to float32" in lines[0] and "mean KLD from float32" in lines[0]
    assert "reference" in lines[2] and "10.0000" in lines[2]
    assert "| 1/3 " in lines[3] and "| 0 / 0.5 " in lines[3] and "+5.00%" in lines[3] and "0.012300" in lines[3]


def test_a_float_folder_agrees_with_itself_throughout(tiny_model_dir: Path) -> None:
    """On float32 weights the reference and the engine are the same path: every answer equal, perplexity the
    same bits (the engines are built apart, the prompts cut once)."""
    config = EngineConfig(model=str(tiny_model_dir), num_kv_blocks=256)
    table, answers = bench_agreement(config, TEXT, num_prompts=6, prompt_len=24, tokens=8, context=64,
                                     llama_cpp=True)  # no GGUF file: llama.cpp is left out, said so on stderr
    reference, ours = answers
    assert [len(o) for o in ours.outputs] == [8] * 6
    assert ours.outputs == reference.outputs and ours.perplexity == reference.perplexity
    assert ours.mean_kld == reference.mean_kld == 0.0
    assert "| 6/6 " in table.splitlines()[3] and "+0.00%" in table and "0.000000" in table


def test_a_quantized_file_against_its_float_weights_and_llama_cpp(tmp_path: Path) -> None:
    """A tiny random Q8_0 file from bench/random_gguf.py: Conveyor kept quantized, its float32 reference, and
    llama.cpp's server and llama-perplexity on the same file. 8-bit weights stay near the float answers."""
    from tests.benchmarks.test_random_gguf import _harness

    harness = _harness()
    if not (LLAMA_BIN / "llama-server").is_file() or not harness.QUANTIZE.exists():
        pytest.skip("llama.cpp is not set up (bash bench/peers/setup_llamacpp.sh)")
    (q8,) = harness.make("tiny", ["Q8_0"], tmp_path, threads=1)
    config = EngineConfig(model=str(q8), num_kv_blocks=256)
    table, answers = bench_agreement(config, TEXT, num_prompts=6, prompt_len=24, tokens=8, context=64)
    print(table)
    reference, ours, theirs = answers
    assert theirs.engine.startswith("llama.cpp") and theirs.weights == q8.name
    for answer in (ours, theirs):
        assert [len(o) for o in answer.outputs] == [8] * 6
        assert abs(answer.perplexity / reference.perplexity - 1) < 0.02
        assert 0 < answer.mean_kld < 0.01
