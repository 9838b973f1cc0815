"""The model families Conveyor runs, by the names a config.json or a GGUF file gives them.

``family_for`` is where a model is refused before anything loads: an unknown architecture, an activation
or a rope scaling the shared layers lack. ``native_gaps`` says what of a family the native stack
(csrc/native_llama.h) lacks, so the engine runs such a model on the PyTorch ops instead, saying why.
"""

from __future__ import annotations

from conveyor.core.model_config import ModelConfig
from conveyor.model.families.base import Family
from conveyor.model.families.gemma import GEMMA3
from conveyor.model.families.llama import LLAMA, MISTRAL
from conveyor.model.families.qwen import QWEN2, QWEN3

__all__ = ["FAMILIES", "ROPE_SCALINGS", "Family", "family_for", "gguf_family", "native_gaps"]

FAMILIES: tuple[Family, ...] = (LLAMA, MISTRAL, QWEN2, QWEN3, GEMMA3)
_BY_MODEL_TYPE = {model_type: family for family in FAMILIES for model_type in family.model_types}
_BY_GGUF = {family.gguf_architecture: family for family in FAMILIES if family.gguf_architecture}
ROPE_SCALINGS = ("default", "linear", "llama3")  # what RotaryEmbedding computes


def family_for(config: ModelConfig) -> Family:
    """The family of ``config``, or a ValueError naming the field that no family here runs."""
    family = _BY_MODEL_TYPE.get(config.model_type)
    if family is None:
        raise ValueError(f"model: model_type {config.model_type!r} is not supported (supported: "
                         f"{', '.join(sorted(_BY_MODEL_TYPE))})")
    if config.hidden_act not in family.activations:
        raise ValueError(f"model: hidden_act {config.hidden_act!r} is not supported for {family.name} "
                         f"(supported: {', '.join(family.activations)})")
    for scaling in (config.rope_scaling, config.local_rope_scaling):
        kind = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
        if kind not in ROPE_SCALINGS:
            raise ValueError(f"model: rope_scaling type {kind!r} is not supported (supported: "
                             f"{', '.join(ROPE_SCALINGS)})")
    return family


def gguf_family(architecture: str | None) -> Family:
    """The family of a GGUF file's ``general.architecture``, or a ValueError listing those read."""
    family = _BY_GGUF.get(architecture)
    if family is None:
        raise ValueError(f"model: GGUF architecture {architecture!r} is not supported (supported: "
                         f"{', '.join(sorted(_BY_GGUF))})")
    return family


def native_gaps(config: ModelConfig, max_model_len: int) -> list[str]:
    """What the native stack lacks to run ``config`` (empty: it runs it): it has Llama's layers, QKV and MLP
    biases, one rope and full attention. A window as long as the longest sequence never binds."""
    family = family_for(config)
    gaps = [what for what, needed in (
        ("QK-norm", family.qk_norm), ("(1 + w) RMSNorm", family.norm != "rms"),
        ("norms after attention and MLP", family.sandwich_norms), ("an embedding scale", family.embedding_scale),
        (f"the {config.hidden_act} activation", config.hidden_act != "silu"),
        ("a rope per layer kind", config.local_rope_theta is not None),
        ("an attention scale other than 1/sqrt(head_dim)", config.query_pre_attn_scalar not in (None, config.head_dim)),
    ) if needed]
    windows = sorted({w for w in config.layer_windows if w is not None and w < max_model_len})
    if windows:
        gaps.append(f"sliding-window attention (window {', '.join(map(str, windows))})")
    return gaps
