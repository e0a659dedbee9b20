"""The engine: lossless speculative decoding over a resident model pair. A plain library:
it knows tokens, models and caches, not sockets or editors."""

from specd.engine.types import (
    Cancelled,
    CompletionRequest,
    CompletionResult,
    ContextChunk,
    EngineError,
    ModelLoadError,
    SourceStats,
)

__all__ = [
    "Cancelled", "CompletionRequest", "CompletionResult", "ContextChunk", "EngineError",
    "ModelLoadError", "SourceStats", "Engine", "EngineOptions", "load_engine", "load_pair",
]


def __getattr__(name):  # torch-heavy names load on first use, so the CLI starts fast
    if name == "Engine":
        from specd.engine.engine import Engine
        return Engine
    if name == "EngineOptions":
        from specd.engine.options import EngineOptions
        return EngineOptions
    if name == "load_engine":
        from specd.engine.loading import load_engine
        return load_engine
    if name == "load_pair":
        from specd.engine.models import load_pair
        return load_pair
    raise AttributeError(name)
