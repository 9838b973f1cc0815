"""Every family on a tiny random-weight config: greedy tokens equal to transformers', alone and batched.

Each config is built here with transformers' own config class and saved by its own model class, so the
reference is transformers' implementation of the family, on the same weights. Norm weights and biases are
drawn at random too (a fresh model's are ones and zeros, which would hide a (1 + w) read as w, or a bias
left out). Windows are short (16, 24 positions) and prompts run past them, so a layer that attended to its
whole context would answer otherwise. The paged cache runs with prefix caching on (the default), prompts
chunked by a small token budget, preemption by recompute and by swap from a tiny pool, and both kernel
paths: the native stack and the PyTorch ops.
"""

from __future__ import annotations

import logging
import random
import shutil
from pathlib import Path

import pytest

from conveyor import LLM, SamplingParams
from tests.harness import hf_greedy

SHAPE = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             vocab_size=49152, max_position_embeddings=1024, bos_token_id=1, eos_token_id=2, initializer_range=0.08)
FAMILIES = {
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(num_hidden_layers=2, sliding_window=24)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(num_hidden_layers=2, tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(num_hidden_layers=2)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(num_hidden_layers=2, sliding_window=24, pad_token_id=0)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        num_hidden_layers=3, sliding_window=16, query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"])),
}
GREEDY = SamplingParams(temperature=0.0, max_tokens=12)
LENGTHS = [1, 5, 15, 16, 17, 30, 64, 100]


def _prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1000, 40000) for _ in range(n)] for n in LENGTHS]


def _randomise_norms_and_biases(model) -> None:
    """Norms around their identity (1 for w, 0 for 1 + w) and biases around 0, at random."""
    import torch

    generator = torch.Generator().manual_seed(1)
    one_plus = model.config.model_type.startswith("gemma")
    for name, param in model.named_parameters():
        if "norm" in name or name.endswith(".bias"):
            base = 1.0 if "norm" in name and not one_plus else 0.0
            param.data = base + 0.3 * torch.randn(param.shape, generator=generator)


def _build(family: str, folder: Path, tokenizer_dir: Path):
    """Save a tiny random ``family`` model into ``folder``; return transformers' model of it."""
    import torch
    import transformers

    config_name, model_name, extra = FAMILIES[family]
    torch.manual_seed(0)
    config = getattr(transformers, config_name)(**SHAPE, **extra)
    model = getattr(transformers, model_name)(config).eval()
    _randomise_norms_and_biases(model)
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, folder / name)
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory, default_model_dir):
    """(family name, its folder, a function giving transformers' greedy tokens of a prompt)."""
    folder = tmp_path_factory.mktemp(request.param)
    reference_model = _build(request.param, folder, default_model_dir)
    cache: dict[tuple[int, ...], list[int]] = {}

    def reference(prompt: list[int]) -> list[int]:
        if tuple(prompt) not in cache:
            cache[tuple(prompt)] = hf_greedy(reference_model, prompt, GREEDY.max_tokens)
        return cache[tuple(prompt)]

    return request.param, folder, reference


OPTIONS = {
    "batched": dict(),
    "chunked": dict(max_num_batched_tokens=19),
    "recompute": dict(block_size=4, num_kv_blocks=60, max_num_batched_tokens=64),
    "swap": dict(block_size=4, num_kv_blocks=60, max_num_batched_tokens=64, preemption_mode="swap", swap_space="1MiB"),
}


@pytest.mark.parametrize("kernels", ["auto", "torch"])
@pytest.mark.parametrize("options", sorted(OPTIONS))
def test_family_matches_transformers_batched(family, options, kernels):
    name, folder, reference = family
    llm = LLM(str(folder), kernels=kernels, **{"num_kv_blocks": 1024, **OPTIONS[options]})
    assert (llm.engine.runner.kernel_width is not None) == (kernels == "auto")
    prompts = _prompts(seed=1)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        assert output.token_ids == reference(prompt), f"{name}: prompt of {len(prompt)} tokens"
    if options in ("recompute", "swap"):
        assert sum(o.metrics.num_preemptions for o in outputs) > 0, "the tiny pool should force preemption"


def test_family_matches_transformers_alone_and_from_the_prefix_cache(family):
    """Each prompt alone, then a prompt that extends one already run: its prefix comes from the cache."""
    name, folder, reference = family
    llm = LLM(str(folder), num_kv_blocks=512)
    prompts = _prompts(seed=2)
    for prompt in prompts:
        [output] = llm.generate([prompt], GREEDY, use_tqdm=False)
        assert output.token_ids == reference(prompt), f"{name}: prompt of {len(prompt)} tokens"
    longer = prompts[-1] + prompts[-2]
    [output] = llm.generate([longer], GREEDY, use_tqdm=False)
    assert output.num_cached_tokens > 0, "the longest prompt's blocks should be reused"
    assert output.token_ids == reference(longer)


def test_every_family_runs_on_the_native_stack_without_a_warning(family, caplog):
    _, folder, _ = family
    with caplog.at_level(logging.WARNING, logger="conveyor.engine"):
        llm = LLM(str(folder), num_kv_blocks=64)
    assert llm.engine.runner.kernel_width is not None
    assert not [r for r in caplog.records if "not the native kernels" in r.getMessage()]


def test_a_head_size_the_native_stack_lacks_runs_on_torch_ops_and_says_so_once(tmp_path, default_model_dir, caplog):
    """Heads of 24 (attention is unrolled for 8 to 256 in steps the kernels have): PyTorch ops, one warning
    naming the head size, and transformers' tokens."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(**{**SHAPE, "hidden_size": 48, "num_attention_heads": 2,
                                         "num_key_value_heads": 1, "head_dim": 24, "num_hidden_layers": 1})
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_model_dir / name, tmp_path / name)
    with caplog.at_level(logging.WARNING, logger="conveyor.engine"):
        llm = LLM(str(tmp_path), num_kv_blocks=64)
    assert llm.engine.runner.kernel_width is None
    [warning] = [r.getMessage() for r in caplog.records if "not the native kernels" in r.getMessage()]
    assert "heads of 24" in warning
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    prompt = _prompts(seed=4)[3]
    [output] = llm.generate([prompt], GREEDY, use_tqdm=False)
    assert output.token_ids == hf_greedy(reference, prompt, GREEDY.max_tokens)


def test_a_window_no_sequence_reaches_runs_on_the_native_stack(tmp_path, default_model_dir):
    """Mistral's window of 4096 under a max_model_len of 1024 never binds: the native stack runs it, and its
    tokens are transformers' (which applies the window, to no effect here)."""
    reference_model = _build("mistral", tmp_path, default_model_dir)
    config = tmp_path / "config.json"
    config.write_text(config.read_text().replace('"sliding_window": 24', '"sliding_window": 4096'))
    reference_model.config.sliding_window = 4096
    llm = LLM(str(tmp_path), num_kv_blocks=512, max_model_len=1024)
    assert llm.engine.runner.kernel_width is not None, "the native stack runs a window it never reaches"
    prompts = _prompts(seed=3)
    for prompt, output in zip(prompts, llm.generate(prompts, GREEDY, use_tqdm=False)):
        assert output.token_ids == hf_greedy(reference_model, prompt, GREEDY.max_tokens), len(prompt)


@pytest.mark.parametrize("kernels", ["auto", "torch"])
def test_qwen_windows_from_use_sliding_window_match_transformers(tmp_path, default_model_dir, kernels):
    """Qwen2's config windows the layers from ``max_window_layers`` on when ``use_sliding_window`` is set: here
    layer 1 of 2 attends to the last 16 positions, and prompts run past it."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.Qwen2Config(**SHAPE, num_hidden_layers=2, use_sliding_window=True, sliding_window=16,
                                      max_window_layers=1)
    model = transformers.Qwen2ForCausalLM(config).eval()
    _randomise_norms_and_biases(model)
    model.save_pretrained(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_model_dir / name, tmp_path / name)
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    llm = LLM(str(tmp_path), num_kv_blocks=512, kernels=kernels)
    assert llm.engine.model_config.layer_windows == (None, 16)
    prompts = [prompt for prompt in _prompts(seed=5) if len(prompt) >= 15]
    for prompt, output in zip(prompts, llm.generate(prompts, GREEDY, use_tqdm=False)):
        assert output.token_ids == hf_greedy(reference, prompt, GREEDY.max_tokens), len(prompt)
