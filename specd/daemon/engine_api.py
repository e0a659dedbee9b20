"""What the daemon needs of an engine: the contract ``specd.engine.Engine`` (and the tests'
fake engines) fulfil. The daemon's loop calls none of it; the model worker and the document
mirror do, on their threads."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from specd.engine.types import CompletionRequest, CompletionResult


@runtime_checkable
class CompletionEngine(Protocol):
    def complete(self, req: CompletionRequest, cancel: threading.Event | None = None) -> CompletionResult: ...

    def stats(self) -> dict[str, Any]: ...

    def open_document(self, uri: str, text: str) -> None: ...

    def update_document(self, uri: str, text: str, cursor: int | None = None) -> None: ...

    def close_document(self, uri: str) -> None: ...

    def release(self) -> None: ...

    def ensure_loaded(self) -> None: ...


@runtime_checkable
class CorpusEngine(Protocol):
    """An engine whose prompt lookup also searches workspace files."""

    def set_corpus_file(self, name: str, text: str | None) -> None: ...
