"""A GGUF file's weights under Conveyor's names, read straight from the file and kept quantized.

Each tensor is decoded into the uniform quantized form (:mod:`conveyor.model.quant_formats`: codes, a scale
and a min or zero point per group) exactly, without going through float; llama.cpp's rotary row order of Q and
K is undone by reordering whole rows, and Q/K/V and gate/up are joined into the fused projections the model
runs. Norms and biases, which GGUF stores in float, stay float arrays; so does any 2-D weight a file stores in
float (F32, F16, BF16), and a fused projection with such a part is all float.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from conveyor.core.model_config import ModelConfig
from conveyor.model.gguf import hf_name, rope_row_order
from conveyor.model.quant_formats import SUPPORTED_TYPES, QuantizedMatrix, concat_rows, decode, dequantize, permute_rows

FLOAT_TYPES = frozenset({"F32", "F16", "BF16"})

Weight = QuantizedMatrix | np.ndarray


@dataclass(slots=True)
class GgufWeights:
    """Our parameter names (``layers.0.self_attn.qkv_proj.weight``, ``embed_tokens.weight``, ...) to weights:
    quantized matrices, or float32 arrays. ``lm_head.weight`` is absent for a model that ties it to the
    embedding."""

    weights: dict[str, Weight] = field(default_factory=dict)

    def quantized_bytes(self) -> int:
        """What the quantized matrices' codes and scales take once packed (the model's resident weights)."""
        total = 0
        for weight in self.weights.values():
            if isinstance(weight, QuantizedMatrix):
                codes = weight.q.size * (4 if weight.storage_bits == 4 else 8) // 8
                total += codes + weight.scales.nbytes + (0 if weight.mins is None else weight.mins.nbytes)
        return total


def read_gguf_weights(path: Path, config: ModelConfig, convert: Callable[[Weight], Any] | None = None) -> GgufWeights:
    """Every weight of the GGUF file at ``path``, fused and renamed for ``config``'s model; each passed through
    ``convert`` as soon as it is read (the loader packs it there), so that only one weight at a time is held
    decoded (a decoded code takes a byte, twice a 4-bit one's packed size)."""
    reader = gguf.GGUFReader(path)
    try:
        tensors = {hf_name(t.name).removeprefix("model."): t for t in reader.tensors if t.name != "rope_freqs.weight"}
        with path.open("rb") as file:
            weights = _our_names(lambda name: _read_tensor(tensors[name], file.fileno()), set(tensors), config,
                                 convert or _same)
    finally:
        del reader  # the file's memory map goes with it: the weights are copies, not views of it
    return GgufWeights(weights)


def _same(weight: Weight) -> Weight:
    return weight


def _read_tensor(tensor: gguf.ReaderTensor, fd: int) -> Weight:
    """One tensor decoded: quantized as it is, or float32 for the float types. Its bytes are read from the file
    (pread), not through the reader's memory map: pages touched through a map count as the process's resident
    memory for as long as the map lives, so a load through it peaked a whole file above what it keeps."""
    n_k = [int(dim) for dim in reversed(tensor.shape)]
    kind = tensor.tensor_type.name
    raw = np.frombuffer(os.pread(fd, int(tensor.n_bytes), int(tensor.data_offset)), dtype=np.uint8)
    if kind in FLOAT_TYPES:
        values = gguf.quants.dequantize(raw.view(tensor.data.dtype), tensor.tensor_type)
        return np.array(values, dtype=np.float32).reshape(n_k)
    if kind not in SUPPORTED_TYPES:
        raise ValueError(f"{tensor.name}: GGUF type {kind} is not supported (supported: "
                         f"{', '.join(sorted(SUPPORTED_TYPES | FLOAT_TYPES))})")
    if len(n_k) != 2:
        raise ValueError(f"{tensor.name}: a quantized tensor of {len(n_k)} dimensions")
    return decode(raw, kind, n_k[0], n_k[1])


def _our_names(read: Callable[[str], Weight], names: set[str], config: ModelConfig,
               convert: Callable[[Weight], Any]) -> dict[str, Any]:
    """HF names (without ``model.``) -> ours, with rotary rows restored and the fused projections joined
    (loader._our_state_dict's names, on quantized weights); each weight read when it is needed."""
    hf = _Reads(read, names)
    ours: dict[str, Any] = {"embed_tokens.weight": convert(hf["embed_tokens.weight"]), "norm.weight": hf["norm.weight"]}
    if not config.tie_word_embeddings:
        ours["lm_head.weight"] = convert(hf["lm_head.weight"])
    for i in range(config.num_layers):
        attn, mlp = f"layers.{i}.self_attn.", f"layers.{i}.mlp."
        q = _rope_rows(hf[attn + "q_proj.weight"], config.num_heads)
        k = _rope_rows(hf[attn + "k_proj.weight"], config.num_kv_heads)
        ours[attn + "qkv_proj.weight"] = convert(join_rows([q, k, hf[attn + "v_proj.weight"]]))
        del q, k
        ours[attn + "o_proj.weight"] = convert(hf[attn + "o_proj.weight"])
        gate_up = join_rows([hf[mlp + "gate_proj.weight"], hf[mlp + "up_proj.weight"]])
        ours[mlp + "gate_up_proj.weight"] = convert(gate_up)
        del gate_up
        ours[mlp + "down_proj.weight"] = convert(hf[mlp + "down_proj.weight"])
        if config.attention_bias:
            biases = [hf[attn + "q_proj.bias"], hf[attn + "k_proj.bias"], hf[attn + "v_proj.bias"]]
            biases[0] = _rope_rows(biases[0], config.num_heads)
            biases[1] = _rope_rows(biases[1], config.num_kv_heads)
            ours[attn + "qkv_proj.bias"] = np.concatenate(biases)
        if config.mlp_bias:
            ours[mlp + "gate_up_proj.bias"] = np.concatenate([hf[mlp + "gate_proj.bias"], hf[mlp + "up_proj.bias"]])
            ours[mlp + "down_proj.bias"] = hf[mlp + "down_proj.bias"]
        for norm in ("input_layernorm", "post_attention_layernorm"):
            ours[f"layers.{i}.{norm}.weight"] = hf[f"layers.{i}.{norm}.weight"]
    return ours


class _Reads:
    """A GGUF file's tensors by HF name, each read (decoded) when looked up; a missing one named as the file's."""

    def __init__(self, read: Callable[[str], Weight], names: set[str]) -> None:
        self._read, self._names = read, names

    def __getitem__(self, name: str) -> Weight:
        if name not in self._names:
            raise ValueError(f"the GGUF file has no tensor for {name} (its config needs one)")
        return self._read(name)


def _rope_rows(weight: Weight, heads: int) -> Weight:
    """Undo llama.cpp's rotary row permutation: whole rows move, so quantized rows are reordered exactly."""
    order = rope_row_order(weight.shape[0] if isinstance(weight, np.ndarray) else weight.n, heads)
    return permute_rows(weight, order) if isinstance(weight, QuantizedMatrix) else weight[order]


def join_rows(parts: list[Weight]) -> Weight:
    """Parts stacked along the outputs: quantized where every part is and their groups agree, else float32."""
    if all(isinstance(part, QuantizedMatrix) for part in parts):
        try:
            return concat_rows(parts)
        except ValueError:  # groups that differ (Q6_K's 16 beside 32): no one quantized form holds both
            pass
    return np.concatenate([as_float(part) for part in parts])


def as_float(weight: Weight) -> np.ndarray:
    return dequantize(weight) if isinstance(weight, QuantizedMatrix) else weight
