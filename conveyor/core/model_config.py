"""The numbers that define a decoder model, read from a HF ``config.json``.

Only what any part of Conveyor needs to know without the model code: shapes, rope bases and scaling per
layer kind, which layers attend to a window, and the keys each family's config classes fill in by default
(so a folder written by another version of transformers reads the same). What the layers are made of (norm
kind and placement, QK-norm, embedding scale) is the family's, in :mod:`conveyor.model.families`; this module
stays torch-free so the simulator and the KV manager read the same numbers.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from conveyor.core.formats import WeightFormat, gguf_weights


@dataclass(frozen=True, slots=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope_scaling: dict[str, Any] = field(default_factory=dict)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    attention_bias: bool = False
    mlp_bias: bool = False
    # How the weights are stored when not in float: "Q4_1/Q8_0" (the layers' GGUF type / the LM head's), from
    # config.json's quantization_config (a GGUF file's folder writes it). None: float weights.
    stored_as: str | None = None
    model_type: str = "llama"
    hidden_act: str = "silu"
    # Per layer: the window it attends to (the last W positions, itself included), or None for the whole context.
    layer_windows: tuple[int | None, ...] = ()
    # The rope of windowed layers where it differs from the others' (Gemma 3: base 10000 locally, 1e6 globally).
    local_rope_theta: float | None = None
    local_rope_scaling: dict[str, Any] = field(default_factory=dict)
    query_pre_attn_scalar: float | None = None  # attention scale 1/sqrt(this) instead of 1/sqrt(head_dim)
    partial_rotary_factor: float = 1.0  # the share of each head that rope rotates (Phi-4-mini: 0.75)
    # Q, K and V each clamped to [-clip_qkv, clip_qkv] after the QK-norm (OLMoE's config key; None: not clamped).
    clip_qkv: float | None = None
    # A mixture of experts (none: a dense model): in each of its MoE layers a router picks ``num_experts_per_tok``
    # of ``num_experts`` experts per token, each a gated MLP of ``moe_intermediate_size``, their outputs summed
    # by the router's probabilities (scaled to sum to 1 with ``norm_topk_prob``); ``dense_layers`` have a
    # plain MLP of ``intermediate_size`` instead (Qwen3-MoE's mlp_only_layers and decoder_sparse_step).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    dense_layers: tuple[int, ...] = ()

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        """The config of a HF ``config.json``'s dict; a key the model needs and the dict lacks is a ValueError
        naming it (a multimodal config's text part is read, as its text model would be)."""
        raw = _text_config(raw)
        model_type = raw.get("model_type") or "llama"
        full = {**_FAMILY_DEFAULTS.get(model_type, {}), **{k: v for k, v in raw.items() if v is not None}}
        try:
            return cls._from_full_dict(full, model_type)
        except KeyError as missing:
            raise ValueError(f"model: config.json lacks {missing.args[0]!r}, which a {model_type} model needs "
                             f"(needed: {', '.join(REQUIRED_KEYS)})") from None

    @classmethod
    def _from_full_dict(cls, raw: dict[str, Any], model_type: str) -> ModelConfig:
        missing = [key for key in REQUIRED_KEYS if key not in raw]
        if missing:
            raise KeyError(missing[0])
        global_rope, local_rope = _rope_by_layer_kind(raw)
        theta = global_rope.pop("rope_theta", None) or raw.get("rope_theta", 10000.0)
        local_theta = local_rope.pop("rope_theta", None) if local_rope is not None else None
        heads = raw["num_attention_heads"]
        eos = raw.get("eos_token_id")
        return cls(
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            rope_scaling=_scaling(global_rope, raw, model_type),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,)),
            attention_bias=raw.get("attention_bias", False),
            mlp_bias=raw.get("mlp_bias", False),
            stored_as=_stored_as(raw.get("quantization_config")),
            model_type=model_type,
            hidden_act=raw.get("hidden_activation") or raw.get("hidden_act", "silu"),
            layer_windows=_layer_windows(raw, model_type),
            local_rope_theta=None if local_theta is None else float(local_theta),
            local_rope_scaling=_scaling(local_rope or {}, raw, model_type),
            query_pre_attn_scalar=raw.get("query_pre_attn_scalar"),
            partial_rotary_factor=float(raw.get("partial_rotary_factor")
                                        or (raw.get("rope_parameters") or {}).get("partial_rotary_factor", 1.0)),
            clip_qkv=_clip_qkv(raw, model_type),
            **_experts(raw),
        )

    @classmethod
    def from_folder(cls, folder: str | Path) -> ModelConfig:
        path = Path(folder) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"model: no config.json in {folder}")
        return cls.from_hf_dict(json.loads(path.read_text()))

    @property
    def gguf_file(self) -> bool:
        """Whether the weights are a GGUF file's, run from the file (what ``--kv-cache-dtype auto`` stores
        depends on it: conveyor.core.formats.kv_cache_format)."""
        return self.stored_as is not None

    @property
    def weight_format(self) -> WeightFormat | None:
        """The stored weights' format (bits a weight), for the cost model; None for float weights or types it
        does not know."""
        if self.stored_as is None:
            return None
        layers, _, head = self.stored_as.partition("/")
        return gguf_weights(layers, head)

    def layer_has_experts(self, layer: int) -> bool:
        """Whether layer ``layer``'s MLP is a mixture of experts."""
        return self.num_experts > 0 and layer not in self.dense_layers

    def layer_window(self, layer: int) -> int | None:
        """The window layer ``layer`` attends to, None for the whole context."""
        return self.layer_windows[layer] if self.layer_windows else None

    @property
    def kv_bytes_per_token(self) -> int:
        """KV bytes one token occupies across all layers, per byte of element size."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim


def _experts(raw: dict[str, Any]) -> dict[str, Any]:
    """The mixture-of-experts fields of a config (Qwen3-MoE's names, or Mixtral's ``num_local_experts``, whose
    experts are as wide as its ``intermediate_size`` and whose router always scales the picked to sum to 1)."""
    experts = raw.get("num_experts") or raw.get("num_local_experts") or 0
    if not experts:
        return {}
    step, dense = raw.get("decoder_sparse_step") or 1, set(raw.get("mlp_only_layers") or ())
    return {"num_experts": experts, "num_experts_per_tok": raw["num_experts_per_tok"],
            "moe_intermediate_size": raw.get("moe_intermediate_size") or raw["intermediate_size"],
            "norm_topk_prob": raw.get("norm_topk_prob", False),
            "dense_layers": tuple(i for i in range(raw["num_hidden_layers"]) if i in dense or (i + 1) % step)}


def _clip_qkv(raw: dict[str, Any], model_type: str) -> float | None:
    """The clamp of Q, K and V, read only where the family's model applies it (transformers' other models ignore
    a stray key; so does this)."""
    clip = raw.get("clip_qkv") if model_type in CLIPS_QKV else None
    return None if clip is None else float(clip)


def _stored_as(quantization: dict[str, Any] | None) -> str | None:
    """``{"quant_method": "gguf", "layer_type": "Q4_1", "lm_head_type": "Q8_0"}`` -> "Q4_1/Q8_0"."""
    if not quantization or quantization.get("quant_method") != "gguf":
        return None
    return f"{quantization.get('layer_type')}/{quantization.get('lm_head_type')}"


CLIPS_QKV = ("olmoe",)  # the model types whose attention clamps Q, K and V by clip_qkv
REQUIRED_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")

# What each family's HF config class fills in when a config.json leaves a key out (transformers' defaults).
_FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "qwen2": {"attention_bias": True},
    "gemma3_text": {"tie_word_embeddings": True, "hidden_activation": "gelu_pytorch_tanh", "rope_theta": 1e6,
                    "rope_local_base_freq": 10000.0, "query_pre_attn_scalar": 256, "sliding_window": 4096,
                    "sliding_window_pattern": 6, "head_dim": 256, "rms_norm_eps": 1e-6},
}
_FAMILY_DEFAULTS["gemma3"] = _FAMILY_DEFAULTS["gemma3_text"]
_FAMILY_DEFAULTS["mixtral"] = {"norm_topk_prob": True, "rope_theta": 1e6}
_FAMILY_DEFAULTS["olmoe"] = {"rms_norm_eps": 1e-5, "max_position_embeddings": 4096, "num_experts": 64,
                             "num_experts_per_tok": 8}
_FAMILY_DEFAULTS["phi3"] = {"rms_norm_eps": 1e-5, "max_position_embeddings": 4096,
                            "original_max_position_embeddings": 4096}


def _text_config(raw: dict[str, Any]) -> dict[str, Any]:
    """A multimodal config's text part (Gemma 3's ``text_config``), else the config itself."""
    text = raw.get("text_config")
    if isinstance(text, dict) and "num_hidden_layers" in text:
        return {"model_type": f"{raw.get('model_type')}_text", **text}
    return raw


def _rope_by_layer_kind(raw: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The rope parameters of full-attention layers, and of windowed ones where they have their own: from
    transformers 5's ``rope_parameters`` (one dict, or one per layer kind) or the older top-level keys."""
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if "full_attention" in params or "sliding_attention" in params:
        local = params.get("sliding_attention")
        return dict(params.get("full_attention") or {}), None if local is None else dict(local)
    local_theta = raw.get("rope_local_base_freq")
    return dict(params), None if local_theta is None else {"rope_theta": local_theta}


def _scaling(rope: dict[str, Any], raw: dict[str, Any], model_type: str) -> dict[str, Any]:
    """A rope dict without its base, its kind under ``rope_type``: empty for plain rope. As transformers reads
    it: Phi-3's older ``su`` and ``yarn`` are its longrope, and the scalings that stretch a trained context
    take its length from the config's top-level ``original_max_position_embeddings`` where there is one (Phi-3
    keeps it there, 4096 by default), else from the rope dict, else max_position_embeddings."""
    rope = {k: v for k, v in rope.items() if k != "rope_theta"}
    kind = rope.pop("type", None)
    kind = rope.setdefault("rope_type", kind or "default")
    if kind == "default":
        return {}
    if model_type == "phi3" and kind in ("su", "yarn"):
        rope["rope_type"] = kind = "longrope"
    if kind in ("llama3", "yarn", "longrope"):
        rope["original_max_position_embeddings"] = (raw.get("original_max_position_embeddings")
                                                     or rope.get("original_max_position_embeddings")
                                                     or raw.get("max_position_embeddings", 2048))
    return rope


def _layer_windows(raw: dict[str, Any], model_type: str) -> tuple[int | None, ...]:
    """Each layer's window: from ``layer_types`` where the config lists them, else the way each family's
    config class derives them (Mistral, Phi-3: every layer when ``sliding_window`` is set; Qwen: layers from
    ``max_window_layers`` on when ``use_sliding_window``; Gemma 3: five local layers in every six)."""
    layers, window = raw["num_hidden_layers"], raw.get("sliding_window")
    kinds = raw.get("layer_types")
    if kinds is None:
        kinds = [_default_layer_kind(raw, model_type, i) for i in range(layers)]
    if window is None:
        return (None,) * layers
    return tuple(int(window) if kind == "sliding_attention" else None for kind in kinds)


def _default_layer_kind(raw: dict[str, Any], model_type: str, layer: int) -> str:
    if model_type in ("mistral", "mixtral", "phi3"):
        return "sliding_attention"
    if model_type.startswith("qwen"):
        windowed = raw.get("use_sliding_window", False) and layer >= raw.get("max_window_layers", 0)
        return "sliding_attention" if windowed else "full_attention"
    if model_type.startswith("gemma3"):
        pattern = raw.get("sliding_window_pattern", 6)
        return "full_attention" if (layer + 1) % pattern == 0 else "sliding_attention"
    return "full_attention"
