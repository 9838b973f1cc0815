"""What a model family is made of: a description the shared layers (:mod:`conveyor.model.layers`) read.

A family is data, not code: the norm and where it sits, the activation, QK-norm, the embedding's scale,
whether rope differs by layer kind, and how a GGUF file of it stores its tensors. What varies between
checkpoints of one family (biases, tied embeddings, the attention scale, which layers attend to a window)
is in the checkpoint's config (:class:`conveyor.core.model_config.ModelConfig`), with the family's
defaults where a config leaves it out. A new family is a file of one of these, not a copy of the layers.
"""

from __future__ import annotations

from dataclasses import dataclass

# Norm kinds: "rms" scales by w (Llama), "rms_one_plus" by 1 + w (Gemma, whose weights are stored around 0).
NORM_KINDS = ("rms", "rms_one_plus")
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")  # gate activations the shared MLP has (SwiGLU, GeGLU)
PRE_NORMS = ("input_layernorm", "post_attention_layernorm")  # Llama's: before attention, before the MLP
SANDWICH_NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                  "post_feedforward_layernorm")  # Gemma's: before and after attention, before and after the MLP
QK_NORMS = ("self_attn.q_norm", "self_attn.k_norm")
# QK-norm kinds: "head" normalises each head's queries and keys on its own, by one weight of head_dim (Qwen3,
# Gemma 3); "projection" the whole query projection and the whole key projection, each by one RMS and a weight
# as wide (OLMoE), before they are split into heads.
QK_NORM_KINDS = ("head", "projection")


@dataclass(frozen=True, slots=True)
class Family:
    """One family of decoders: every ``model_types`` value a config.json may name it by, and how its layers
    differ from Llama's (the defaults are Llama's)."""

    name: str
    model_types: tuple[str, ...]
    gguf_architecture: str | None = None  # general.architecture of its GGUF files; None: none are read
    hf_architecture: str = "LlamaForCausalLM"  # what an export's config.json names
    norm: str = "rms"
    sandwich_norms: bool = False  # a norm after attention and after the MLP too, each before the residual add
    qk_norm: str | None = None  # one of QK_NORM_KINDS: a norm over queries and keys before rope; None: none
    embedding_scale: bool = False  # embeddings times sqrt(hidden_size)
    activations: tuple[str, ...] = ("silu",)
    # llama.cpp reorders Q and K rows for its rope only for some architectures (Llama's); others keep HF's.
    gguf_permuted_qk: bool = False
    gguf_norm_offset: float = 0.0  # llama.cpp stores Gemma's norm weights as 1 + w: what reading subtracts
    hf_reads_gguf: bool = True  # transformers' GGUF reader knows its architecture (a file's tokenizer: gguf.py)
    # Its checkpoints (and llama.cpp's files of it) store Q, K and V as one projection and gate and up as one, as
    # Conveyor's layers hold them (Phi-3's qkv_proj and gate_up_proj), instead of one tensor each.
    fused_projections: bool = False
    # Where a mixture-of-experts layer's checkpoint tensors lie: the block (its router is ``BLOCK.gate``, expert e's
    # projections ``BLOCK.experts.e.NAME``) and the names of each expert's gate, up and down projections.
    moe_block: str = "mlp"
    expert_projections: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")

    @property
    def layer_norms(self) -> tuple[str, ...]:
        """The norm weights of a layer, by HF name."""
        return (SANDWICH_NORMS if self.sandwich_norms else PRE_NORMS) + (QK_NORMS if self.qk_norm else ())
