"""Llama and Mistral: RMSNorm before attention and MLP, SwiGLU, one rope; Mistral's window is in its config."""

from __future__ import annotations

from conveyor.model.families.base import Family

LLAMA = Family("llama", ("llama",), gguf_architecture="llama", gguf_permuted_qk=True)
MISTRAL = Family("mistral", ("mistral",), hf_architecture="MistralForCausalLM")
