"""The one factory: the loaded engine a configuration names."""

from __future__ import annotations

import gc
import time


def load_engine(cfg):
    """The loaded engine ``model.backend`` names: the resident model pair (``Engine``), or a
    serving engine behind an OpenAI-compatible endpoint (``RemoteEngine``). Both fulfil the
    daemon's ``CompletionEngine``. torch and transformers load here (the local engine only)."""
    from specd.engine.options import EngineOptions

    options = EngineOptions.from_config(cfg)
    if cfg.section("model").get("backend", "local") == "remote":
        from specd.engine.remote.client import RemoteOptions
        from specd.engine.remote.engine import RemoteEngine

        engine = RemoteEngine(options, RemoteOptions.from_config(cfg))
        engine.ensure_loaded()
        return engine
    # Importing torch and transformers allocates as much as a load, and as there (``gc_paused``)
    # the collections CPython would start meanwhile only walk a growing heap: none until the
    # load's own collection at its end.
    enabled = gc.isenabled()
    gc.disable()
    try:
        started = time.perf_counter()
        from specd.engine.engine import Engine  # torch, when not imported yet (transformers with a torch model)

        import_s = time.perf_counter() - started
        engine = Engine(options)
        engine.import_s = import_s  # reported with the rest of the start-up
        engine.ensure_loaded()
    finally:
        if enabled:
            gc.enable()
    return engine
