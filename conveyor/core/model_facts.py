"""What a served model's files say of it, for an API that lists models (Ollama's ``/api/tags``, ``/api/show``).

Read from the files (a GGUF file's metadata and tensors, a folder's config.json and safetensors headers), never
estimated: where the files do not say, a field stays empty, and the API shows it empty. Torch-free, so the pool
of served models carries it and the server reads it without the model's runtime.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ModelFacts:
    format: str = ""  # how the weights are stored on disk: "gguf" or "safetensors"
    family: str = ""  # the architecture: "llama", "qwen2", "gemma3"
    parameter_count: int | None = None  # the weights' elements, counted tensor by tensor
    quantization: str = ""  # a GGUF file's type ("Q4_K_M", "Q8_0"), or the tensors' dtype ("F32", "BF16")
    context_length: int | None = None  # the context the model was made for (its config's), not the server's
    digest: str = ""  # the SHA-256 of a GGUF file; a folder of several files has none
    size_bytes: int | None = None  # the weights' files on disk
    modified_at: float | None = None  # the weights' latest change, seconds since the epoch
