"""Mixtures of experts on the float path: tiny random Qwen3-MoE and Mixtral checkpoints written by transformers.

Greedy output equals transformers' ``generate`` on the same weights, one prompt at a time and all prompts
batched (chunked too, so a step's rows pick many experts at once); the router picks the experts transformers'
router picks, with the same weights.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest
import torch

from conveyor import LLM, SamplingParams
from conveyor.core.model_config import ModelConfig
from conveyor.model.layers import SparseMoE
from tests.conftest import TINY_CONFIG
from tests.harness import hf_greedy

GREEDY_12 = SamplingParams(temperature=0.0, max_tokens=12)
ATTENTION = {key: TINY_CONFIG[key] for key in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                               "num_key_value_heads", "vocab_size", "max_position_embeddings",
                                               "eos_token_id", "bos_token_id")}
CONFIGS = {
    # Three layers, the middle one dense (mlp_only_layers), and a router whose picks are not scaled to sum to 1.
    "qwen3_moe": dict(ATTENTION, num_hidden_layers=3, intermediate_size=96, moe_intermediate_size=32,
                      num_experts=8, num_experts_per_tok=2, norm_topk_prob=False, mlp_only_layers=[1], head_dim=16),
    "mixtral": dict(ATTENTION, intermediate_size=48, num_local_experts=4, num_experts_per_tok=2),
}


def _write(kind: str, folder: Path, tokenizer_from: Path) -> Path:
    from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    config_class, model_class = {"qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM),
                                 "mixtral": (MixtralConfig, MixtralForCausalLM)}[kind]
    torch.manual_seed(1)
    model = model_class(config_class(**CONFIGS[kind]))
    with torch.no_grad():  # routers wide apart: a tie between two experts' probabilities would pick either
        for layer in model.model.layers:
            router = getattr(layer, "mlp", None) or layer.block_sparse_moe
            if hasattr(router, "gate"):
                router.gate.weight.normal_(0, 1.0)
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_from / name, folder / name)
    return folder


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def moe(request, tmp_path_factory, default_model_dir):
    """(folder, transformers' model) of one tiny mixture of experts."""
    from transformers import AutoModelForCausalLM

    folder = _write(request.param, tmp_path_factory.mktemp(request.param), default_model_dir)
    return folder, AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def _prompts(lengths: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1000, 40000) for _ in range(n)] for n in lengths]


def test_the_config_says_which_layers_have_experts(moe):
    folder, _ = moe
    config = ModelConfig.from_folder(folder)
    if config.model_type == "qwen3_moe":
        assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (8, 2, 32)
        assert config.dense_layers == (1,) and not config.norm_topk_prob
    else:
        assert (config.num_experts, config.moe_intermediate_size, config.norm_topk_prob) == (4, 48, True)
        assert config.dense_layers == ()


@pytest.mark.parametrize("options", [dict(), dict(max_num_batched_tokens=24)], ids=["whole", "chunked"])
def test_greedy_equals_transformers_alone_and_batched(moe, options):
    folder, hf = moe
    llm = LLM(str(folder), num_kv_blocks=512, **options)
    assert llm.engine.runner.kernel_width is None, "a mixture of experts runs on PyTorch ops"
    prompts = _prompts([1, 5, 17, 40, 90], seed=2)
    expected = [hf_greedy(hf, prompt, 12) for prompt in prompts]
    batched = llm.generate(prompts, GREEDY_12, use_tqdm=False)
    assert [output.token_ids for output in batched] == expected
    for prompt, tokens in zip(prompts[:2], expected):
        (alone,) = llm.generate([prompt], GREEDY_12, use_tqdm=False)
        assert alone.token_ids == tokens


def test_the_router_picks_what_transformers_picks(moe):
    """Layer 0's router on the same inputs: the same experts and the same weights."""
    folder, hf = moe
    llm = LLM(str(folder), num_kv_blocks=64)
    ours = llm.engine.executor.model.layers[0].mlp
    assert isinstance(ours, SparseMoE)
    x = torch.randn(50, CONFIGS[hf.config.model_type]["hidden_size"], generator=torch.Generator().manual_seed(3))
    block = getattr(hf.model.layers[0], "mlp", None) or hf.model.layers[0].block_sparse_moe
    _, their_weights, their_experts = block.gate(x)
    experts, weights = ours.route(x)
    assert torch.equal(experts, their_experts)
    assert torch.equal(weights, their_weights)
    with torch.no_grad():
        assert torch.allclose(ours(x), block(x[None])[0], atol=1e-6)
