"""Turn a GGUF file into a Hugging Face model folder: with its weights, or only its description.

Conveyor runs a GGUF file's quantized weights as they are (:mod:`conveyor.model.weights.gguf_weights`), but what
describes the model (config.json, the tokenizer and its chat template, generation defaults) is read the HF
way, so a GGUF file gets a small folder of those, without weights. This module writes that folder and needs
no torch: finding a model (:mod:`conveyor.model.weights.paths`) does not load the model's runtime. With weights
(:mod:`conveyor.model.weights.gguf_export`), every tensor is dequantized once, llama.cpp's layout changes
undone, and the folder is one that both Conveyor and ``transformers`` load: the export other engines are
compared on. Nothing is downloaded. The architectures read are those of :mod:`conveyor.model.families` with a
GGUF name (llama, qwen2, qwen3, qwen3moe, olmoe, phi3, gemma3); what each names or leaves out is in
:mod:`conveyor.model.weights.gguf_families`.
"""

from __future__ import annotations

import errno
import json
import math
import os
import pathlib
import shutil
import time
import uuid
from collections.abc import Callable
from typing import Any

import gguf
import numpy as np

from conveyor.core.formats import FLOAT_BYTES
from conveyor.model.families import LLAMA, Family, gguf_family
from conveyor.model.weights.gguf_families import (
    EXPERT_NAMES,
    default_chat_template,
    expert_name,
    family_config,
    is_norm,
    layer_names,
)

__all__ = ["ROPE_FREQS", "ROPE_TENSORS", "WeightWriter", "convert_gguf_to_hf", "dequantize", "hf_name", "hf_norm",
           "rope_heads", "rope_row_order", "unpermute_rope_rows"]

# Writes a folder's weights into the folder being assembled, from the open file, its family and hyperparameters.
WeightWriter = Callable[["gguf.GGUFReader", Family, dict[str, Any], pathlib.Path], None]


# GGUF tensor base names (without ".weight"/".bias") that are not per-layer.
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}

# llama.cpp stores Llama-3 RoPE scaling as a precomputed per-frequency tensor instead of config values.
ROPE_FREQS = "rope_freqs.weight"
# Phi-3's longrope: its two sets of per-frequency factors, which llama.cpp writes as tensors.
ROPE_FACTORS_LONG, ROPE_FACTORS_SHORT = "rope_factors_long.weight", "rope_factors_short.weight"
ROPE_TENSORS = frozenset({ROPE_FREQS, ROPE_FACTORS_LONG, ROPE_FACTORS_SHORT})  # config held as tensors, no weights

# The Llama-3.x scaling constants; llama.cpp does not record them, so we assume them and verify (see below).
_LLAMA3_LOW_FREQ_FACTOR = 1.0
_LLAMA3_HIGH_FREQ_FACTOR = 4.0
_LLAMA3_ORIGINAL_CONTEXT = 8192


def convert_gguf_to_hf(
    gguf_path: str | os.PathLike,
    out_dir: str | os.PathLike,
    dtype: str = "float32",
    write_weights: WeightWriter | None = None,
) -> pathlib.Path:
    """Write the HF folder of a GGUF file of a family read here: its description, and its weights where
    ``write_weights`` writes them (:func:`conveyor.model.weights.gguf_export.export_gguf_to_hf`).

    Writes config.json, tokenizer files (tokenizer.json, tokenizer_config.json with the chat template, special
    tokens) and generation_config.json; a folder without weights records the file's storage types
    (``quantization_config``). Everything is written to a temporary sibling folder first and renamed into place,
    so a crash never leaves a half-written ``out_dir``. ``out_dir`` must not exist yet, or be an empty folder:
    an existing model is never silently overwritten. Returns out_dir.
    """
    src = _existing_file(gguf_path)
    out = pathlib.Path(out_dir)
    if dtype not in FLOAT_BYTES:
        raise ValueError(f"unsupported dtype {dtype!r}; expected one of {sorted(FLOAT_BYTES)}")
    _check_destination(out)

    reader = gguf.GGUFReader(src)
    arch, family = _architecture(reader, src)
    hparams = _hyperparameters(reader, arch)
    config = _build_config(reader, (arch, family), hparams, _tensor_shapes(reader, family), _rope_tensors(reader),
                           dtype)
    if write_weights is None:  # the weights stay in the file, in its formats: say which (ModelConfig.stored_as)
        config["quantization_config"] = _quantization_config(reader, family)

    out.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_partials(out)
    staging = out.parent / f".{out.name}.partial-{uuid.uuid4().hex}"
    staging.mkdir()  # unlike tempfile.mkdtemp this honours the umask, so the final folder gets normal permissions
    try:
        if write_weights is not None:
            write_weights(reader, family, hparams, staging)
        _write_json(staging / "config.json", config)
        _write_json(staging / "generation_config.json", _generation_config(config))
        _save_tokenizer(src, staging, config["max_position_embeddings"], family)
        _move_into_place(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out


# ---------------------------------------------------------------------------------------------------------
# Inputs and metadata


def _existing_file(path: str | os.PathLike) -> pathlib.Path:
    """Fail early with the path in the message; GGUFReader's own error for a missing file is a bare memmap one."""
    src = pathlib.Path(path)
    if not src.is_file():
        raise FileNotFoundError(errno.ENOENT, "GGUF file not found", str(src))
    return src


def _check_destination(out: pathlib.Path) -> None:
    """Refuse to clobber an existing model folder (or a file) before spending time on conversion."""
    if out.exists() and not (out.is_dir() and not any(out.iterdir())):
        raise FileExistsError(errno.EEXIST, "output path already exists and is not an empty folder", str(out))


def _meta(reader: gguf.GGUFReader, key: str, default: Any = None) -> Any:
    """Read one metadata value; float32 values are rounded to their shortest decimal form.

    GGUF stores e.g. rms_norm_eps=1e-5 as float32; widening it naively gives 9.999999747e-06, which is the
    same number to the model but an ugly, surprising config value.
    """
    field = reader.fields.get(key)
    if field is None:
        return default
    value = field.contents()
    if field.types and field.types[0] == gguf.GGUFValueType.FLOAT32:
        value = float(str(np.float32(value)))
    return value


def _architecture(reader: gguf.GGUFReader, src: pathlib.Path) -> tuple[str, Family]:
    """The file's architecture and its family; one no family here reads is refused, naming those read."""
    arch = _meta(reader, "general.architecture")
    try:
        return arch, gguf_family(arch, _meta(reader, f"{arch}.expert_count", 0))
    except ValueError as error:
        raise ValueError(f"{src}: {error}") from None


def _hyperparameters(reader: gguf.GGUFReader, arch: str) -> dict[str, Any]:
    """Collect the shape-defining numbers; they drive both the config and the Q/K un-permutation."""
    hidden = _meta(reader, f"{arch}.embedding_length")
    heads = _meta(reader, f"{arch}.attention.head_count")
    kv_heads = _meta(reader, f"{arch}.attention.head_count_kv", heads)
    head_dim = _meta(reader, f"{arch}.attention.key_length", hidden // heads)
    rope_dim = _meta(reader, f"{arch}.rope.dimension_count", head_dim)
    if rope_dim != head_dim:
        # HF Llama rotates the whole head; a partial rotary model would be silently wrong.
        raise ValueError(f"rope.dimension_count={rope_dim} differs from head_dim={head_dim}; not a Llama layout")
    return {
        "hidden_size": hidden,
        "intermediate_size": _meta(reader, f"{arch}.feed_forward_length"),
        "num_hidden_layers": _meta(reader, f"{arch}.block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
    }


# ---------------------------------------------------------------------------------------------------------
# Tensors


def hf_norm(name: str, values: np.ndarray, family: Family) -> np.ndarray:
    """A tensor's values as HF holds them: a Gemma norm's weight less the 1 llama.cpp added (in float32, as
    transformers' own GGUF reader subtracts it)."""
    if family.gguf_norm_offset and is_norm(name):
        return values - np.float32(family.gguf_norm_offset)
    return values


def rope_heads(name: str, num_heads: int, num_kv_heads: int, family: Family = LLAMA) -> int:
    """The heads whose rows llama.cpp permuted in the tensor of this HF name (0: none): a Q or K projection's
    weight or bias, in a family whose files llama.cpp permutes (Llama's; Qwen and Gemma keep HF's order)."""
    if not family.gguf_permuted_qk:
        return 0
    if name.endswith(("q_proj.weight", "q_proj.bias")):
        return num_heads
    if name.endswith(("k_proj.weight", "k_proj.bias")):
        return num_kv_heads
    return 0


def rope_row_order(rows: int, n_heads: int) -> np.ndarray:
    """The permutation unpermute_rope_rows applies, as row indices: row ``i`` of the result is row ``order[i]``
    of the GGUF tensor (for quantized rows, which are reordered whole)."""
    return unpermute_rope_rows(np.arange(rows), n_heads)


def _tensor_shapes(reader: gguf.GGUFReader, family: Family) -> dict[str, tuple[int, ...]]:
    """Every weight's HF name and shape, without reading its values."""
    return {hf_name(t.name, family): tuple(int(dim) for dim in reversed(t.shape)) for t in reader.tensors
            if t.name not in ROPE_TENSORS}


def _quantization_config(reader: gguf.GGUFReader, family: Family) -> dict[str, str]:
    """The file's storage types: the most common among the layers' projections, and the LM head's (the
    embedding's when tied), as HF's quantization_config records a quantized checkpoint's method."""
    types = {hf_name(t.name, family): t.tensor_type.name for t in reader.tensors if t.name not in ROPE_TENSORS}
    layers = [kind for name, kind in types.items() if name.startswith("model.layers.") and name.endswith("proj.weight")]
    head = types.get("lm_head.weight", types["model.embed_tokens.weight"])
    return {"quant_method": "gguf", "layer_type": max(set(layers), key=layers.count) if layers else head,
            "lm_head_type": head}


def _rope_tensors(reader: gguf.GGUFReader) -> dict[str, np.ndarray]:
    """The tensors the config needs the values of: llama.cpp's Llama-3 frequency divisors, Phi-3's longrope
    factors."""
    return {tensor.name: dequantize(tensor) for tensor in reader.tensors if tensor.name in ROPE_TENSORS}


def dequantize(tensor: gguf.ReaderTensor) -> np.ndarray:
    """Return a writable float32 array in numpy/torch dimension order.

    GGUF lists dimensions innermost-first (ne[0] is the row length), so the numpy shape is the reverse.
    """
    try:
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as exc:
        raise ValueError(f"cannot dequantize {tensor.name}: type {tensor.tensor_type.name} unsupported") from exc
    shape = tuple(int(dim) for dim in reversed(tensor.shape))
    # F32 tensors come back as views of the read-only memmap; torch wants memory it may own.
    return np.array(values, dtype=np.float32, copy=not values.flags.writeable).reshape(shape)


def hf_name(gguf_name: str, family: Family = LLAMA) -> str:
    """Translate a GGUF tensor name to the HF parameter name of ``family``, or fail loudly on unknown weights."""
    base, _, suffix = gguf_name.rpartition(".")
    if suffix not in ("weight", "bias"):
        raise ValueError(f"unexpected GGUF tensor name {gguf_name!r}")
    if base in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[base]}.{suffix}"
    parts, names = base.split("."), layer_names(family)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in names:
        return f"model.layers.{parts[1]}.{names[parts[2]]}.{suffix}"
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in EXPERT_NAMES:
        return f"model.layers.{parts[1]}.{expert_name(family, parts[2])}.{suffix}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no Hugging Face {family.name} equivalent")


def unpermute_rope_rows(values: np.ndarray, n_heads: int) -> np.ndarray:
    """Restore HF's rotate-half row order for a Q or K projection.

    HF Llama rotates the pair (i, i + head_dim/2) inside each head; ggml rotates adjacent pairs (2i, 2i+1).
    llama.cpp's converter therefore reorders each head's rows from [first half | second half] into interleaved
    pairs. Reading the rows as (head, pair, 2) and swapping the last two axes puts the halves back.
    """
    rows = values.shape[0]
    head_dim = rows // n_heads
    grouped = values.reshape(n_heads, head_dim // 2, 2, *values.shape[1:])
    return np.ascontiguousarray(grouped.swapaxes(1, 2)).reshape(values.shape)


# ---------------------------------------------------------------------------------------------------------
# Config files


def _build_config(
    reader: gguf.GGUFReader,
    arch_family: tuple[str, Family],
    hparams: dict[str, Any],
    shapes: dict[str, tuple[int, ...]],
    rope_tensors: dict[str, np.ndarray],
    dtype: str,
) -> dict[str, Any]:
    """Assemble the config dict of the file's family (Llama's keys, and the family's own: gguf_families).

    RoPE goes into ``rope_parameters`` (what transformers 5 reads); ``rope_theta`` is repeated at the top level
    for older readers. ``torch_dtype`` and ``dtype`` are both written for the same reason.
    """
    arch, family = arch_family
    context = _meta(reader, f"{arch}.context_length", 2048)
    theta = _meta(reader, f"{arch}.rope.freq_base", 10000.0)
    vocab = shapes["model.embed_tokens.weight"][0]
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **hparams,
        "hidden_act": "silu",
        "rms_norm_eps": _meta(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5),
        "max_position_embeddings": context,
        "rope_theta": theta,
        "rope_parameters": _rope_parameters(reader, arch, theta, hparams["head_dim"], rope_tensors),
        "vocab_size": _meta(reader, f"{arch}.vocab_size", vocab),
        "tie_word_embeddings": "lm_head.weight" not in shapes,
        "attention_bias": any(name.endswith("q_proj.bias") for name in shapes),
        "mlp_bias": any(name.endswith("up_proj.bias") for name in shapes),
        "torch_dtype": dtype,
        "dtype": dtype,
        "use_cache": True,
    }
    config.update(_special_token_ids(reader))
    config.update(family_config(family, lambda key, default=None: _meta(reader, f"{arch}.{key}", default), hparams,
                                config["rope_parameters"]))
    if "hidden_activation" in config:
        del config["hidden_act"]
    return config


def _rope_parameters(
    reader: gguf.GGUFReader, arch: str, theta: float, head_dim: int, rope_tensors: dict[str, np.ndarray]
) -> dict[str, Any]:
    """Express GGUF's RoPE settings (scaling metadata, or tensors: rope_freqs, Phi-3's longrope factors) as HF
    ``rope_parameters``."""
    if ROPE_FREQS in rope_tensors:
        return _llama3_rope(rope_tensors[ROPE_FREQS], theta, head_dim)
    original = _meta(reader, f"{arch}.rope.scaling.original_context_length")
    if ROPE_FACTORS_LONG in rope_tensors or ROPE_FACTORS_SHORT in rope_tensors:
        return _longrope(reader, arch, theta, original, rope_tensors)
    kind = _meta(reader, f"{arch}.rope.scaling.type", "none")
    factor = _meta(reader, f"{arch}.rope.scaling.factor") or _meta(reader, f"{arch}.rope.scale_linear")
    if kind == "none" and factor and factor != 1.0:
        kind = "linear"  # old files only record rope.scale_linear
    if kind == "none":
        return {"rope_type": "default", "rope_theta": theta}
    if kind == "linear":
        return {"rope_type": "linear", "rope_theta": theta, "factor": factor}
    if kind == "yarn":  # llama.cpp's YaRN is transformers': its band edges rounded out, cos and sin scaled alike
        params = {"rope_type": "yarn", "rope_theta": theta, "factor": factor}
        betas = {"beta_fast": _meta(reader, f"{arch}.rope.scaling.yarn_beta_fast"),
                 "beta_slow": _meta(reader, f"{arch}.rope.scaling.yarn_beta_slow")}
        params |= {key: value for key, value in betas.items() if value is not None}
        return params | ({"original_max_position_embeddings": original} if original else {})
    raise ValueError(f"unsupported RoPE scaling type {kind!r} in GGUF metadata")


def _longrope(reader: gguf.GGUFReader, arch: str, theta: float, original: int | None,
              rope_tensors: dict[str, np.ndarray]) -> dict[str, Any]:
    """Phi-3's longrope as llama.cpp writes it: both sets of factors as tensors, the original context and the
    attention factor (which it computed from them) as metadata."""
    missing = [name for name in (ROPE_FACTORS_LONG, ROPE_FACTORS_SHORT) if name not in rope_tensors]
    if missing or not original:
        absent = missing + ([] if original else [f"{arch}.rope.scaling.original_context_length"])
        raise ValueError(f"GGUF longrope scaling without {' and '.join(absent)}")
    params = {"rope_type": "longrope", "rope_theta": theta,
              "long_factor": rope_tensors[ROPE_FACTORS_LONG].tolist(),
              "short_factor": rope_tensors[ROPE_FACTORS_SHORT].tolist(), "original_max_position_embeddings": original}
    attention_factor = _meta(reader, f"{arch}.rope.scaling.attn_factor")
    return params | ({"attention_factor": attention_factor} if attention_factor is not None else {})


def _llama3_rope(rope_freqs: np.ndarray, theta: float, head_dim: int) -> dict[str, Any]:
    """Recover Llama-3 RoPE scaling from llama.cpp's precomputed frequency divisors.

    Only the scale factor is directly readable (the largest divisor); the band constants are not stored, so we
    assume the published Llama-3.x ones and check that they reproduce the tensor exactly, refusing otherwise
    rather than shipping a model with subtly wrong positions.
    """
    factor = float(rope_freqs.max())
    if factor == 1.0 and np.all(rope_freqs == 1.0):
        return {"rope_type": "default", "rope_theta": theta}
    params = {
        "rope_type": "llama3",
        "rope_theta": theta,
        "factor": factor,
        "low_freq_factor": _LLAMA3_LOW_FREQ_FACTOR,
        "high_freq_factor": _LLAMA3_HIGH_FREQ_FACTOR,
        "original_max_position_embeddings": _LLAMA3_ORIGINAL_CONTEXT,
    }
    expected = _llama3_divisors(params, head_dim)
    if expected.shape != rope_freqs.shape or not np.allclose(expected, rope_freqs, rtol=1e-5, atol=1e-6):
        raise ValueError("rope_freqs tensor does not match Llama-3 RoPE scaling; cannot express it as a HF config")
    return params


def _llama3_divisors(params: dict[str, Any], head_dim: int) -> np.ndarray:
    """Recompute the per-frequency divisors that llama.cpp derives from Llama-3 scaling constants."""
    freqs = 1.0 / params["rope_theta"] ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / freqs
    original, factor = params["original_max_position_embeddings"], params["factor"]
    low, high = params["low_freq_factor"], params["high_freq_factor"]
    smooth = (original / wavelen - low) / (high - low)
    with np.errstate(divide="ignore"):  # out-of-band entries may divide by zero; np.where discards them
        mid = 1.0 / ((1 - smooth) / factor + smooth)
    divisors = np.where(wavelen < original / high, 1.0, np.where(wavelen > original / low, factor, mid))
    return divisors.astype(np.float32)


def _special_token_ids(reader: gguf.GGUFReader) -> dict[str, int]:
    """bos/eos/pad ids from the tokenizer metadata; absent ids are left out rather than guessed."""
    ids = {
        "bos_token_id": _meta(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _meta(reader, "tokenizer.ggml.eos_token_id"),
        "pad_token_id": _meta(reader, "tokenizer.ggml.padding_token_id"),
    }
    return {key: int(value) for key, value in ids.items() if value is not None}


def _generation_config(config: dict[str, Any]) -> dict[str, Any]:
    """Generation defaults only need the special ids, so generate() stops at the chat end token."""
    keys = ("bos_token_id", "eos_token_id", "pad_token_id")
    return {key: config[key] for key in keys if key in config}


def _write_json(path: pathlib.Path, data: dict[str, Any]) -> None:
    """Stable, readable JSON, as HF tooling writes it."""
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


# ---------------------------------------------------------------------------------------------------------
# Tokenizer and final move


def _save_tokenizer(src: pathlib.Path, out: pathlib.Path, max_length: int, family: Family) -> None:
    """Rebuild the tokenizer with transformers' own GGUF converter and save it in plain HF form.

    AutoTokenizer builds the model's config from the file first, which its GGUF reader refuses for an
    architecture it lacks (``Family.hf_reads_gguf``); the tokenizer itself is the file's metadata whatever the
    architecture, so for those it is built by the class AutoTokenizer falls back to, from the same converter.
    The chat template is kept inside tokenizer_config.json (``save_jinja_files=False``) so readers that predate
    chat_template.jinja still find it. Load-time flags that transformers records as init arguments are dropped:
    they describe how we loaded the GGUF, not how the saved folder should be loaded. A file without a chat
    template gets its family's default template where there is one.
    """
    from transformers import AutoTokenizer  # heavy import, only needed here
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    reader = AutoTokenizer if family.hf_reads_gguf else TokenizersBackend
    tokenizer = reader.from_pretrained(str(src.parent), gguf_file=src.name, local_files_only=True)
    if not tokenizer.chat_template:
        # None keeps "no template" explicit, not an empty string
        tokenizer.chat_template = default_chat_template(family)
    tokenizer.model_max_length = max_length
    for key in ("is_local", "local_files_only", "gguf_file"):
        tokenizer.init_kwargs.pop(key, None)
    tokenizer.save_pretrained(str(out), save_jinja_files=False)


STALE_PARTIAL_S = 600.0  # a staging folder is written in seconds; one untouched this long was left by a kill


def _remove_stale_partials(out: pathlib.Path) -> None:
    """Delete staging folders of ``out`` that a killed conversion left behind (a kill skips the cleanup below;
    each can hold a model's worth of bytes). One still being written is newer than STALE_PARTIAL_S: kept."""
    for partial in out.parent.glob(f".{out.name}.partial-*"):
        try:
            newest = max(entry.stat().st_mtime for entry in [partial, *partial.iterdir()])
        except OSError:  # gone meanwhile, or not a folder
            continue
        if time.time() - newest > STALE_PARTIAL_S:
            shutil.rmtree(partial, ignore_errors=True)


def _move_into_place(staging: pathlib.Path, out: pathlib.Path) -> None:
    """Atomically publish the finished folder.

    rename(2) replaces an empty placeholder folder at ``out`` but fails on a non-empty one, so a folder someone
    filled while we were converting is never clobbered.
    """
    os.replace(staging, out)
