"""The engine around the core: model, tokenizer and text.

``Engine`` is driven step by step; ``AsyncEngine`` runs it in a background thread for the server. A front end
talks to an ``EngineClient`` (conveyor.engine.client): one AsyncEngine, or replicas behind a router.
"""

from conveyor.engine.async_engine import AsyncEngine, RequestStream
from conveyor.engine.client import (
    CompilesOverloaded,
    EngineClient,
    EngineDead,
    EngineOverloaded,
    LiveViewUnavailable,
    OutputStream,
    RequestCounts,
    RequestFailed,
)
from conveyor.engine.llm_engine import Engine
from conveyor.engine.output import RequestMetrics, RequestOutput

__all__ = [
    "AsyncEngine",
    "CompilesOverloaded",
    "Engine",
    "EngineClient",
    "EngineDead",
    "EngineOverloaded",
    "LiveViewUnavailable",
    "OutputStream",
    "RequestCounts",
    "RequestFailed",
    "RequestMetrics",
    "RequestOutput",
    "RequestStream",
]
