"""Llama and Mistral: RMSNorm before attention and MLP, SwiGLU, one rope; Mistral's window is in its config.
Mixtral: Mistral's attention, a mixture of experts for the MLP (its checkpoints' names: block_sparse_moe, and
w1, w3, w2 for each expert's gate, up and down)."""

from __future__ import annotations

from conveyor.model.families.base import Family

LLAMA = Family("llama", ("llama",), gguf_architecture="llama", gguf_permuted_qk=True)
MISTRAL = Family("mistral", ("mistral",), hf_architecture="MistralForCausalLM")
# llama.cpp writes Mixtral as ``llama`` with experts (gguf_family tells them apart), Q and K reordered as Llama's.
MIXTRAL = Family("mixtral", ("mixtral",), hf_architecture="MixtralForCausalLM", moe_block="block_sparse_moe",
                 expert_projections=("w1", "w3", "w2"), gguf_permuted_qk=True)
