"""The model families Conveyor runs, by the names a config.json or a GGUF file gives them.

``family_for`` is where a model is refused before anything loads: an unknown architecture, an activation
or a rope scaling the shared layers lack.
"""

from __future__ import annotations

from typing import Any

from conveyor.core.model_config import ModelConfig
from conveyor.model.families.base import Family
from conveyor.model.families.gemma import GEMMA3
from conveyor.model.families.llama import LLAMA, MISTRAL, MIXTRAL
from conveyor.model.families.olmoe import OLMOE
from conveyor.model.families.phi import PHI3
from conveyor.model.families.qwen import QWEN2, QWEN3, QWEN3_MOE

__all__ = ["FAMILIES", "ROPE_SCALINGS", "Family", "family_for", "gguf_family", "rope_kind"]

FAMILIES: tuple[Family, ...] = (LLAMA, MISTRAL, MIXTRAL, QWEN2, QWEN3, QWEN3_MOE, OLMOE, GEMMA3, PHI3)
_BY_MODEL_TYPE = {model_type: family for family in FAMILIES for model_type in family.model_types}
_BY_GGUF = {family.gguf_architecture: family for family in FAMILIES if family.gguf_architecture}
ROPE_SCALINGS = ("default", "linear", "llama3", "yarn", "longrope")  # what RotaryEmbedding computes


def rope_kind(scaling: dict[str, Any]) -> str:
    """A rope_scaling dict's kind (transformers 5's ``rope_type``, or the older ``type``)."""
    return scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"


def family_for(config: ModelConfig) -> Family:
    """The family of ``config``, or a ValueError naming the field that no family here runs."""
    family = _BY_MODEL_TYPE.get(config.model_type)
    if family is None:
        raise ValueError(f"model: model_type {config.model_type!r} is not supported (supported: "
                         f"{', '.join(sorted(_BY_MODEL_TYPE))})")
    if config.hidden_act not in family.activations:
        raise ValueError(f"model: hidden_act {config.hidden_act!r} is not supported for {family.name} "
                         f"(supported: {', '.join(family.activations)})")
    if config.partial_rotary_factor != 1.0:
        raise ValueError(f"model: partial_rotary_factor {config.partial_rotary_factor} is not supported (supported: "
                         "1.0, rope over the whole head)")
    for scaling in (config.rope_scaling, config.local_rope_scaling):
        kind = rope_kind(scaling)
        if kind not in ROPE_SCALINGS:
            raise ValueError(f"model: rope_scaling type {kind!r} is not supported (supported: "
                             f"{', '.join(ROPE_SCALINGS)})")
    return family


def gguf_family(architecture: str | None, num_experts: int = 0) -> Family:
    """The family of a GGUF file's ``general.architecture`` (a ``llama`` file with ``num_experts`` is Mixtral, as
    llama.cpp writes it), or a ValueError listing those read."""
    family = _BY_GGUF.get(architecture)
    if family is None:
        raise ValueError(f"model: GGUF architecture {architecture!r} is not supported (supported: "
                         f"{', '.join(sorted(_BY_GGUF))})")
    return MIXTRAL if family is LLAMA and num_experts else family
