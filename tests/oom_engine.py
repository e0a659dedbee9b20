"""An engine for the daemon (SPECD_TEST_ENGINE_FACTORY="oom_engine:real_with_oom") that runs specd's
real engine and raises torch's out-of-memory error from inside the target model's forward pass
when a test asks for it.

The test arms a failure by writing a plan to the file named by SPECD_TEST_OOM_PLAN:
``{"fail": [2]}`` fails the 2nd target forward of the next completion (1 = the prefill, 2 and
later = verification passes); ``{"fail": "all"}`` fails every target forward of the next
completion. The plan is consumed by that completion. The error is raised by a forward hook on a
middle decoder layer, after the layers below it have appended to the KV cache: the partial cache
state a real OOM leaves behind.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

import torch

from specd.engine.types import CompletionRequest, CompletionResult


class OomEngine:
    def __init__(self, engine: Any):
        self._engine = engine
        self._hooked: int | None = None
        self._plan: Any = None
        self._calls = 0
        self.injected = 0
        self._lock = threading.Lock()

    def _hook(self) -> None:
        target = self._engine.pair.target
        if self._hooked == id(target):
            return
        layers = target.model.layers
        middle = len(layers) // 2
        # transformers' forward runs the layer modules (a forward hook sees them); the lean
        # forward runs their weights through _decoder_layer, wrapped here on that path object.
        layers[middle].register_forward_hook(self._maybe_fail)
        path, _ = self._engine.paths["target"]
        if hasattr(path, "_decoder_layer"):
            run_layer = path._decoder_layer

            def decoder_layer(layer, x, *args):
                out = run_layer(layer, x, *args)
                if layer is path.layers[middle]:
                    self._maybe_fail(None, None, None)
                return out

            path._decoder_layer = decoder_layer
        self._hooked = id(target)

    def _maybe_fail(self, module, args, output):
        self._calls += 1
        plan = self._plan
        if plan is not None and (plan == "all" or self._calls in plan):
            self.injected += 1
            raise torch.OutOfMemoryError(f"CUDA out of memory (simulated, target forward {self._calls})")
        return None

    def _take_plan(self) -> Any:
        path = os.environ.get("SPECD_TEST_OOM_PLAN")
        if not path or not Path(path).exists():
            return None
        plan = json.loads(Path(path).read_text())["fail"]
        Path(path).unlink()
        return plan

    def complete(self, req: CompletionRequest, cancel: threading.Event | None = None) -> CompletionResult:
        with self._lock:
            self._engine.ensure_loaded()
            self._hook()
            self._plan, self._calls = self._take_plan(), 0
            try:
                return self._engine.complete(req, cancel)
            finally:
                self._plan = None

    def complete_steps(self, req: CompletionRequest, cancel: threading.Event | None = None):
        """The same, step by step as the daemon's worker runs it (the plan is this engine's one
        state: the tests run one completion at a time)."""
        with self._lock:
            self._engine.ensure_loaded()
            self._hook()
            self._plan, self._calls = self._take_plan(), 0
        try:
            return (yield from self._engine.complete_steps(req, cancel))
        finally:
            self._plan = None

    def stats(self) -> dict[str, Any]:
        stats = self._engine.stats()
        stats["injected_ooms"] = self.injected
        return stats

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)


def real_with_oom(cfg: Any) -> OomEngine:
    from specd.engine import load_engine

    return OomEngine(load_engine(cfg))
