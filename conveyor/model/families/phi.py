"""Phi-3: Llama's layers, its checkpoints storing Q, K and V as one ``qkv_proj`` and gate and up as one
``gate_up_proj``; a ``sliding_window`` in its config applies to every layer (Phi-3-mini-4k: 2047). Its 128k
variants' ``longrope`` scaling is the shared rope's (conveyor.model.layers.RotaryEmbedding); Phi-4-mini's
partial rotary is refused by name (families/__init__.py)."""

from __future__ import annotations

from conveyor.model.families.base import Family

PHI3 = Family("phi3", ("phi3",), gguf_architecture="phi3", hf_architecture="Phi3ForCausalLM", fused_projections=True)
