"""The numbers that define a Llama-family model, read from a HF ``config.json``."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from conveyor.core.weight_format import WeightFormat, gguf_weights


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

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        if raw.get("model_type") not in ("llama", "mistral", "qwen2", None):
            raise ValueError(f"unsupported model_type {raw.get('model_type')!r}: Conveyor runs Llama-family decoders")
        rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
        theta = rope.pop("rope_theta", None) or raw.get("rope_theta", 10000.0)
        if rope.get("rope_type", rope.get("type", "default")) == "default":
            rope = {}
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
            rope_scaling=rope,
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,)),
            attention_bias=raw.get("attention_bias", raw.get("model_type") == "qwen2"),
            mlp_bias=raw.get("mlp_bias", False),
            stored_as=_stored_as(raw.get("quantization_config")),
        )

    @classmethod
    def from_folder(cls, folder: str | Path) -> ModelConfig:
        path = Path(folder) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"model: no config.json in {folder}")
        return cls.from_hf_dict(json.loads(path.read_text()))

    @property
    def weight_format(self) -> WeightFormat | None:
        """The stored weights' format (bits a weight), for the cost model; None for float weights or types it
        does not know."""
        if self.stored_as is None:
            return None
        layers, _, head = self.stored_as.partition("/")
        return gguf_weights(layers, head)

    @property
    def kv_bytes_per_token(self) -> int:
        """KV bytes one token occupies across all layers, per byte of element size."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim


def _stored_as(quantization: dict[str, Any] | None) -> str | None:
    """``{"quant_method": "gguf", "layer_type": "Q4_1", "lm_head_type": "Q8_0"}`` -> "Q4_1/Q8_0"."""
    if not quantization or quantization.get("quant_method") != "gguf":
        return None
    return f"{quantization.get('layer_type')}/{quantization.get('lm_head_type')}"
