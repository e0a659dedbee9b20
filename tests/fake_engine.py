"""Engines the daemon tests load through SPECD_TEST_ENGINE_FACTORY ("fake_engine:<name>").

``fake``: no model at all, starts in milliseconds, answers "[<up to 12 chars before the
cursor>]" so tests can check cursor conversion exactly. ``real``: specd's engine on the
configured (tiny) models. Both hold a request whose text before the cursor contains ``#slow``
for up to 5 s, polling the cancel event, so supersede and cancel tests are deterministic.
Behaviour switches (environment): SPECD_TEST_FAKE_LOAD_S (load time), SPECD_TEST_FAKE_LOAD_FAIL
(load raises ModelLoadError with this message), SPECD_TEST_SLOW_S (the ``#slow`` hold, 5 s).
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

from specd.engine.types import Cancelled, CompletionRequest, CompletionResult, EngineError, ModelLoadError, SourceStats

SLOW_MARKER = "#slow"
SLOW_SECONDS = float(os.environ.get("SPECD_TEST_SLOW_S", "5"))


def hold_if_slow(req: CompletionRequest, text: str, cancel: threading.Event | None) -> None:
    if SLOW_MARKER not in text[: req.offset]:
        return
    deadline = time.monotonic() + SLOW_SECONDS
    while time.monotonic() < deadline:
        if cancel is not None and cancel.wait(0.01):
            raise Cancelled("cancelled")


class FakeEngine:
    def __init__(self, cfg: Any):
        self.cfg = cfg
        self.documents: dict[str, str] = {}
        self.cursors: dict[str, int | None] = {}
        self.lock = threading.Lock()
        self.loaded = True
        self.loads = 1
        self.releases = 0
        self.completions = 0

    @classmethod
    def from_config(cls, cfg: Any) -> FakeEngine:
        time.sleep(float(os.environ.get("SPECD_TEST_FAKE_LOAD_S", "0")))
        if os.environ.get("SPECD_TEST_FAKE_LOAD_FAIL"):
            raise ModelLoadError(os.environ["SPECD_TEST_FAKE_LOAD_FAIL"])
        return cls(cfg)

    def open_document(self, uri: str, text: str) -> None:
        with self.lock:
            self.documents[uri] = text

    def update_document(self, uri: str, text: str, cursor: int | None = None) -> None:
        with self.lock:  # one step: whoever sees the new text sees its cursor too
            self.documents[uri] = text
            self.cursors[uri] = cursor  # where the daemon says the last edit ended

    def close_document(self, uri: str) -> None:
        with self.lock:
            self.documents.pop(uri, None)

    def complete(self, req: CompletionRequest, cancel: threading.Event | None = None) -> CompletionResult:
        assert self.loaded, "complete() on a released engine"
        text = req.text if req.text is not None else self.documents.get(req.uri or "")
        if text is None:
            raise EngineError(f"unknown document {req.uri}")
        if req.offset is None or not 0 <= req.offset <= len(text):
            raise EngineError(f"offset {req.offset} out of range")
        if cancel is not None and cancel.is_set():
            raise Cancelled("cancelled")
        hold_if_slow(req, text, cancel)
        self.completions += 1
        completion = f"[{text[max(0, req.offset - 12):req.offset]}]"
        return CompletionResult(
            text=completion, token_ids=[1, 2], prompt_ids=[3, 4, 5], stop_reason="max_tokens",
            target_forwards=1, sources={"lookup": SourceStats(proposed=2, accepted=1, steps=1)},
        )

    def stats(self) -> dict[str, Any]:
        with self.lock:
            documents = len(self.documents)
        return {
            "models": {"target": "fake-target", "draft": "fake-draft"},
            "device": "cpu",
            "dtype": "float32",
            "loaded": self.loaded,
            "loads": self.loads,
            "releases": self.releases,
            "cache": {"documents": documents, "bytes": 0},
            "acceptance": {"lookup": {"proposed": 2 * self.completions, "accepted": self.completions}},
        }

    def release(self) -> None:
        self.loaded = False
        self.releases += 1

    def ensure_loaded(self) -> None:
        if not self.loaded:
            self.loaded = True
            self.loads += 1


def fake(cfg: Any) -> FakeEngine:
    return FakeEngine.from_config(cfg)


class SlowCapableEngine:
    """The real engine, plus the ``#slow`` hold in front of complete()."""

    def __init__(self, engine: Any):
        self._engine = engine

    def complete(self, req: CompletionRequest, cancel: threading.Event | None = None) -> CompletionResult:
        text = req.text if req.text is not None else ""
        hold_if_slow(req, text, cancel)
        return self._engine.complete(req, cancel)

    def complete_steps(self, req: CompletionRequest, cancel: threading.Event | None = None):
        """The real engine's steps, after the same hold (which holds the worker, as a long
        forward would)."""
        hold_if_slow(req, req.text if req.text is not None else "", cancel)
        return (yield from self._engine.complete_steps(req, cancel))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)


def real(cfg: Any) -> SlowCapableEngine:
    from specd.engine import load_engine

    return SlowCapableEngine(load_engine(cfg))


class FreeDraftingEngine(SlowCapableEngine):
    """The real engine whose planner believes drafts cost nothing and every verify width costs
    the same (``engine_helpers.make_drafting_free``), set again after every load: a test of
    which source drafted must not hang on forward costs timed on a loaded machine."""

    def ensure_loaded(self) -> None:
        fresh = not self._engine.loaded
        self._engine.ensure_loaded()
        if fresh:
            from engine_helpers import make_drafting_free

            make_drafting_free(self._engine)


def real_free_drafting(cfg: Any) -> FreeDraftingEngine:
    from specd.engine import load_engine

    return FreeDraftingEngine(load_engine(cfg))


STREAMED_TEXT = "x = 1\n    y = 2\n    z = x + y\n    return z"
STREAM_STEP_S = float(os.environ.get("SPECD_TEST_STREAM_STEP_S", "0.05"))


class StreamingFakeEngine(FakeEngine):
    """The fake engine as a stepped one: it writes ``STREAMED_TEXT`` three characters a step,
    ``STREAM_STEP_S`` apart, so a streamed complete's lines settle one after another and the
    result comes well after the first line."""

    def complete_steps(self, req: CompletionRequest, cancel: threading.Event | None = None):
        from specd.engine.types import Progress

        written = 0
        while written < len(STREAMED_TEXT):
            if cancel is not None and cancel.wait(STREAM_STEP_S):
                raise Cancelled("cancelled")
            written = min(written + 3, len(STREAMED_TEXT))
            yield Progress(tokens=written, read_text=lambda n=written: STREAMED_TEXT[:n])
        self.completions += 1
        return CompletionResult(text=STREAMED_TEXT, token_ids=list(range(len(STREAMED_TEXT))), prompt_ids=[1],
                                stop_reason="max_tokens", target_forwards=1, sources={})


def streaming(cfg: Any) -> StreamingFakeEngine:
    return StreamingFakeEngine.from_config(cfg)
