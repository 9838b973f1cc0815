"""GGUF files of the Qwen and Phi-3 families: a tiny random model written as llama.cpp lays a file out, read back.

The file is built here from a tiny transformers model: llama.cpp's tensor names (no rotary row reordering:
llama.cpp keeps HF's order for Qwen and Phi-3; Phi-3's projections fused as its checkpoints hold them, its
window of every layer as metadata), its metadata keys, Q8_0 projections and the default model's tokenizer
(tokens, merges, chat template) as metadata. Conveyor then runs the file itself on PyTorch ops (the file's
weights dequantized), and transformers runs the float32 folder Conveyor's export writes of it: the greedy
tokens must agree, and the export must hold the tiny model's float tensors as Q8_0 rounds them. Both also run
on the native kernels, their weights kept quantized (Qwen3 with its QK-norm), and agree with the exact run on
the first tokens. An architecture no family reads is refused in one line.
"""

from __future__ import annotations

import functools
import json

import gguf
import numpy as np
import pytest

from conveyor import LLM, SamplingParams
from conveyor.entrypoints import cli
from conveyor.model.weights.loader import float32_folder
from conveyor.model.weights.paths import default_model_path
from tests.harness import hf_greedy, write_gpt2_gguf
from tests.model.test_families import SHAPE, _randomise_norms_and_biases

TOKENIZER_KEYS = ("model", "pre", "tokens", "token_type", "merges", "bos_token_id", "eos_token_id")
GGUF_LAYER_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
                    "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
                    "post_attention_layernorm": "ffn_norm", "self_attn.qkv_proj": "attn_qkv",
                    "mlp.gate_up_proj": "ffn_up"}


def _gguf_name(hf: str) -> str:
    hf = hf.removeprefix("model.")
    base, _, suffix = hf.rpartition(".")
    globals_ = {"embed_tokens": "token_embd", "norm": "output_norm", "lm_head": "output"}
    if base in globals_:
        return f"{globals_[base]}.{suffix}"
    _, layer, rest = base.split(".", 2)
    return f"blk.{layer}.{GGUF_LAYER_NAMES[rest]}.{suffix}"


@functools.lru_cache(maxsize=1)
def _default_tokenizer() -> tuple[dict, str]:
    """The default model's tokenizer fields and chat template, read once per process: gguf's reader takes about 2 s
    over its 49k tokens and merges, and a run writes a dozen tiny files with them."""
    reader = gguf.GGUFReader(default_model_path())
    value = {key: reader.fields[f"tokenizer.ggml.{key}"].contents() for key in TOKENIZER_KEYS}
    return value, reader.fields["tokenizer.chat_template"].contents()


def _copy_tokenizer(writer: gguf.GGUFWriter) -> None:
    """The default model's tokenizer and chat template, as its GGUF file stores them."""
    value, chat_template = _default_tokenizer()
    writer.add_tokenizer_model(value["model"])
    writer.add_tokenizer_pre(value["pre"])
    writer.add_token_list(value["tokens"])
    writer.add_token_types(value["token_type"])
    writer.add_token_merges(value["merges"])
    writer.add_bos_token_id(value["bos_token_id"])
    writer.add_eos_token_id(value["eos_token_id"])
    writer.add_chat_template(chat_template)


def add_shape(writer: gguf.GGUFWriter, config) -> None:
    """A transformers config's shape as llama.cpp's metadata keys."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])


def _write_gguf(path, arch: str, model, metadata=None) -> None:
    """``metadata``: writes keys of its own too (test_rope_scaling: YaRN's)."""
    config = model.config
    writer = gguf.GGUFWriter(str(path), arch)
    add_shape(writer, config)
    if getattr(config, "sliding_window", None):
        writer.add_sliding_window(config.sliding_window)
    if metadata is not None:
        metadata(writer)
    _copy_tokenizer(writer)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        values = tensor.float().numpy()
        if values.ndim == 2:
            writer.add_tensor(_gguf_name(name), gguf.quants.quantize(values, gguf.GGMLQuantizationType.Q8_0),
                              raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(_gguf_name(name), values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module", params=["qwen2", "qwen3", "phi3"])
def gguf_file(request, tmp_path_factory):
    import torch
    import transformers

    torch.manual_seed(0)
    config_class, extra = {"qwen2": (transformers.Qwen2Config, {}), "qwen3": (transformers.Qwen3Config, {}),
                           "phi3": (transformers.Phi3Config, {"sliding_window": 24, "pad_token_id": 0})}[request.param]
    config = config_class(**SHAPE, num_hidden_layers=2, **extra)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    _randomise_norms_and_biases(model)
    path = tmp_path_factory.mktemp(request.param) / f"tiny-{request.param}.gguf"
    _write_gguf(path, request.param, model)
    return request.param, path, model


def test_the_file_runs_as_transformers_runs_its_export(gguf_file):
    import torch
    from transformers import AutoModelForCausalLM

    arch, path, original = gguf_file
    folder = float32_folder(path)
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == arch and config["head_dim"] == SHAPE["head_dim"]
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    for name, tensor in original.state_dict().items():  # Q8_0 rounds each weight by at most half a step
        assert torch.allclose(reference.state_dict()[name], tensor, atol=tensor.abs().max().item() / 127), name
    prompts = [[int(t) for t in np.random.default_rng(n).integers(1000, 40000, n)] for n in (3, 20, 70)]
    params = SamplingParams(temperature=0.0, max_tokens=10)
    llm = LLM(str(path), num_kv_blocks=256, kernels="torch")  # the file's weights dequantized: exact
    for output in llm.generate(prompts, params, use_tqdm=False):
        assert output.token_ids == hf_greedy(reference, output.prompt_token_ids, 10), arch
    assert llm.chat([[{"role": "user", "content": "Hi"}]], params, use_tqdm=False)[0].prompt_token_ids


def test_the_file_runs_on_the_native_kernels_kept_quantized(gguf_file):
    """Kept quantized, activations are quantized too (docs/quantized-weights.md), so the tokens are not
    compared bit for bit with the exact run: the family runs natively on the file's Q8_0 codes, each prompt's
    first token is the dequantized run's, and the second is the exact run's or within 0.05 of its logprob
    (random tiny weights leave near-ties: measured 0.001 apart where Phi-3's parted)."""
    arch, path, _ = gguf_file
    llm = LLM(str(path), num_kv_blocks=256)
    assert llm.engine.runner.kernel_width is not None and llm.engine.runner.kernel_dtype == "Q8_0", arch
    exact = LLM(str(path), num_kv_blocks=256, kernels="torch")
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, logprobs=5)
    prompts = [[int(t) for t in np.random.default_rng(n).integers(1000, 40000, n)] for n in (3, 20, 70)]
    for ours, want in zip(llm.generate(prompts, params, use_tqdm=False),
                          exact.generate(prompts, params, use_tqdm=False), strict=True):
        assert ours.token_ids[0] == want.token_ids[0], (arch, len(ours.prompt_token_ids))
        second = dict(want.logprobs[1].top)
        assert ours.token_ids[1] in second and second[ours.token_ids[1]] >= want.logprobs[1].logprob - 0.05


def test_an_unknown_gguf_architecture_is_one_line(tmp_path, capsys):
    path = tmp_path / "tiny-gpt2.gguf"
    write_gpt2_gguf(path)
    assert cli.main(["generate", "--model", str(path), "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("conveyor: error:") and len(err.strip().splitlines()) == 1, err
    supported = "gemma3, llama, olmoe, phi3, qwen2, qwen3, qwen3moe"
    assert f"GGUF architecture 'gpt2' is not supported (supported: {supported})" in err
