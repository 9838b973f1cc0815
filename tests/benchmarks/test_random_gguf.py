"""bench/random_gguf.py: random weights at a model's shape, as a file Conveyor (and llama-quantize) reads."""

from __future__ import annotations

import importlib.util
import sys

import gguf
import pytest

from conveyor import LLM, SamplingParams
from conveyor.benchmarks.compare import ROOT

BENCH = ROOT / "bench"


def _harness():
    spec = importlib.util.spec_from_file_location("random_gguf", BENCH / "random_gguf.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["random_gguf"] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def harness():
    return _harness()


@pytest.mark.parametrize("shape", ["tiny", "tiny-qwen3"])
def test_the_float16_file_has_the_shape_and_the_default_models_tokenizer(harness, shape, tmp_path):
    from conveyor.core.model_config import ModelConfig
    from conveyor.model.weights.paths import resolve_model

    assert harness.make(shape, [], tmp_path, threads=1, keep_source=True) == []
    (f16,) = tmp_path.glob("*-F16.gguf")
    config = ModelConfig.from_folder(resolve_model(str(f16)))
    want = harness.SHAPES[shape]
    assert (config.hidden_size, config.num_layers, config.num_kv_heads, config.head_dim, config.intermediate_size,
            config.tie_word_embeddings) == (want.hidden, want.layers, want.kv_heads, want.head_dim, want.ffn,
                                            want.tied)
    assert config.vocab_size == 49152 and config.model_type == want.arch
    llm = LLM(str(f16), num_kv_blocks=64, kernels="torch")
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].token_ids) == 4


def test_llama_quantize_converts_it_into_a_file_the_native_kernels_run(harness, tmp_path):
    if not harness.QUANTIZE.exists():
        pytest.skip(f"llama-quantize is not built ({harness.QUANTIZE}); bash bench/peers/setup_llamacpp.sh")
    (q8,) = harness.make("tiny", ["Q8_0"], tmp_path, threads=1)
    assert not list(tmp_path.glob("*-F16.gguf"))  # the float16 file goes once converted
    llm = LLM(str(q8), num_kv_blocks=64)
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].token_ids) == 4


def test_llama_quantizes_q4_k_m_mix_runs_natively_and_agrees_with_the_float_path(harness, tmp_path):
    """A Q4_K_M file as llama-quantize writes it (Q6_K beside Q4_K in a layer, the tied head Q6_K)."""
    from tests.model.test_k_quants import assert_first_tokens_agree_with_the_float_path

    if not harness.QUANTIZE.exists():
        pytest.skip(f"llama-quantize is not built ({harness.QUANTIZE}); bash bench/peers/setup_llamacpp.sh")
    (path,) = harness.make("tiny", ["Q4_K_M"], tmp_path, threads=1)
    native = LLM(str(path), num_kv_blocks=64, kv_cache_dtype="float32")
    assert {"Q4_K", "Q6_K"} <= set(native.engine.runner.kernel_dtype.split("+"))
    assert_first_tokens_agree_with_the_float_path(native, path)


def test_a_mixture_of_experts_converts_from_random_q8_0_blocks_into_a_qwen3moe_file(harness, tmp_path):
    """tiny-qwen3moe, from random Q8_0 blocks as the large mixtures are: llama-quantize requantizes the stacked
    experts (a float32 router left as it is), and Conveyor reads the file's experts and runs it."""
    from conveyor.core.model_config import ModelConfig
    from conveyor.model.weights.paths import resolve_model

    if not harness.QUANTIZE.exists():
        pytest.skip(f"llama-quantize is not built ({harness.QUANTIZE}); bash bench/peers/setup_llamacpp.sh")
    (path,) = harness.make("tiny-qwen3moe", ["Q4_K_M"], tmp_path, threads=1)
    assert not list(tmp_path.glob("*-Q8_0.gguf"))  # the source goes once converted
    want = harness.SHAPES["tiny-qwen3moe"]
    stored = {t.name: (t.tensor_type.name, tuple(int(d) for d in reversed(t.shape)))
              for t in gguf.GGUFReader(str(path)).tensors}
    assert stored["blk.1.ffn_gate_inp.weight"] == ("F32", (want.experts, want.hidden))
    assert stored["blk.1.ffn_up_exps.weight"] == ("Q4_K", (want.experts, want.expert_ffn, want.hidden))
    assert stored["blk.1.ffn_down_exps.weight"][1] == (want.experts, want.hidden, want.expert_ffn)
    config = ModelConfig.from_folder(resolve_model(str(path)))
    assert (config.model_type, config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (
        "qwen3_moe", want.experts, want.experts_used, want.expert_ffn)
    llm = LLM(str(path), num_kv_blocks=64)
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].token_ids) == 4
