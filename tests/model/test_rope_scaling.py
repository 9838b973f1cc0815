"""Rope scalings that stretch a trained context, against transformers on the same random weights: YaRN (Qwen2.5,
Qwen3) and longrope (Phi-3 128k, Phi-3.5).

Each model is tiny, with an original context of 32 positions stretched to 128. YaRN's tables do not depend
on the sequence: prompts of 20 and 60 tokens with 20 new tokens each (the 20-token one grows past the original
context) answer as transformers does. longrope has two sets of factors, and Conveyor picks one per engine, as
vLLM does: the long ones where max_model_len exceeds the original context, else the short ones
(conveyor.model.layers._longrope_factors). transformers picks by the sequence's length, so the two agree on an
engine of max_model_len 32 (every sequence short: 20-token prompts and 8 new tokens) and on one of 128 with
prompts past the original context (60 tokens, where transformers too rotates every position by the long
factors); a short prompt on the 128 engine rotates by the long factors, where transformers uses the short ones
(docs/models.md, "Rope scaling"): its table is checked, not its answer. Where they agree, Conveyor's greedy
tokens must equal transformers' and its logprobs be transformers' to float32 rounding, on both paths (the
PyTorch ops and the native stack, which reads the same tables), each prompt alone, batched, with the long
prompts chunked, after a shorter prompt they begin with (its blocks found in the prefix cache), and preempted
by recompute and by swap. A GGUF file with YaRN metadata is read into the same parameters and runs as
transformers runs its export.
"""

from __future__ import annotations

import copy
import json
import math
import random
import shutil

import pytest

from conveyor import LLM, SamplingParams
from conveyor.core.model_config import ModelConfig
from tests.model.test_families import SHAPE, _randomise_norms_and_biases

ORIGINAL = 32  # the trained context every model here stretches, 4x, to max_position_embeddings
STRETCHED = dict(SHAPE, max_position_embeddings=4 * ORIGINAL)
HALF_HEAD = SHAPE["head_dim"] // 2
MODELS = {
    "qwen2-yarn": ("Qwen2Config", dict(num_hidden_layers=2, rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL})),
    # Qwen3 with every optional key: the band's edges given and not rounded out, and mscale's ratio.
    "qwen3-yarn": ("Qwen3Config", dict(num_hidden_layers=2, rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL, "beta_fast": 8.0,
        "beta_slow": 2.0, "mscale": 1.2, "mscale_all_dim": 0.6, "truncate": False})),
    # Phi-3 keeps the original context at the config's top level, as its 128k checkpoints do; factors far
    # apart, so that a prompt rotated by the wrong set answers otherwise.
    "phi3-longrope": ("Phi3Config", dict(num_hidden_layers=2, pad_token_id=0, original_max_position_embeddings=ORIGINAL,
                                         rope_scaling={"type": "longrope",
                                                       "short_factor": [1.0 + 0.2 * i for i in range(HALF_HEAD)],
                                                       "long_factor": [1.5 + 1.5 * i for i in range(HALF_HEAD)]})),
}
MAX_TOKENS = 20
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5)
SHORT_GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=5)  # 20 + 8 <= ORIGINAL


def _prompt(length: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed * 1000 + length)
    return [rng.randrange(1000, 40000) for _ in range(length)]


def _long_engine_prompts(name: str) -> list[list[int]]:
    """Prompts on which an engine of max_model_len 128 answers as transformers: YaRN's of 20 and 60 tokens (one
    growing past the original context, one starting past it); longrope's past the original context only."""
    return [_prompt(n) for n in ((48, 60) if name.endswith("longrope") else (20, 60))]


@pytest.fixture(scope="module", params=sorted(MODELS))
def model(request, tmp_path_factory, default_model_dir):
    """(name, its HF folder, transformers' model of it, a cache of transformers' answers by prompt)."""
    import torch
    import transformers

    config_name, extra = MODELS[request.param]
    torch.manual_seed(0)
    config = getattr(transformers, config_name)(**STRETCHED, **copy.deepcopy(extra))  # it fills dicts in
    built = transformers.AutoModelForCausalLM.from_config(config).eval()
    _randomise_norms_and_biases(built)
    folder = tmp_path_factory.mktemp(request.param)
    built.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_model_dir / name, folder / name)
    reference = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return request.param, folder, reference, {}


def _reference(model, prompt: list[int], max_tokens: int) -> tuple[list[int], list[list[float]]]:
    """transformers' greedy tokens of ``prompt`` and each step's log-probabilities over the vocabulary."""
    import torch

    _, _, reference, cache = model
    key = (tuple(prompt), max_tokens)
    if key not in cache:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                                     do_sample=False, pad_token_id=0, output_logits=True,
                                     return_dict_in_generate=True)
        logprobs = [torch.log_softmax(step[0].float(), dim=-1) for step in out.logits]
        cache[key] = (out.sequences[0, len(prompt):].tolist(), logprobs)
    return cache[key]


def _assert_matches(model, outputs, label: str) -> None:
    """Each output's tokens are transformers' and its top-5 logprobs transformers' within float32 rounding."""
    name = model[0]
    for output in outputs:
        prompt = output.prompt_token_ids
        tokens, logprobs = _reference(model, prompt, len(output.token_ids))
        assert output.token_ids == tokens, f"{name}, {label}: prompt of {len(prompt)} tokens"
        for step, (ours, theirs) in enumerate(zip(output.logprobs, logprobs, strict=True)):
            for token, value in ours.top:
                assert abs(value - theirs[token].item()) < 1e-4, (name, label, len(prompt), step, token)


def _transformers_tables(reference, length: int):
    """transformers' cos and sin for a sequence of ``length`` tokens (longrope: its factors chosen by it)."""
    import torch

    cos, sin = reference.model.rotary_emb(torch.zeros(1, dtype=torch.float32), torch.arange(length)[None])
    return cos[0], sin[0]


def test_rope_tables_are_transformers(model):
    """cos and sin of every position (times the attention factor) as transformers' rotary embedding gives
    them. YaRN: on an engine of max_model_len 128, for sequences of 20 and 60 tokens. longrope: the short
    factors' on an engine of max_model_len 32 (transformers' for a 20-token sequence), the long factors' on one
    of 128 (transformers' for a 60-token one), there also for a 20-token sequence, where transformers uses the
    short ones."""
    import torch

    from conveyor.model.layers import RotaryEmbedding

    name, folder, reference, _ = model
    config = ModelConfig.from_folder(folder)
    stretched = RotaryEmbedding(config, STRETCHED["max_position_embeddings"])
    if not name.endswith("longrope"):
        for length in (20, 60):
            want_cos, want_sin = _transformers_tables(reference, length)
            torch.testing.assert_close(stretched.cos[:length], want_cos, rtol=0, atol=1e-6)
            torch.testing.assert_close(stretched.sin[:length], want_sin, rtol=0, atol=1e-6)
        return
    short = RotaryEmbedding(config, ORIGINAL)
    short_cos, short_sin = _transformers_tables(reference, 20)
    torch.testing.assert_close(short.cos[:20], short_cos, rtol=0, atol=1e-6)
    torch.testing.assert_close(short.sin[:20], short_sin, rtol=0, atol=1e-6)
    long_cos, long_sin = _transformers_tables(reference, 60)
    torch.testing.assert_close(stretched.cos[:60], long_cos, rtol=0, atol=1e-6)
    torch.testing.assert_close(stretched.sin[:60], long_sin, rtol=0, atol=1e-6)
    # The factors differ enough that the two tables part from the first frequency on.
    assert not torch.allclose(stretched.cos[:20], short_cos, atol=1e-3)


def test_the_scaling_is_read_as_transformers_reads_it(model):
    name, folder, reference, _ = model
    config = ModelConfig.from_folder(folder)
    theirs = reference.config.rope_parameters
    assert config.rope_scaling["rope_type"] == theirs["rope_type"] == name.split("-")[1]
    assert config.rope_scaling["original_max_position_embeddings"] == ORIGINAL


def test_longrope_picks_one_set_of_factors_by_max_model_len():
    """vLLM's rule: the long factors once max_model_len exceeds the original context, else the short ones."""
    from conveyor.model.layers import _longrope_factors

    scaling = {"original_max_position_embeddings": ORIGINAL, "short_factor": [1.0], "long_factor": [2.0]}
    assert _longrope_factors(scaling, ORIGINAL) == [1.0]
    assert _longrope_factors(scaling, ORIGINAL + 1) == [2.0]


@pytest.mark.parametrize("kernels", ["torch", "native"])
def test_greedy_tokens_and_logprobs_are_transformers(model, kernels):
    """On an engine of the model's whole context (max_model_len 128): each prompt alone, then both in one
    batch, then chunked. longrope also on an engine within the original context (max_model_len 32, the short
    factors): short prompts alone and batched."""
    name, folder, _, _ = model
    prompts = _long_engine_prompts(name)
    llm = LLM(str(folder), kernels=kernels, num_kv_blocks=256)
    assert llm.engine.max_model_len == STRETCHED["max_position_embeddings"]
    assert (llm.engine.runner.kernel_width is not None) == (kernels == "native")
    for prompt in prompts:
        _assert_matches(model, llm.generate([prompt], GREEDY, use_tqdm=False), f"{kernels}, alone")
    _assert_matches(model, llm.generate(prompts, GREEDY, use_tqdm=False), f"{kernels}, batched")
    chunked = LLM(str(folder), kernels=kernels, num_kv_blocks=256, max_num_batched_tokens=19,
                  enable_prefix_caching=False)
    _assert_matches(model, chunked.generate(prompts, GREEDY, use_tqdm=False), f"{kernels}, chunked")
    if name.endswith("longrope"):
        short = LLM(str(folder), kernels=kernels, num_kv_blocks=256, max_model_len=ORIGINAL)
        prompts = [_prompt(20, seed=1), _prompt(18, seed=2)]
        for prompt in prompts:
            _assert_matches(model, short.generate([prompt], SHORT_GREEDY, use_tqdm=False), f"{kernels}, short")
        _assert_matches(model, short.generate(prompts, SHORT_GREEDY, use_tqdm=False), f"{kernels}, short batched")


def test_a_short_prompt_on_a_long_engine_reads_the_long_table(model):
    """longrope on an engine of max_model_len 128: a 20-token prompt rotates by the long factors (vLLM's rule),
    where transformers rotates it by the short ones. The engine's one table is the long factors' on both
    paths, and both answer alike."""
    import torch

    name, folder, reference, _ = model
    if not name.endswith("longrope"):
        pytest.skip("one table whatever the length: YaRN")
    long_cos, _ = _transformers_tables(reference, ORIGINAL + 1)
    short_cos, _ = _transformers_tables(reference, 20)
    prompt, answers = _prompt(20, seed=3), []
    for kernels in ("torch", "native"):
        llm = LLM(str(folder), kernels=kernels, num_kv_blocks=256)
        table = llm.engine.executor.model.rotary.cos
        torch.testing.assert_close(table[: ORIGINAL + 1], long_cos, rtol=0, atol=1e-6)
        assert not torch.allclose(table[:20], short_cos, atol=1e-3)
        [out] = llm.generate([prompt], GREEDY, use_tqdm=False)
        answers.append(out)
    on_torch, on_native = answers
    assert on_torch.token_ids == on_native.token_ids
    for ours, theirs in zip(on_torch.logprobs, on_native.logprobs, strict=True):
        for (token, value), (their_token, their_value) in zip(ours.top, theirs.top, strict=True):
            assert token == their_token and abs(value - their_value) < 1e-4


@pytest.mark.parametrize("kernels", ["torch", "native"])
def test_a_long_prompt_after_a_short_one_it_begins_with(model, kernels):
    """One table for every sequence: a long prompt finds the blocks of a shorter one it begins with in the
    prefix cache, and answers as transformers does."""
    _, folder, _, _ = model
    llm = LLM(str(folder), kernels=kernels, num_kv_blocks=256, block_size=4)
    short = _prompt(20, seed=1)
    llm.generate([short], GREEDY, use_tqdm=False)
    [out] = llm.generate([short + _prompt(40, seed=2)], GREEDY, use_tqdm=False)
    _assert_matches(model, [out], f"{kernels}, long after short")
    assert out.num_cached_tokens >= 16, "the short prompt's blocks should be reused"


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_preempted_sequences_answer_as_before(model, preemption):
    """A tiny pool preempts sequences: computed again or swapped back, they answer as transformers does."""
    name, folder, _, _ = model
    llm = LLM(str(folder), kernels="native", block_size=4, num_kv_blocks=40, max_num_batched_tokens=64,
              preemption_mode=preemption, swap_space="1MiB")
    prompts = [_prompt(len(prompt), seed) for prompt in _long_engine_prompts(name) for seed in (4, 5)]
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    _assert_matches(model, outputs, preemption)
    assert sum(o.metrics.num_preemptions for o in outputs) > 0, "the tiny pool should force preemption"


def test_a_gguf_file_with_yarn_runs_as_transformers_runs_its_export(tmp_path):
    """llama.cpp's YaRN keys (rope.scaling.type, factor, original_context_length, yarn_beta_fast/slow) become the
    same rope parameters, and the file runs as transformers runs the float32 folder Conveyor exports of it."""
    import gguf
    import torch
    import transformers

    from conveyor.model.weights.loader import float32_folder
    from tests.model.test_gguf_families import _write_gguf

    scaling = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL, "beta_fast": 16.0,
               "beta_slow": 2.0}
    torch.manual_seed(0)
    built = transformers.AutoModelForCausalLM.from_config(
        transformers.Qwen2Config(**STRETCHED, num_hidden_layers=2, rope_scaling=dict(scaling))).eval()
    _randomise_norms_and_biases(built)
    path = tmp_path / "tiny-qwen2-yarn.gguf"

    def yarn_keys(writer: gguf.GGUFWriter) -> None:
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(scaling["factor"])
        writer.add_rope_scaling_orig_ctx_len(ORIGINAL)
        writer.add_rope_scaling_yarn_beta_fast(scaling["beta_fast"])
        writer.add_rope_scaling_yarn_beta_slow(scaling["beta_slow"])

    _write_gguf(path, "qwen2", built, metadata=yarn_keys)
    folder = float32_folder(path)
    written = json.loads((folder / "config.json").read_text())["rope_parameters"]
    assert {key: written[key] for key in scaling} == scaling
    assert ModelConfig.from_folder(folder).rope_scaling == scaling
    reference = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    # the file's weights dequantized: exact; over transformers' float32 cache (auto keeps a GGUF file's in float16)
    llm = LLM(str(path), num_kv_blocks=256, kernels="torch", kv_cache_dtype="float32")
    cache: dict = {}
    outputs = llm.generate([_prompt(20), _prompt(60)], GREEDY, use_tqdm=False)
    _assert_matches(("qwen2-yarn.gguf", folder, reference, cache), outputs, "GGUF")


def test_a_gguf_file_with_longrope_runs_as_transformers_runs_its_export(tmp_path):
    """Phi-3's longrope as llama.cpp writes it (the factors as rope_factors_long/short tensors, the original context
    and its attention factor as metadata) becomes the same rope parameters, the factors no weight, and the file
    runs as transformers runs the float32 folder Conveyor exports of it: prompts past the original context on an
    engine whose max_model_len picks the long factors."""
    import gguf
    import numpy as np
    import torch
    import transformers

    from conveyor.model.weights.loader import float32_folder
    from tests.model.test_gguf_families import _write_gguf

    name, (_, extra) = "phi3-longrope", MODELS["phi3-longrope"]
    scaling = {key: [float(np.float32(f)) for f in value] if key.endswith("factor") else value
               for key, value in extra["rope_scaling"].items()}  # as a float32 tensor holds the factors
    attention_factor = float(np.float32(math.sqrt(1 + math.log(4) / math.log(ORIGINAL))))  # llama.cpp's, stored
    torch.manual_seed(0)
    built = transformers.AutoModelForCausalLM.from_config(transformers.Phi3Config(
        **STRETCHED, **dict(extra, rope_scaling=dict(scaling, attention_factor=attention_factor)))).eval()
    _randomise_norms_and_biases(built)
    path = tmp_path / "tiny-phi3-longrope.gguf"

    def longrope_keys(writer: gguf.GGUFWriter) -> None:
        writer.add_rope_scaling_orig_ctx_len(ORIGINAL)
        writer.add_rope_scaling_attn_factors(attention_factor)
        writer.add_tensor("rope_factors_long.weight", np.array(scaling["long_factor"], dtype=np.float32))
        writer.add_tensor("rope_factors_short.weight", np.array(scaling["short_factor"], dtype=np.float32))

    _write_gguf(path, "phi3", built, metadata=longrope_keys)
    folder = float32_folder(path)
    written = json.loads((folder / "config.json").read_text())
    assert written["original_max_position_embeddings"] == ORIGINAL
    assert {key: written["rope_parameters"][key] for key in ("long_factor", "short_factor",
                                                             "original_max_position_embeddings")} == {
        "long_factor": scaling["long_factor"], "short_factor": scaling["short_factor"],
        "original_max_position_embeddings": ORIGINAL}
    assert written["rope_parameters"]["attention_factor"] == pytest.approx(attention_factor, rel=1e-7)  # its float32
    assert ModelConfig.from_folder(folder).rope_scaling["rope_type"] == "longrope"
    assert not any("rope_factors" in key for key in _safetensors_keys(folder))
    reference = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    # the file's weights dequantized: exact; over transformers' float32 cache (auto keeps a GGUF file's in float16)
    llm = LLM(str(path), num_kv_blocks=256, kernels="torch", kv_cache_dtype="float32")
    outputs = llm.generate(_long_engine_prompts(name), GREEDY, use_tqdm=False)
    _assert_matches((f"{name}.gguf", folder, reference, {}), outputs, "GGUF")


def _safetensors_keys(folder) -> list[str]:
    from safetensors import safe_open

    keys: list[str] = []
    for file in folder.glob("*.safetensors"):
        with safe_open(file, "pt") as tensors:
            keys += list(tensors.keys())
    return keys


def test_phi3_reads_its_older_names_and_top_level_context():
    """Phi-3's first 128k checkpoints said ``su`` (transformers reads it, and Phi-3's ``yarn``, as longrope);
    its top-level original context wins over the rope dict's, and the attention factor follows from the
    stretch: sqrt(1 + ln(scale) / ln(original))."""
    from conveyor.model.layers import _rope_inv_freq

    factors = [1.0] * HALF_HEAD
    raw = dict(STRETCHED, model_type="phi3", num_hidden_layers=2, original_max_position_embeddings=ORIGINAL,
               rope_scaling={"type": "su", "short_factor": factors, "long_factor": factors,
                             "original_max_position_embeddings": 64})
    config = ModelConfig.from_hf_dict(raw)
    assert config.rope_scaling["rope_type"] == "longrope"
    assert config.rope_scaling["original_max_position_embeddings"] == ORIGINAL
    _, attention_factor = _rope_inv_freq(SHAPE["head_dim"], 10000.0, config.rope_scaling, 4 * ORIGINAL, ORIGINAL)
    assert attention_factor == pytest.approx(math.sqrt(1 + math.log(4) / math.log(ORIGINAL)))


def test_dynamic_ntk_is_still_refused():
    from conveyor.model.families import family_for

    config = ModelConfig.from_hf_dict(dict(STRETCHED, model_type="qwen2", num_hidden_layers=2,
                                           rope_scaling={"rope_type": "dynamic", "factor": 2.0}))
    with pytest.raises(ValueError, match=r"rope_scaling type 'dynamic' is not supported .*yarn, longrope"):
        family_for(config)
