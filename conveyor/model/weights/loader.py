"""Loading a model's weights into :class:`Decoder`.

A model folder (:func:`conveyor.model.weights.paths.resolve_model`) holds its weights as safetensors, or stands for a
GGUF file whose weights are read from the file itself and kept quantized (on the native kernels).
``float32_folder`` dequantizes a GGUF file into a full HF folder instead (cached too): what ``conveyor
export-hf`` hands other engines, and the float32 reference the tests compare with transformers on.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from types import ModuleType

import numpy as np
import torch
from safetensors import safe_open

from conveyor.core.model_config import ModelConfig
from conveyor.model.decoder import LAYER_PROJECTIONS, Decoder, Linear
from conveyor.model.families import family_for
from conveyor.model.layers import SparseMoE, checkpoint_projections
from conveyor.model.weights.gguf_export import export_gguf_to_hf
from conveyor.model.weights.paths import cached_conversion, gguf_source, model_source

logger = logging.getLogger("conveyor")

def float32_folder(model: str | os.PathLike | None) -> Path:
    """A HF folder with float32 weights for ``model``: a HF folder as it is, a GGUF file dequantized (once)."""
    path = model_source(model)
    if path.is_dir():
        return path
    return cached_conversion(path, "-float32", export_gguf_to_hf)


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
    """HF parameter names -> ours, fusing q/k/v and gate/up into one matrix each (unless the family's checkpoints
    store them fused)."""
    hf = {name.removeprefix("model."): t for name, t in hf.items()}
    family = family_for(config)
    projections = checkpoint_projections(family)
    state = {"embed_tokens.weight": hf["embed_tokens.weight"], "norm.weight": hf["norm.weight"]}
    state["lm_head.weight"] = hf["embed_tokens.weight"] if config.tie_word_embeddings else hf["lm_head.weight"]
    for i in range(config.num_layers):
        p = f"layers.{i}."
        for ours, parts in projections.items():
            if ours.startswith("mlp.") and config.layer_has_experts(i):
                continue
            state[f"{p}{ours}.weight"] = torch.cat([hf[f"{p}{part}.weight"] for part in parts])
            if f"{p}{parts[0]}.bias" in hf:
                state[f"{p}{ours}.bias"] = torch.cat([hf[f"{p}{part}.bias"] for part in parts])
        if config.layer_has_experts(i):
            state.update(_experts_state(hf, f"{p}{family.moe_block}.", family.expert_projections,
                                        config.num_experts, f"{p}mlp."))
        for norm in family.layer_norms:
            state[f"{p}{norm}.weight"] = hf[f"{p}{norm}.weight"]
    return state


def _experts_state(hf: dict[str, torch.Tensor], block: str, names: tuple[str, str, str], num_experts: int,
                   ours: str) -> dict[str, torch.Tensor]:
    """A mixture of experts' checkpoint tensors (the router ``BLOCK.gate``, each expert's gate, up and down under
    ``BLOCK.experts.E.``) as SparseMoE holds them: the router, and every expert's gate+up and down stacked."""
    gate, up, down = names
    expert = [f"{block}experts.{e}." for e in range(num_experts)]
    return {
        f"{ours}router.weight": hf[f"{block}gate.weight"],
        f"{ours}gate_up_proj.weight": torch.stack([torch.cat([hf[f"{e}{gate}.weight"], hf[f"{e}{up}.weight"]])
                                                   for e in expert]),
        f"{ours}down_proj.weight": torch.stack([hf[f"{e}{down}.weight"] for e in expert]),
    }


def load_model(folder: Path, dtype: torch.dtype, device: torch.device, max_positions: int,
               quantized_kernels: ModuleType | None = None, quantization: str | None = None) -> Decoder:
    """The model of ``folder`` in ``dtype`` on ``device``. A GGUF file's weights stay quantized where
    ``quantized_kernels`` (the native kernels) are given; without them they are dequantized into ``dtype`` as
    they load (the PyTorch reference path: float32 is 5.5 times a Q4_1 file's size). ``quantization`` (int8,
    int4) quantizes a float checkpoint's weights as they load, for those kernels."""
    config = ModelConfig.from_folder(folder)
    source = gguf_source(folder)
    if quantization is not None:
        if source is not None:
            raise ValueError(f"quantization: {source.name}'s weights are quantized already, in the file's own "
                             "formats (they run as they are); --quantization is for float checkpoints")
        if quantized_kernels is None:
            raise ValueError("quantization: quantized weights run on the native kernels, which this start does "
                             "not use (--kernels torch, a dtype other than float32, or no C++ compiler)")
        weights = _quantized_checkpoint(folder, config, quantization, quantized_kernels)
        return _quantized_model(weights, folder.name, config, max_positions, quantized_kernels)
    if source is not None and quantized_kernels is not None:
        weights = _packed_gguf(source, config, quantized_kernels)
        return _quantized_model(weights, source.name, config, max_positions, quantized_kernels)
    with torch.device("meta"):
        model = Decoder(config, max_positions)
    _to_empty(model, device)
    model.build_rotary(max_positions, device)
    state = _gguf_state_dict(source, config) if source is not None else _our_state_dict(_read_safetensors(folder),
                                                                                        config)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"model: weights in {folder} do not fit its config: missing {missing}, extra {unexpected}")
    model.to(dtype=dtype)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    return model.eval().requires_grad_(False)


def _gguf_state_dict(source: Path, config: ModelConfig) -> dict[str, torch.Tensor]:
    """A GGUF file's weights dequantized to float32 under our names (the PyTorch path's)."""
    from conveyor.model.weights.gguf_weights import as_float, read_gguf_weights

    weights = read_gguf_weights(source, config)
    state = {name: torch.from_numpy(np.ascontiguousarray(as_float(weight))) for name, weight in weights.items()}
    if config.tie_word_embeddings:
        state["lm_head.weight"] = state["embed_tokens.weight"]
    return state


# A weight as _quantized_model takes it: packed for the kernels with its format's name, or float32.
Packed = tuple[object, str] | np.ndarray


def _packed_gguf(source: Path, config: ModelConfig, kernels: ModuleType) -> dict[str, Packed]:
    """A GGUF file's weights under our names, each quantized one packed as soon as it is read."""
    from conveyor.model.quant.linear import WeightArena, native_weight
    from conveyor.model.weights.gguf_weights import Weight, read_gguf_weights

    arena = WeightArena(kernels)

    def packed(weight: Weight) -> Packed:
        return weight if isinstance(weight, np.ndarray) else (native_weight(kernels, weight, arena), weight.source)

    return read_gguf_weights(source, config, packed)


def _quantized_checkpoint(folder: Path, config: ModelConfig, scheme: str, kernels: ModuleType) -> dict[str, Packed]:
    """A float checkpoint's weights under our names, the projections quantized by ``scheme`` and the embedding
    and LM head by int8 (a 4-bit vocabulary table costs the most accuracy for the least memory, the choice
    llama.cpp's Q4 files and OpenVINO's int4 export make too); norms and biases float32."""
    from conveyor.model.quant.formats import quantize_matrix
    from conveyor.model.quant.linear import WeightArena, native_weight
    from conveyor.model.weights.gguf_weights import ExpertWeights

    arena = WeightArena(kernels)
    state = _our_state_dict(_read_safetensors(folder), config)
    if config.tie_word_embeddings:
        del state["lm_head.weight"]  # the embedding's own tensor: _quantized_model ties them again
    weights: dict[str, Packed] = {}
    for name in list(state):
        values = state.pop(name).float().numpy()
        if name.endswith("_proj.weight") or name in ("embed_tokens.weight", "lm_head.weight"):
            kind = scheme if name.endswith("_proj.weight") else "int8"
            if values.ndim == 3:  # a mixture's experts: each quantized on its own
                weights[name] = ExpertWeights(tuple((native_weight(kernels, quantize_matrix(m, kind), arena), kind)
                                                    for m in values))
            else:
                weights[name] = (native_weight(kernels, quantize_matrix(values, kind), arena), kind)
        else:
            weights[name] = values
    return weights


def _to_empty(model: torch.nn.Module, device: str | torch.device) -> None:
    """``model.to_empty(device=device)``: every parameter and buffer replaced by uninitialised memory of its shape
    and dtype. Written out because torch's own takes ``empty_like`` of a meta tensor through its reference
    implementations, whose first use imports sympy: a quarter of a second of every server's start."""
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None:
                empty = torch.empty(param.shape, dtype=param.dtype, device=device)
                module._parameters[name] = torch.nn.Parameter(empty, requires_grad=param.requires_grad)
        for name, buffer in module._buffers.items():
            if buffer is not None:
                module._buffers[name] = torch.empty(buffer.shape, dtype=buffer.dtype, device=device)


def _quantized_model(weights: dict[str, Packed], source: str, config: ModelConfig, max_positions: int,
                     kernels: ModuleType) -> Decoder:
    """The model with every quantized weight kept as the kernels' QuantizedWeight; float ones (norms, biases, a
    projection a file stores in float) as float32 tensors. ``source`` names where the weights came from."""
    from conveyor.model.quant.linear import QuantizedEmbedding, QuantizedLinear

    with torch.device("meta"):
        model = Decoder(config, max_positions)

    def linear(name: str, bias_name: str | None = None) -> torch.nn.Module:
        """The projection ``name``: quantized, or a plain Linear. Float tensors (a plain weight, a bias) stay in
        ``weights`` and are loaded with the norms below, after ``_to_empty``, which would clear them here."""
        weight = weights[name]
        bias = weights.get(bias_name) if bias_name else None
        bias_t = None if bias is None else torch.from_numpy(bias)
        if isinstance(weight, tuple):
            del weights[name]
            native, kind = weight
            return QuantizedLinear(kernels, native, bias_t, kind)
        return Linear(weight.shape[1], weight.shape[0], bias=bias_t is not None, device="meta")

    for i, layer in enumerate(model.layers):
        moe = isinstance(layer.mlp, SparseMoE)
        for ours in LAYER_PROJECTIONS:  # "self_attn.qkv_proj": the module's parent and its attribute
            if moe and ours.startswith("mlp."):
                continue
            parent, attribute = ours.split(".")
            setattr(getattr(layer, parent), attribute, linear(f"layers.{i}.{ours}.weight", f"layers.{i}.{ours}.bias"))
        if moe:
            _set_experts(layer.mlp, weights, f"layers.{i}.mlp.", linear)
    embedding = weights.pop("embed_tokens.weight")
    if not isinstance(embedding, tuple):
        raise ValueError(f"{source}: the token embedding is stored in float; only quantized embeddings are read "
                         "kept quantized (convert it with `conveyor export-hf`, or pass --kernels torch)")
    native_embedding, embedding_type = embedding
    model.embed_tokens = QuantizedEmbedding(kernels, native_embedding)
    if config.tie_word_embeddings:
        model.lm_head = QuantizedLinear(kernels, native_embedding, None, embedding_type)
    else:
        model.lm_head = linear("lm_head.weight")
    _to_empty(model, "cpu")  # what is left on meta: norms (loaded below) and the rotary tables
    model.build_rotary(max_positions, "cpu")
    state = {name: torch.from_numpy(np.ascontiguousarray(weight)) for name, weight in weights.items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [name for name in missing if name != "embed_tokens.weight"]  # QuantizedEmbedding's empty placeholder
    if missing or unexpected:
        raise ValueError(f"model: weights in {source} do not fit its config: missing {missing}, extra {unexpected}")
    logger.info("model: %s kept quantized (%s)", source, ", ".join(sorted(quantized_kinds(model))))
    return model.eval().requires_grad_(False)


def _set_experts(moe: SparseMoE, weights: dict[str, object], prefix: str, linear: object) -> None:
    """A mixture of experts' router (``linear``: quantized, or a plain Linear) and projections: each expert kept
    quantized, or (a file that stores them in float) stacked into ``weights`` to load with the norms."""
    from conveyor.model.quant.linear import QuantizedExperts

    moe.router = linear(f"{prefix}router.weight")
    for name in ("gate_up_proj", "down_proj"):
        key = f"{prefix}{name}.weight"
        experts = weights[key].experts
        if isinstance(experts[0], tuple):
            del weights[key]
            kinds = sorted({kind for _, kind in experts})
            setattr(moe, name, QuantizedExperts([native for native, _ in experts], "+".join(kinds)))
        else:
            weights[key] = np.stack(experts)


def quantized_kinds(model: Decoder) -> set[str]:
    """The GGUF types a model's quantized projections came from (a fused projection's parts may differ: Gemma's
    Q5_0 queries beside Q8_0 keys and values come as "Q5_0+Q8_0")."""
    from conveyor.model.quant.linear import QuantizedExperts, QuantizedLinear

    return {kind for module in model.modules() if isinstance(module, QuantizedLinear | QuantizedExperts)
            for kind in module.source.split("+")}
