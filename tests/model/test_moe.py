"""Mixtures of experts: tiny random Qwen3-MoE, Mixtral and OLMoE checkpoints written by transformers.

Greedy output equals transformers' ``generate`` on the same weights, one prompt at a time and all prompts
batched (chunked too, so a step's rows pick many experts at once), on the native stack's expert-grouped step
and on PyTorch ops; the router picks the experts transformers' router picks, with the same weights. OLMoE's
QK-norm over whole projections and its clamp (clip_qkv) are held to the same greedy tokens. A tiny GGUF file of
each, laid out as llama.cpp writes it, runs as transformers runs its float32 export, and runs natively with its
experts kept quantized.
"""

from __future__ import annotations

import functools
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
    # QK-norm over the whole projections, experts as wide as intermediate_size, Q and K clamped where the norm
    # leaves them past 1.5 (a few in ten: test_the_clamp_changes_olmoes_tokens).
    "olmoe": dict(ATTENTION, intermediate_size=32, num_experts=8, num_experts_per_tok=2, clip_qkv=1.5),
}
# What ModelConfig reads of each: experts, top k, their width, norm_topk_prob, the dense layers, clip_qkv.
EXPECTED = {"qwen3_moe": (8, 2, 32, False, (1,), None), "mixtral": (4, 2, 48, True, (), None),
            "olmoe": (8, 2, 32, False, (), 1.5)}


def _write(kind: str, folder: Path, tokenizer_from: Path) -> Path:
    from transformers import (
        MixtralConfig,
        MixtralForCausalLM,
        OlmoeConfig,
        OlmoeForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    config_class, model_class = {"qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM),
                                 "mixtral": (MixtralConfig, MixtralForCausalLM),
                                 "olmoe": (OlmoeConfig, OlmoeForCausalLM)}[kind]
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


@functools.lru_cache(maxsize=64)
def _hf_greedy_12(hf, prompt: tuple[int, ...]) -> list[int]:
    """transformers' 12 greedy tokens after ``prompt``: one model's the same in each kernel and chunking case."""
    return hf_greedy(hf, list(prompt), 12)


def _prompts(lengths: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1000, 40000) for _ in range(n)] for n in lengths]


def test_the_config_says_which_layers_have_experts(moe):
    folder, _ = moe
    config = ModelConfig.from_folder(folder)
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size, config.norm_topk_prob,
            config.dense_layers, config.clip_qkv) == EXPECTED[config.model_type]


@pytest.mark.parametrize("kernels", ["native", "torch"])
@pytest.mark.parametrize("options", [dict(), dict(max_num_batched_tokens=24)], ids=["whole", "chunked"])
def test_greedy_equals_transformers_alone_and_batched(moe, options, kernels):
    folder, hf = moe
    llm = LLM(str(folder), num_kv_blocks=512, kernels=kernels, **options)
    assert (llm.engine.runner.kernel_width is None) == (kernels == "torch")
    prompts = _prompts([1, 5, 17, 40, 90], seed=2)
    expected = [_hf_greedy_12(hf, tuple(prompt)) for prompt in prompts]
    batched = llm.generate(prompts, GREEDY_12, use_tqdm=False)
    assert [output.token_ids for output in batched] == expected
    for prompt, tokens in zip(prompts[:2], expected):
        (alone,) = llm.generate([prompt], GREEDY_12, use_tqdm=False)
        assert alone.token_ids == tokens


def test_the_router_picks_what_transformers_picks(moe):
    """Layer 0's router on the same inputs: the same experts and the same weights."""
    folder, hf = moe
    llm = LLM(str(folder), num_kv_blocks=64, kernels="torch")
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


def test_the_clamp_moves_olmoes_tokens(tmp_path, default_model_dir):
    """transformers' greedy tokens of the tiny OLMoE differ without its clip_qkv: the greedy test above holds
    Conveyor to the clamp, not only to the rest."""
    from transformers import AutoModelForCausalLM

    folder = _write("olmoe", tmp_path, default_model_dir)
    clipped = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    unclipped = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, clip_qkv=None).eval()
    prompts = _prompts([1, 5, 17, 40, 90], seed=2)
    assert any(hf_greedy(clipped, p, 12) != hf_greedy(unclipped, p, 12) for p in prompts)


def test_the_native_stack_runs_olmoe():
    """OLMoE's experts, its QK-norm over whole projections and its clamp all run on the native stack."""
    from conveyor.model.native.kernels import native_gaps

    assert native_gaps(ModelConfig.from_hf_dict(dict(CONFIGS["olmoe"], model_type="olmoe"))) == []


# ----- GGUF files, laid out as llama.cpp writes them -----

GGUF_CONFIGS = {  # every layer a mixture (llama.cpp's qwen3moe has no dense layers), widths in Q8_0 blocks of 32
    "qwen3moe": ("qwen3_moe", dict(CONFIGS["qwen3_moe"], mlp_only_layers=[], norm_topk_prob=True)),
    "llama": ("mixtral", dict(CONFIGS["mixtral"], intermediate_size=64)),
    "olmoe": ("olmoe", dict(CONFIGS["olmoe"], clip_qkv=None)),  # llama.cpp's olmoe clamps nothing
}


def _llama_permuted(values, heads: int):
    """Q or K rows in llama.cpp's rotary order (its converter's permute for the llama architecture)."""
    return values.reshape(heads, 2, values.shape[0] // heads // 2, *values.shape[1:]).swapaxes(1, 2).reshape(
        values.shape)


def _write_moe_gguf(path: Path, arch: str, hf) -> None:
    import gguf

    from tests.model.test_gguf_families import _copy_tokenizer, add_shape

    config, q8 = hf.config, gguf.GGMLQuantizationType.Q8_0
    writer = gguf.GGUFWriter(str(path), arch)
    add_shape(writer, config)
    experts = getattr(config, "num_experts", None) or config.num_local_experts
    writer.add_expert_count(experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    if arch == "qwen3moe":
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    _copy_tokenizer(writer)

    def add(name: str, values, quantized: bool = True) -> None:
        values = values.detach().float().numpy()
        if quantized:
            writer.add_tensor(name, gguf.quants.quantize(values, q8), raw_dtype=q8)
        else:
            writer.add_tensor(name, values)

    add("token_embd.weight", hf.model.embed_tokens.weight)
    add("output_norm.weight", hf.model.norm.weight, quantized=False)
    add("output.weight", hf.lm_head.weight)
    for i, layer in enumerate(hf.model.layers):
        attn, moe, heads = layer.self_attn, layer.mlp, (config.num_attention_heads, config.num_key_value_heads)
        q, k = attn.q_proj.weight, attn.k_proj.weight
        if arch == "llama":
            q, k = (torch.from_numpy(_llama_permuted(w.detach().numpy(), n)) for w, n in zip((q, k), heads))
        for name, values in (("attn_q", q), ("attn_k", k), ("attn_v", attn.v_proj.weight),
                             ("attn_output", attn.o_proj.weight)):
            add(f"blk.{i}.{name}.weight", values)
        norms = [("attn_norm", layer.input_layernorm), ("ffn_norm", layer.post_attention_layernorm)]
        if hasattr(attn, "q_norm"):
            norms += [("attn_q_norm", attn.q_norm), ("attn_k_norm", attn.k_norm)]
        for name, norm in norms:
            add(f"blk.{i}.{name}.weight", norm.weight, quantized=False)
        width = moe.experts.down_proj.shape[-1]
        add(f"blk.{i}.ffn_gate_inp.weight", moe.gate.weight, quantized=False)
        add(f"blk.{i}.ffn_gate_exps.weight", moe.experts.gate_up_proj[:, :width])
        add(f"blk.{i}.ffn_up_exps.weight", moe.experts.gate_up_proj[:, width:])
        add(f"blk.{i}.ffn_down_exps.weight", moe.experts.down_proj)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module", params=sorted(GGUF_CONFIGS))
def moe_gguf(request, tmp_path_factory, default_model_dir):
    """A tiny mixture of experts as a GGUF file (Q8_0 projections and experts), and its transformers model."""
    from transformers import AutoModelForCausalLM

    kind, config = GGUF_CONFIGS[request.param]
    folder = tmp_path_factory.mktemp(f"{kind}-hf")
    hf = AutoModelForCausalLM.from_pretrained(_write_as(kind, config, folder, default_model_dir), dtype=torch.float32)
    path = tmp_path_factory.mktemp(f"{kind}-gguf") / f"tiny-{kind}.gguf"
    _write_moe_gguf(path, request.param, hf.eval())
    return kind, path, hf


def _write_as(kind: str, config: dict, folder: Path, tokenizer_from: Path) -> Path:
    saved = CONFIGS[kind]
    CONFIGS[kind] = config
    try:
        return _write(kind, folder, tokenizer_from)
    finally:
        CONFIGS[kind] = saved


def test_a_gguf_file_runs_as_transformers_runs_its_export(moe_gguf):
    """The file's config names the family and its experts; Conveyor runs the file (its weights dequantized, on
    PyTorch ops: exact) and transformers its float32 export, each expert a tensor of its own: the greedy tokens
    agree."""
    import json

    from transformers import AutoModelForCausalLM

    from conveyor.model.weights.loader import float32_folder

    kind, path, original = moe_gguf
    folder = float32_folder(path)
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == kind and config["num_experts_per_tok"] == 2
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    for name, tensor in original.state_dict().items():  # Q8_0 rounds each weight by at most a step (its scale's too)
        exported = reference.state_dict()[name]
        assert torch.allclose(exported, tensor, atol=tensor.abs().max().item() / 127), name
    llm = LLM(str(path), num_kv_blocks=256, kernels="torch")
    assert llm.engine.model_config.num_experts == EXPECTED[kind][0]
    prompts = _prompts([3, 20, 45], seed=4)
    outputs = llm.generate(prompts, GREEDY_12, use_tqdm=False)
    assert [output.token_ids for output in outputs] == [hf_greedy(reference, p, 12) for p in prompts]


def test_a_gguf_file_runs_natively_with_its_experts_kept_quantized(moe_gguf):
    """On the native stack every expert stays the file's Q8_0 codes, and activations are quantized too
    (docs/quantized-weights.md), so tokens are held to the exact run as the dense families' are
    (test_gguf_families): each prompt's first token is the exact run's, and the second is the exact run's or
    within 0.05 of its logprob. Prompts of many rows route to every expert in one step."""
    kind, path, _ = moe_gguf
    llm = LLM(str(path), num_kv_blocks=256)
    assert llm.engine.runner.kernel_width is not None and llm.engine.runner.kernel_dtype == "Q8_0", kind
    model = llm.engine.executor.model
    assert all(len(layer.mlp.gate_up_proj.expert_weights()) == model.config.num_experts for layer in model.layers)
    exact = LLM(str(path), num_kv_blocks=256, kernels="torch")
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, logprobs=5)
    prompts = _prompts([3, 20, 70], seed=4)
    for ours, want in zip(llm.generate(prompts, params, use_tqdm=False),
                          exact.generate(prompts, params, use_tqdm=False), strict=True):
        assert ours.token_ids[0] == want.token_ids[0], (kind, len(ours.prompt_token_ids))
        second = dict(want.logprobs[1].top)
        assert ours.token_ids[1] in second and second[ours.token_ids[1]] >= want.logprobs[1].logprob - 0.05


def test_each_step_counts_the_experts_its_rows_chose(moe):
    """Decoder.step_experts, what calibration sets beside the simulator's expectation: one count per
    mixture-of-experts layer, the same on the native stack as on PyTorch ops (the same routing), between top-k
    and every expert, and top-k exactly for a step of one row."""
    folder, _ = moe
    config = ModelConfig.from_folder(folder)
    counts = {}
    for kernels in ("native", "torch"):
        llm = LLM(str(folder), num_kv_blocks=256, kernels=kernels)
        engine, model = llm.engine, llm.engine.executor.model
        engine.add_request(_prompts([60], seed=5)[0], SamplingParams(temperature=0.0, max_tokens=2))
        engine.step()
        prompt_step = model.step_experts()
        engine.step()
        counts[kernels] = (prompt_step, model.step_experts())
    moe_layers = config.num_layers - len(config.dense_layers)
    prompt_step, decode_step = counts["native"]
    assert counts["native"] == counts["torch"]
    assert len(prompt_step) == moe_layers and all(
        config.num_experts_per_tok <= n <= config.num_experts for n in prompt_step)
    assert decode_step == [config.num_experts_per_tok] * moe_layers


def test_bfloat16_runs_natively_as_the_torch_bfloat16_path_does(moe, kernels):
    """With --dtype bfloat16 the experts (and router) are packed in bf16 and run on the native stack: each
    prompt's first greedy token is the torch bf16 path's, or within 0.05 of its logprob (random tiny weights
    leave near-ties: OLMoE's first two candidates measured 0.002 apart in float32, equal in bf16)."""
    from conveyor.model.native.kernels import BF16_FEATURE

    if not kernels.has_bfloat16():
        pytest.skip(f"CPU lacks {BF16_FEATURE}: no bfloat16 kernels to check")
    folder, _ = moe
    native = LLM(str(folder), num_kv_blocks=128, dtype="bfloat16", kernels="native")
    assert native.engine.runner.kernel_dtype == "bfloat16"
    reference = LLM(str(folder), num_kv_blocks=128, dtype="bfloat16", kernels="torch")
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=5)
    prompts = _prompts([5, 17, 40], seed=2)
    for ours, want in zip(native.generate(prompts, params, use_tqdm=False),
                          reference.generate(prompts, params, use_tqdm=False), strict=True):
        top = dict(want.logprobs[0].top)
        assert ours.token_ids[0] in top and top[ours.token_ids[0]] >= want.logprobs[0].logprob - 0.05
