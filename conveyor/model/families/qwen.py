"""Qwen 2 / 2.5 (Llama's layers with biases on Q, K and V), Qwen 3 (no biases, RMSNorm over each head's
queries and keys before rope) and Qwen3-MoE (Qwen 3's attention, a mixture of experts for the MLP)."""

from __future__ import annotations

from conveyor.model.families.base import Family

QWEN2 = Family("qwen2", ("qwen2",), gguf_architecture="qwen2", hf_architecture="Qwen2ForCausalLM")
QWEN3 = Family("qwen3", ("qwen3",), gguf_architecture="qwen3", hf_architecture="Qwen3ForCausalLM", qk_norm="head")
QWEN3_MOE = Family("qwen3_moe", ("qwen3_moe",), gguf_architecture="qwen3moe", hf_architecture="Qwen3MoeForCausalLM",
                   qk_norm="head")
