"""Ollama's views of the served models: ``/api/tags`` (every name served), ``/api/show`` (one model),
``/api/ps`` (those loaded now), from what the model's files say (ModelFacts) and what the pool and the running
engine know. Nothing is estimated: what neither says is empty ("" or null), as Ollama leaves a field it lacks.
"""

from __future__ import annotations

from typing import Any

from conveyor.core.model_facts import ModelFacts
from conveyor.entrypoints.ollama.replies import rfc3339


def parameter_size(count: int | None) -> str:
    """A parameter count as Ollama writes it (its format.HumanNumber): 134.52M, 8.0B, 7B, 500K."""
    if count is None:
        return ""
    for scale, unit, decimals in ((1e9, "B", 1), (1e6, "M", 2)):
        if count >= scale:
            number = count / scale
            return f"{number:.0f}{unit}" if number == int(number) else f"{number:.{decimals}f}{unit}"
    return f"{count / 1e3:.0f}K" if count >= 1000 else str(count)


def details(facts: ModelFacts) -> dict[str, Any]:
    return {"parent_model": "", "format": facts.format, "family": facts.family,
            "families": [facts.family] if facts.family else None,
            "parameter_size": parameter_size(facts.parameter_count), "quantization_level": facts.quantization}


def tag(name: str, facts: ModelFacts) -> dict[str, Any]:
    """One served name as /api/tags lists it: its files' size, change time and digest."""
    return {"name": name, "model": name, "modified_at": rfc3339(facts.modified_at), "size": facts.size_bytes,
            "digest": facts.digest, "details": details(facts)}


def model_info(facts: ModelFacts) -> dict[str, Any]:
    """/api/show's model_info, in GGUF's key names, of what the files say."""
    arch = facts.family or "general"
    known = {"general.architecture": facts.family or None, "general.parameter_count": facts.parameter_count,
             f"{arch}.context_length": facts.context_length}
    return {key: value for key, value in known.items() if value is not None}


def show(facts: ModelFacts, template: str, capabilities: list[str]) -> dict[str, Any]:
    """/api/show of one model. No Modelfile lies behind it: ``modelfile`` and ``parameters`` are empty (a request
    that leaves an option out takes the OpenAI API's default); ``template`` is the chat template (Jinja, not
    Ollama's Go), known once the model has loaded."""
    return {"modelfile": "", "parameters": "", "template": template, "details": details(facts),
            "model_info": model_info(facts), "capabilities": capabilities, "modified_at": rfc3339(facts.modified_at)}


def running(name: str, facts: ModelFacts, held_bytes: int | None, context_length: int) -> dict[str, Any]:
    """One loaded model as /api/ps lists it: what it holds (weights and KV pool) and the context it runs with.
    A model here stays until the pool needs its room, on no timer: ``expires_at`` is null; and the pool does not
    say which device holds it, so ``size_vram`` is left out."""
    return {"name": name, "model": name, "size": held_bytes, "digest": facts.digest, "details": details(facts),
            "expires_at": None, "context_length": context_length}
