"""OLMoE: Llama's layers with an RMSNorm over the whole query projection and the whole key projection (one RMS
over all heads at once, weights as wide as the projection) before rope, every layer a mixture of experts (its
experts as wide as ``intermediate_size``, their weights not scaled to sum to 1 unless ``norm_topk_prob``), and an
optional clamp of Q, K and V (``clip_qkv``, read for this family only: ModelConfig). llama.cpp's ``olmoe`` files
keep HF's row order (its rope for them pairs dimensions half a head apart, as HF's) and the norms' w as it is."""

from __future__ import annotations

from conveyor.model.families.base import Family

OLMOE = Family("olmoe", ("olmoe",), gguf_architecture="olmoe", hf_architecture="OlmoeForCausalLM",
               qk_norm="projection", hf_reads_gguf=False)
