"""An engine that fails on demand, for tests of how completion errors reach the user.

Load it with ``SPECD_TEST_ENGINE_FACTORY=failing_engine:failing``. It is the model-free fake
engine (tests/fake_engine.py), except that a completion whose line before the cursor holds
``#fail:<word>`` raises ``EngineError("engine broke on <word>")``: the daemon answers it with
``engine_error``, as it would a real engine's failure.
"""

from __future__ import annotations

import re
import threading
from typing import Any

from fake_engine import FakeEngine
from specd.engine.types import CompletionRequest, CompletionResult, EngineError

FAIL_MARKER = re.compile(r"#fail:(\w+)")


class FailingEngine(FakeEngine):
    def complete(self, req: CompletionRequest, cancel: threading.Event | None = None) -> CompletionResult:
        text = req.text if req.text is not None else self.documents.get(req.uri or "", "")
        offset = req.offset if req.offset is not None else len(text)
        line = text[text.rfind("\n", 0, offset) + 1:offset]
        if (marker := FAIL_MARKER.search(line)) is not None:
            raise EngineError(f"engine broke on {marker.group(1)}")
        return super().complete(req, cancel)


def failing(cfg: Any) -> FailingEngine:
    return FailingEngine.from_config(cfg)
