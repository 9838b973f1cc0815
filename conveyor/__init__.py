"""Conveyor: an LLM serving engine whose batching you can see and control."""

from conveyor.core.sampling import SamplingParams

__all__ = ["LLM", "Engine", "EngineConfig", "SamplingParams"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # The engine pulls in torch; import it only when asked, so the scheduler
    # and KV manager stay usable (and fast to import) without it.
    if name == "LLM":
        from conveyor.entrypoints.llm import LLM

        return LLM
    if name == "Engine":
        from conveyor.engine import Engine

        return Engine
    if name == "EngineConfig":
        from conveyor.core.config import EngineConfig

        return EngineConfig
    raise AttributeError(name)
