"""A GGUF file's weights under Conveyor's names, read straight from the file and kept quantized.

The K-quants stay the file's blocks (:mod:`conveyor.model.quant.k_quants`); the other block formats are decoded into
the uniform quantized form (:mod:`conveyor.model.quant.formats`: codes, a scale and a min or zero point per
group) exactly, without going through float. llama.cpp's rotary row order of Q and K is undone by reordering
whole rows, and Q/K/V and gate/up are joined into the fused projections the model runs: parts of one form as
one matrix, parts of different types (a Q4_K_M file's Q6_K values beside Q4_K queries) side by side, each kept
in its own. Norms and biases, which GGUF stores in float, stay float arrays; so does any 2-D weight a file
stores in float (F32, F16, BF16), and a fused projection with such a part is all float.
"""

from __future__ import annotations

import mmap
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import gguf
import numpy as np

from conveyor.core.model_config import ModelConfig
from conveyor.model.families import Family, family_for
from conveyor.model.layers import checkpoint_projections
from conveyor.model.quant.formats import SUPPORTED_TYPES, QuantizedMatrix, concat_rows, decode, dequantize, permute_rows
from conveyor.model.quant.k_quants import K_TYPES, JoinedRows, RawBlocks, concat_blocks
from conveyor.model.weights.gguf import ROPE_TENSORS, hf_name, hf_norm, rope_heads, rope_row_order

FLOAT_TYPES = frozenset({"F32", "F16", "BF16"})

Weight = QuantizedMatrix | RawBlocks | JoinedRows | np.ndarray


@dataclass(frozen=True, slots=True)
class ExpertWeights:
    """A mixture of experts' stacked projection, one weight per expert in expert order: a GGUF file's 3-D tensor
    with each expert's matrix kept as the file stores it (or as ``convert`` made it), so that quantized experts
    stay quantized and a step reads only the experts its rows chose."""

    experts: tuple[Any, ...]


def read_gguf_weights(path: Path, config: ModelConfig,
                      convert: Callable[[Weight], Any] | None = None) -> dict[str, Any]:
    """Every weight of the GGUF file at ``path`` under our parameter names (``layers.0.self_attn.qkv_proj.weight``,
    ``embed_tokens.weight``, ...; no ``lm_head.weight`` for a model that ties it to the embedding): quantized
    matrices, or float32 arrays. Each passes through ``convert`` as soon as it is read (the loader packs it
    there), so that only one weight at a time is held decoded (a decoded code takes a byte, twice a 4-bit one's
    packed size)."""
    family = family_for(config)
    tensors = {hf_name(t.name, family).removeprefix("model."): t for t in tensor_index(path)
               if t.name not in ROPE_TENSORS}
    with path.open("rb") as file:
        return _our_names(lambda name: _read_tensor(tensors[name], file.fileno()), set(tensors), config,
                          convert or _same)


class TensorEntry(NamedTuple):
    """Where one tensor lies in a GGUF file: numpy shape (outermost first), type name, absolute offset, bytes."""

    name: str
    shape: tuple[int, ...]
    type_name: str
    offset: int
    n_bytes: int


# GGUF's metadata value types: struct formats of the fixed-size ones; 8 is a string, 9 an array.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


def tensor_index(path: Path) -> list[TensorEntry]:
    """The GGUF file's tensor directory, read from its header without the metadata's values (gguf's own reader
    builds an array per token string: 156 MB resident for the default model's 98 MB file, at the load's peak)."""
    with path.open("rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as view:
        magic, version, n_tensors, n_kv = struct.unpack_from("<4sIQQ", view, 0)
        if magic != b"GGUF" or version < 2:
            raise ValueError(f"{path}: not a GGUF file of version 2 or later")
        at, alignment = 24, 32
        for _ in range(n_kv):
            key, at = _string(view, at)
            (kind,), at = struct.unpack_from("<I", view, at), at + 4
            if key == "general.alignment":
                alignment = struct.unpack_from("<I", view, at)[0]
            at = _skip_value(view, at, kind)
        entries = []
        for _ in range(n_tensors):
            name, at = _string(view, at)
            (dims,), at = struct.unpack_from("<I", view, at), at + 4
            ne = struct.unpack_from(f"<{dims}Q", view, at)
            at += 8 * dims
            kind, offset = struct.unpack_from("<IQ", view, at)
            at += 12
            entries.append((name, ne, kind, offset))
        data_start = -(-at // alignment) * alignment
    return [_entry(name, ne, kind, data_start + offset) for name, ne, kind, offset in entries]


def _string(view: mmap.mmap, at: int) -> tuple[str, int]:
    (length,) = struct.unpack_from("<Q", view, at)
    return view[at + 8:at + 8 + length].decode("utf-8"), at + 8 + length


def _skip_value(view: mmap.mmap, at: int, kind: int) -> int:
    """The offset past a metadata value of type ``kind`` at ``at``."""
    if kind in _SCALARS:
        return at + struct.calcsize(_SCALARS[kind])
    if kind == _STRING:
        return at + 8 + struct.unpack_from("<Q", view, at)[0]
    if kind == _ARRAY:
        item, count = struct.unpack_from("<IQ", view, at)
        at += 12
        if item in _SCALARS:
            return at + count * struct.calcsize(_SCALARS[item])
        for _ in range(count):
            at = _skip_value(view, at, item)
        return at
    raise ValueError(f"unknown GGUF metadata value type {kind}")


def _entry(name: str, ne: tuple[int, ...], kind: int, offset: int) -> TensorEntry:
    quant = gguf.GGMLQuantizationType(kind)
    block, type_size = gguf.GGML_QUANT_SIZES[quant]
    count = 1
    for dim in ne:
        count *= dim
    return TensorEntry(name, tuple(reversed(ne)), quant.name, offset, count // block * type_size)


def _same(weight: Weight) -> Weight:
    return weight


def _read_tensor(tensor: TensorEntry, fd: int) -> Weight:
    """One tensor decoded: quantized as it is, or float32 for the float types. Its bytes are read from the file
    (pread), not through a memory map: pages touched through a map count as the process's resident memory for
    as long as the map lives, so a load through one peaked a whole file above what it keeps."""
    n_k = list(tensor.shape)
    kind = tensor.type_name
    raw = np.frombuffer(os.pread(fd, tensor.n_bytes, tensor.offset), dtype=np.uint8)
    if kind in FLOAT_TYPES:
        element = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}[kind]
        values = gguf.quants.dequantize(raw.view(element), gguf.GGMLQuantizationType[kind])
        return np.array(values, dtype=np.float32).reshape(n_k)
    if kind not in SUPPORTED_TYPES:
        raise ValueError(f"{tensor.name}: GGUF type {kind} is not supported (supported: "
                         f"{', '.join(sorted(SUPPORTED_TYPES | FLOAT_TYPES))})")
    if len(n_k) == 3:  # a mixture of experts' stacked projection: expert-major, each expert's rows contiguous
        experts, rows, cols = n_k
        size = tensor.n_bytes // experts
        return ExpertWeights(tuple(_matrix(raw[e * size:(e + 1) * size], kind, rows, cols) for e in range(experts)))
    if len(n_k) != 2:
        raise ValueError(f"{tensor.name}: a quantized tensor of {len(n_k)} dimensions")
    return _matrix(raw, kind, n_k[0], n_k[1])


def _matrix(raw: np.ndarray, kind: str, n: int, k: int) -> Weight:
    """A quantized matrix [n, k] from its bytes: a K-quant's blocks as they are, other formats decoded."""
    return RawBlocks.from_file(raw, kind, n, k) if kind in K_TYPES else decode(raw, kind, n, k)


def _our_names(read: Callable[[str], Weight], names: set[str], config: ModelConfig,
               convert: Callable[[Weight], Any]) -> dict[str, Any]:
    """HF names (without ``model.``) -> ours, with rotary rows restored and the fused projections joined
    (loader._our_state_dict's names, on quantized weights); each weight read when it is needed."""
    family = family_for(config)
    hf = _Reads(read, names, family)
    ours: dict[str, Any] = {"embed_tokens.weight": convert(hf["embed_tokens.weight"]), "norm.weight": hf["norm.weight"]}
    if not config.tie_word_embeddings:
        ours["lm_head.weight"] = convert(hf["lm_head.weight"])
    def restored(name: str) -> Weight:  # a tensor read, in HF's rotary row order
        return _rope_rows(hf[name], rope_heads(name, config.num_heads, config.num_kv_heads, family))

    for i in range(config.num_layers):
        p = f"layers.{i}."
        if config.layer_has_experts(i):
            ours.update(_experts(hf, p, family, convert))
        for fused, parts in checkpoint_projections(family).items():
            if fused.startswith("mlp.") and config.layer_has_experts(i):
                continue
            read = [restored(f"{p}{part}.weight") for part in parts]
            ours[f"{p}{fused}.weight"] = convert(join_rows(read) if len(read) > 1 else read[0])
            del read  # the next projection's parts are decoded only once these are packed
            if f"{p}{parts[0]}.bias" in hf:
                ours[f"{p}{fused}.bias"] = np.concatenate([restored(f"{p}{part}.bias") for part in parts])
        for norm in family_for(config).layer_norms:
            ours[f"{p}{norm}.weight"] = hf[f"{p}{norm}.weight"]
    return ours


def _experts(hf: _Reads, layer: str, family: Family, convert: Callable[[Weight], Any]) -> dict[str, Any]:
    """A mixture of experts' router and projections as SparseMoE holds them: the router, every expert's gate and
    up joined [2 x width, hidden] and its down, each expert's passed through ``convert`` as soon as it is made."""
    block = f"{layer}{family.moe_block}."
    gate, up, down = (_per_expert(hf[f"{block}experts.{name}.weight"]) for name in family.expert_projections)
    return {f"{layer}mlp.router.weight": convert(hf[f"{block}gate.weight"]),
            f"{layer}mlp.gate_up_proj.weight": ExpertWeights(tuple(convert(join_rows([g, u]))
                                                                   for g, u in zip(gate, up, strict=True))),
            f"{layer}mlp.down_proj.weight": ExpertWeights(tuple(convert(d) for d in down))}


def _per_expert(weight: ExpertWeights | np.ndarray) -> tuple[Weight, ...]:
    """A stacked projection's experts: a float file's [experts, out, in] array by its first axis."""
    return tuple(weight) if isinstance(weight, np.ndarray) else weight.experts


class _Reads:
    """A GGUF file's tensors by HF name, each read (decoded) when looked up, a norm's as HF holds it (gguf.hf_norm);
    a missing one named as the file's."""

    def __init__(self, read: Callable[[str], Weight], names: set[str], family: Family) -> None:
        self._read, self._names, self._family = read, names, family

    def __contains__(self, name: str) -> bool:
        return name in self._names

    def __getitem__(self, name: str) -> Weight:
        if name not in self._names:
            raise ValueError(f"the GGUF file has no tensor for {name} (its config needs one)")
        weight = self._read(name)
        return hf_norm(name, weight, self._family) if isinstance(weight, np.ndarray) else weight


def _rope_rows(weight: Weight, heads: int) -> Weight:
    """Undo llama.cpp's rotary row permutation (heads 0: a tensor it did not permute): whole rows move, so quantized
    rows are reordered exactly."""
    if heads == 0:
        return weight
    order = rope_row_order(weight.shape[0] if isinstance(weight, np.ndarray) else weight.n, heads)
    if isinstance(weight, QuantizedMatrix):
        return permute_rows(weight, order)
    return weight.permute_rows(order) if isinstance(weight, RawBlocks) else weight[order]


def join_rows(parts: list[Weight]) -> Weight:
    """Parts stacked along the outputs: float32 if some part is float; else one matrix where the parts share a
    form (one K type, or uniform forms with one group), or the parts side by side, each in its own."""
    if any(isinstance(part, np.ndarray) for part in parts):
        return np.concatenate([as_float(part) for part in parts])
    if all(isinstance(part, RawBlocks) for part in parts) and len({part.type_name for part in parts}) == 1:
        return concat_blocks(parts)
    if all(isinstance(part, QuantizedMatrix) for part in parts):
        try:
            return concat_rows(parts)
        except ValueError:  # groups that differ (Q6_K's 16 beside 32): no one uniform form holds both
            pass
    return JoinedRows(tuple(parts))


def as_float(weight: Weight | ExpertWeights) -> np.ndarray:
    """The float32 weights of any form (the PyTorch path's, exact: see quant_formats.dequantize); a mixture's
    experts stacked [experts, out, in]."""
    if isinstance(weight, ExpertWeights):
        return np.stack([as_float(expert) for expert in weight.experts])
    if isinstance(weight, JoinedRows):
        return np.concatenate([as_float(part) for part in weight.parts])
    if isinstance(weight, RawBlocks):
        return dequantize(weight.decoded())
    return dequantize(weight) if isinstance(weight, QuantizedMatrix) else weight
