"""What a GGUF file of each family names and leaves out: tensor names, config keys, and the chat template.

llama.cpp's converter renames every tensor, drops the config keys it hard-codes for an architecture
(Gemma 3's local rope base and layer pattern), and for Gemma stores each norm weight as 1 + w. Reading a
file back into HF names and a HF config undoes that per family, here, so that the converter
(:mod:`conveyor.model.weights.gguf`) and the quantized reader (:mod:`conveyor.model.weights.gguf_weights`) agree.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from conveyor.model.families import Family

# Per-layer GGUF names "blk.N.<key>" -> HF "model.layers.N.<value>", as every family names them.
LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
# A mixture of experts' tensors: the router, and each projection of every expert stacked in one 3-D tensor
# [experts, out, in]. Under HF names they are the family's MoE block's ``gate`` and ``experts.NAME`` (expert_name):
# HF checkpoints hold one tensor per expert (``experts.E.NAME``), which the export splits them into.
EXPERT_NAMES = {"ffn_gate_inp": None, "ffn_gate_exps": 0, "ffn_up_exps": 1, "ffn_down_exps": 2}
# Phi-3's fused projections: llama.cpp's ffn_up holds gate and up together, as HF Phi-3's gate_up_proj.
_FUSED_NAMES = {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}
# Gemma's four norms: llama.cpp's ffn_norm is the MLP's input norm, which HF Gemma names otherwise.
_SANDWICH_NAMES = {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}

# Gemma 3's values llama.cpp hard-codes rather than writes (llama-model.cpp): the local layers' rope base,
# and one global layer in every six.
GEMMA3_LOCAL_ROPE_THETA = 10000.0
GEMMA3_LAYER_PATTERN = 6
GEMMA3_27B_LAYERS = 62  # the one size whose attention scale is 1/sqrt(hidden / heads), not 1/sqrt(head_dim)

# Gemma's chat format, for a file that carries no template (llama.cpp falls back to the same built-in one):
# a system message opens the first user turn; the assistant's turns are the model's.
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)


def layer_names(family: Family) -> dict[str, str]:
    """The per-layer GGUF -> HF name table of ``family``."""
    return {**LAYER_NAMES, **(_SANDWICH_NAMES if family.sandwich_norms else {}),
            **(_FUSED_NAMES if family.fused_projections else {})}


def expert_name(family: Family, gguf_name: str) -> str:
    """The HF name (under a layer) of a mixture of experts' GGUF tensor: the router, or one stacked projection."""
    which = EXPERT_NAMES[gguf_name]
    if which is None:
        return f"{family.moe_block}.gate"
    return f"{family.moe_block}.experts.{family.expert_projections[which]}"


def is_norm(hf_name: str) -> bool:
    """Whether a HF tensor name is a norm's weight (what llama.cpp offsets for Gemma)."""
    return hf_name.endswith("norm.weight")


def family_config(family: Family, meta: Callable[[str, Any], Any], hparams: dict[str, Any],
                  global_rope: dict[str, Any]) -> dict[str, Any]:
    """The config.json keys of ``family`` beyond the Llama ones, from the file's metadata (``meta(key,
    default)``, key without the architecture's prefix) and the defaults llama.cpp assumes."""
    config: dict[str, Any] = {"architectures": [family.hf_architecture],
                              "model_type": family.model_types[0], **_experts_config(family, meta)}
    if family.name == "phi3":  # llama.cpp writes Phi-3-mini-4k's window (2047) of every layer
        config["sliding_window"] = meta("attention.sliding_window", None)
        if "original_max_position_embeddings" in global_rope:  # longrope: where Phi-3's own configs hold it
            config["original_max_position_embeddings"] = global_rope["original_max_position_embeddings"]
        return config
    if family.name != "gemma3":
        return config
    layers = hparams["num_hidden_layers"]
    pattern = meta("attention.sliding_window_pattern", GEMMA3_LAYER_PATTERN)
    local_rope = {"rope_type": "default", "rope_theta": GEMMA3_LOCAL_ROPE_THETA}
    scalar = hparams["head_dim"]
    if layers == GEMMA3_27B_LAYERS:
        scalar = hparams["hidden_size"] // hparams["num_attention_heads"]
    return config | {
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": scalar,
        "sliding_window": meta("attention.sliding_window", 4096),
        "layer_types": ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(layers)],
        "rope_parameters": {"full_attention": global_rope, "sliding_attention": local_rope},
        "rope_local_base_freq": GEMMA3_LOCAL_ROPE_THETA,
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
    }


def _experts_config(family: Family, meta: Callable[[str, Any], Any]) -> dict[str, Any]:
    """A mixture of experts' config keys, in its family's HF names: Qwen3-MoE's experts and their width,
    their weights scaled to sum to 1 as llama.cpp runs it unless the file says otherwise; Mixtral's
    ``num_local_experts``, as wide as its feed_forward_length; OLMoE's, as wide too, their weights never scaled
    (llama.cpp's olmoe graph does not, whatever the file says)."""
    experts = meta("expert_count", 0)
    if not experts:
        return {}
    used = meta("expert_used_count", None)
    if family.name == "mixtral":
        return {"num_local_experts": experts, "num_experts_per_tok": used}
    if family.name == "olmoe":
        return {"num_experts": experts, "num_experts_per_tok": used, "norm_topk_prob": False}
    return {"num_experts": experts, "num_experts_per_tok": used,
            "moe_intermediate_size": meta("expert_feed_forward_length", None),
            "norm_topk_prob": bool(meta("expert_weights_norm", True)), "decoder_sparse_step": 1,
            "mlp_only_layers": []}


def default_chat_template(family: Family) -> str | None:
    """The chat template of a file of ``family`` that carries none (None: the folder then has none)."""
    return GEMMA_CHAT_TEMPLATE if family.name == "gemma3" else None
