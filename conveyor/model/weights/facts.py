"""What a model's files say of it (:class:`~conveyor.core.model_facts.ModelFacts`), read without loading it: a
GGUF file's metadata and tensor shapes, or a folder's config.json and safetensors headers.

For an API's listing of models. Slow once per file only where the file is large: parsing a GGUF file's metadata
takes a second or more (its tokenizer's arrays), and its digest is the whole file hashed, once, then remembered
(:func:`conveyor.model.weights.paths.file_digest`). Imports no torch.
"""

from __future__ import annotations

import json
import math
import os
from collections import Counter
from pathlib import Path
from typing import Any

import gguf
from safetensors import safe_open

from conveyor.core.model_facts import ModelFacts
from conveyor.model.weights.paths import file_digest, model_source, weight_files


def describe_model(model: str | os.PathLike | None) -> ModelFacts:
    """The facts of what ``--model`` names (None: the default model)."""
    source = model_source(model)
    files = weight_files(source)
    on_disk = {"size_bytes": sum(f.stat().st_size for f in files),
               "modified_at": max((f.stat().st_mtime for f in files), default=None)}
    return _gguf_facts(source, on_disk) if source.is_file() else _folder_facts(source, files, on_disk)


def _gguf_facts(path: Path, on_disk: dict[str, Any]) -> ModelFacts:
    reader = gguf.GGUFReader(path)

    def meta(key: str) -> Any:
        field = reader.fields.get(key)
        return None if field is None else field.contents()

    family = meta("general.architecture") or ""
    context = meta(f"{family}.context_length")
    return ModelFacts(format="gguf", family=family, parameter_count=sum(int(t.n_elements) for t in reader.tensors),
                      quantization=_file_type_name(meta("general.file_type")),
                      context_length=None if context is None else int(context), digest=file_digest(path), **on_disk)


def _file_type_name(value: Any) -> str:
    """llama.cpp's file type under the name llama.cpp and Ollama show: MOSTLY_Q4_K_M is Q4_K_M, ALL_F32 is F32."""
    try:
        name = gguf.LlamaFileType(int(value)).name
    except (TypeError, ValueError):
        return ""
    return name.removeprefix("MOSTLY_").removeprefix("ALL_")


def _folder_facts(folder: Path, files: list[Path], on_disk: dict[str, Any]) -> ModelFacts:
    config_file = folder / "config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    safetensors = [f for f in files if f.suffix == ".safetensors"]
    elements: Counter[str] = Counter()  # by dtype ("F32", "BF16"), read from the headers alone
    for file in safetensors:
        with safe_open(file, "numpy") as tensors:
            for name in tensors.keys():  # noqa: SIM118 (a safetensors file is not a dict)
                tensor = tensors.get_slice(name)
                elements[tensor.get_dtype()] += math.prod(tensor.get_shape())
    context = text.get("max_position_embeddings")
    return ModelFacts(format="safetensors" if safetensors else "", family=config.get("model_type") or "",
                      parameter_count=sum(elements.values()) if safetensors else None,
                      quantization=elements.most_common(1)[0][0] if elements else "",
                      context_length=None if context is None else int(context), **on_disk)
