"""The engine around the core: model, tokenizer and text.

``Engine`` is driven step by step; ``AsyncEngine`` runs it in a background thread for the server.
"""

from conveyor.engine.async_engine import (
    AsyncEngine,
    EngineDead,
    EngineOverloaded,
    RequestCounts,
    RequestFailed,
    RequestStream,
)
from conveyor.engine.llm_engine import Engine
from conveyor.engine.output import RequestMetrics, RequestOutput

__all__ = [
    "AsyncEngine",
    "Engine",
    "EngineDead",
    "EngineOverloaded",
    "RequestCounts",
    "RequestFailed",
    "RequestMetrics",
    "RequestOutput",
    "RequestStream",
]
