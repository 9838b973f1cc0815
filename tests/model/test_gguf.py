"""Tests for conveyor.model.weights.gguf: the GGUF -> Hugging Face folder converter.

The reference for the weights is transformers' own, independent GGUF loader, so a mistake in names, shapes or
the Q/K row permutation shows up as a parameter mismatch rather than only as bad text.
"""

import json
import os
import pathlib
import time

import numpy as np
import pytest
import torch

from conveyor.model.weights.gguf import STALE_PARTIAL_S, _remove_stale_partials, unpermute_rope_rows
from conveyor.model.weights.gguf_export import export_gguf_to_hf
from conveyor.model.weights.paths import conversion_key, default_model_path
from tests.harness import read_gguf_once_per_file, write_gpt2_gguf

# transformers (imported lazily, inside the tests) and huggingface_hub read these once, on import.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


# The default model is part of the install (`make install`): its absence is a failure, not a skip.
MODEL_DIR = default_model_path().parent


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """Convert once for the whole module."""
    out = tmp_path_factory.mktemp("gguf") / "smollm2"
    with pytest.MonkeyPatch.context() as patch:
        read_gguf_once_per_file(patch)  # the converter's reader, and transformers' for the tokenizer: one parse
        result = export_gguf_to_hf(MODEL_DIR / GGUF_NAME, out)
    assert result == out
    return out


@pytest.fixture(scope="module")
def converted_model(converted: pathlib.Path):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(converted, torch_dtype=torch.float32).eval()


def test_folder_contents_and_config(converted: pathlib.Path) -> None:
    names = {p.name for p in converted.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    assert "generation_config.json" in names
    assert not any(p.name.startswith(".") for p in converted.parent.iterdir()), "staging folder left behind"

    config = json.loads((converted / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (30, 576, 49152)
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (9, 3, 64)
    assert config["tie_word_embeddings"] is True
    assert config["rms_norm_eps"] == 1e-5

    from transformers import AutoConfig

    loaded = AutoConfig.from_pretrained(converted)
    assert loaded.rope_parameters["rope_theta"] == 100000.0
    assert loaded.rope_parameters["rope_type"] == "default"
    assert (loaded.bos_token_id, loaded.eos_token_id, loaded.pad_token_id) == (1, 2, 2)


def test_parameters_match_transformers_gguf_loader(converted_model, monkeypatch) -> None:
    from transformers import LlamaForCausalLM

    read_gguf_once_per_file(monkeypatch)
    reference = LlamaForCausalLM.from_pretrained(MODEL_DIR, gguf_file=GGUF_NAME, torch_dtype=torch.float32)
    ours, theirs = converted_model.state_dict(), reference.state_dict()
    assert ours.keys() == theirs.keys()
    for name, value in ours.items():
        assert value.shape == theirs[name].shape, name
        torch.testing.assert_close(value, theirs[name], rtol=0, atol=1e-6, msg=name)
    # The permutation-sensitive tensors, explicitly, so a regression names the culprit.
    for layer in (0, 29):
        for proj in ("q_proj", "k_proj"):
            name = f"model.layers.{layer}.self_attn.{proj}.weight"
            assert torch.equal(ours[name], theirs[name]), name


def test_greedy_generation_is_sensible(converted, converted_model) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(converted)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        output = converted_model.generate(**prompt, max_new_tokens=8, do_sample=False)
    answer = tokenizer.decode(output[0, prompt["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer, answer


def test_tokenizer_round_trip_and_chat_template(converted: pathlib.Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(converted)
    text = "Hello world! Tokenizers should round-trip: 123, émigré, 東京."
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text
    assert (tokenizer.bos_token, tokenizer.eos_token) == ("<|im_start|>", "<|im_end|>")
    assert tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]) == [1, 2]

    saved = json.loads((converted / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in saved["chat_template"]
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert rendered.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_missing_file_names_path(tmp_path: pathlib.Path) -> None:
    missing = tmp_path / "nope.gguf"
    with pytest.raises(FileNotFoundError, match=r"nope\.gguf"):
        export_gguf_to_hf(missing, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_non_llama_architecture_is_rejected(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "tiny-gpt2.gguf"
    write_gpt2_gguf(path)
    with pytest.raises(ValueError, match="gpt2"):
        export_gguf_to_hf(path, tmp_path / "out")
    assert list(tmp_path.iterdir()) == [path], "nothing may be written for a rejected file"


def test_existing_output_folder_is_not_overwritten(tmp_path: pathlib.Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    with pytest.raises(FileExistsError):
        export_gguf_to_hf(__file__, out)
    assert (out / "keep.txt").read_text() == "precious"


def test_unpermute_inverts_llama_cpp_permutation() -> None:
    """Apply llama.cpp's HF->GGUF row order (halves -> interleaved pairs) and check we undo it exactly."""
    heads, head_dim, cols = 3, 8, 5
    hf = np.arange(heads * head_dim * cols, dtype=np.float32).reshape(heads * head_dim, cols)
    # Row j of each GGUF head holds HF row (j % 2) * half + j // 2.
    half = head_dim // 2
    order = [h * head_dim + (j % 2) * half + j // 2 for h in range(heads) for j in range(head_dim)]
    assert np.array_equal(unpermute_rope_rows(hf[order], heads), hf)
    assert np.array_equal(unpermute_rope_rows(hf[order][:, 0], heads), hf[:, 0])  # 1-D (bias) rows too


def test_a_conversion_is_keyed_by_the_files_contents_not_its_place(tmp_path: pathlib.Path, monkeypatch) -> None:
    monkeypatch.setenv("CONVEYOR_CACHE_DIR", str(tmp_path / "cache"))
    data = bytes(range(256)) * 4096
    first, second = tmp_path / "a" / GGUF_NAME, tmp_path / "b" / GGUF_NAME
    for path in (first, second):
        path.parent.mkdir()
        path.write_bytes(data)
    os.utime(second, ns=(10**18, 10**18))
    key = conversion_key(first)
    assert conversion_key(second) == key, "another install of the same file: the same folder"
    assert conversion_key(first) == key, "and again, from the remembered digest"
    for offset in (0, len(data) // 2, len(data) - 1):  # any byte, a header's or a tensor's
        changed = bytearray(data)
        changed[offset] ^= 1
        second.write_bytes(changed)
        os.utime(second, ns=(10**18 + offset + 1, 10**18 + offset + 1))
        assert conversion_key(second) != key
    assert len(conversion_key(MODEL_DIR / GGUF_NAME)) == 12


def test_a_killed_conversions_staging_folder_is_removed_and_a_live_ones_kept(tmp_path: pathlib.Path) -> None:
    out = tmp_path / "model"
    stale, live, other = tmp_path / ".model.partial-0", tmp_path / ".model.partial-1", tmp_path / ".other.partial-0"
    for folder in (stale, live, other):
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"x")
    old = time.time() - STALE_PARTIAL_S - 60
    for entry in (stale, stale / "model.safetensors", other, other / "model.safetensors"):
        os.utime(entry, (old, old))
    _remove_stale_partials(out)
    assert not stale.exists(), "left by a kill: removed"
    assert live.exists(), "still being written: kept"
    assert other.exists(), "another model's: not this conversion's to remove"


def test_a_second_process_converting_the_same_file_uses_the_first_ones_folder(tmp_path, monkeypatch) -> None:
    import conveyor.model.weights.gguf as converter
    from conveyor.model.weights.paths import resolve_model

    monkeypatch.setenv("CONVEYOR_CACHE_DIR", str(tmp_path))

    def lose_the_race(gguf_path, out_dir, **options):  # the other process publishes first; our rename then fails
        pathlib.Path(out_dir).mkdir(parents=True)
        (pathlib.Path(out_dir) / "config.json").write_text("{}")
        raise OSError(39, "Directory not empty")

    monkeypatch.setattr(converter, "convert_gguf_to_hf", lose_the_race)
    folder = resolve_model(None)
    assert (folder / "config.json").read_text() == "{}" and folder.parent == tmp_path / "models"

    def fail(gguf_path, out_dir, **options):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(converter, "convert_gguf_to_hf", fail)
    monkeypatch.setenv("CONVEYOR_CACHE_DIR", str(tmp_path / "empty"))
    with pytest.raises(OSError, match="No space left"):
        resolve_model(None)
