"""A GGUF file as a whole HF folder: its description (:mod:`conveyor.model.weights.gguf`) and every tensor
dequantized into ``model.safetensors``, llama.cpp's row order and norm offsets undone. What ``conveyor
export-hf`` hands other engines, and the float32 reference the tests compare with transformers on."""

from __future__ import annotations

import os
import pathlib
from typing import Any

import gguf
import torch
from safetensors.torch import save_file

from conveyor.model.dtypes import DTYPES
from conveyor.model.families import Family
from conveyor.model.weights.gguf import (
    ROPE_TENSORS,
    convert_gguf_to_hf,
    dequantize,
    hf_name,
    hf_norm,
    rope_heads,
    unpermute_rope_rows,
)


def export_gguf_to_hf(gguf_path: str | os.PathLike, out_dir: str | os.PathLike,
                      dtype: str = "float32") -> pathlib.Path:
    """The HF folder of a GGUF file, its weights dequantized to ``dtype`` (see convert_gguf_to_hf)."""
    if dtype not in DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; expected one of {sorted(DTYPES)}")

    def write_weights(reader: gguf.GGUFReader, family: Family, hparams: dict[str, Any],
                      folder: pathlib.Path) -> None:
        tensors = float_tensors(reader, family, hparams, DTYPES[dtype])
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})

    return convert_gguf_to_hf(gguf_path, out_dir, dtype, write_weights)


def float_tensors(reader: gguf.GGUFReader, family: Family, hparams: dict[str, Any],
                  dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every weight dequantized, under its HF name and in HF's layout (the rope tensors are config, not weights)."""
    tensors: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        if tensor.name in ROPE_TENSORS:
            continue
        values = dequantize(tensor)
        name = hf_name(tensor.name, family)
        heads = rope_heads(name, hparams["num_attention_heads"], hparams["num_key_value_heads"], family)
        if heads:
            values = unpermute_rope_rows(values, heads)
        if values.ndim == 3:  # a mixture of experts' stacked projection: one tensor per expert, as HF holds them
            block, _, projection = name.rpartition(".experts.")
            for expert, matrix in enumerate(values):
                tensors[f"{block}.experts.{expert}.{projection}"] = torch.from_numpy(matrix).to(dtype).contiguous()
            continue
        tensors[name] = torch.from_numpy(hf_norm(name, values, family)).to(dtype).contiguous()
    return tensors
