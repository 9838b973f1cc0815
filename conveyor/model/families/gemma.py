"""Gemma 3: (1 + w) RMSNorm before and after attention and MLP, QK-norm, GeGLU with tanh GELU, embeddings
scaled by sqrt(hidden_size), and five local layers in six with their own rope base and a window (from the
config: ``layer_types``, ``sliding_window``, ``rope_parameters`` per layer kind, ``query_pre_attn_scalar``)."""

from __future__ import annotations

from conveyor.model.families.base import Family

GEMMA3 = Family(
    "gemma3", ("gemma3_text", "gemma3"), gguf_architecture="gemma3", hf_architecture="Gemma3ForCausalLM",
    norm="rms_one_plus", sandwich_norms=True, qk_norm="head", embedding_scale=True,
    activations=("gelu_pytorch_tanh",), gguf_norm_offset=1.0,
)
