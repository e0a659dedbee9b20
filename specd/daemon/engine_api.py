"""What the daemon needs of an engine: the contract ``specd.engine.Engine`` (and the tests'
fake engines) fulfil. The model worker and the document mirror call it, on their threads; the
daemon's loop calls only a ``StatsOnLoop`` engine's ``stats()``.

``CompletionEngine`` is required. The rest is optional, each a protocol of its own that an
engine offers by defining its method: ``SteppedEngine`` (completions the worker can interleave
and stream), ``StatsOnLoop`` (figures cheap enough for the loop), ``CorpusEngine`` (workspace
files for lookup) and the
idle work the worker runs between jobs (``idle_work``, in priority order). An engine that
defines none of them has no idle work; the worker checks with ``isinstance``."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Callable, Generator, Protocol, runtime_checkable

if TYPE_CHECKING:
    from specd.engine.types import CompletionRequest, CompletionResult, Progress


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
class SteppedEngine(Protocol):
    """An engine whose completions run step by step, so the worker can interleave them."""

    def complete_steps(self, req: CompletionRequest, cancel: threading.Event | None = None
                       ) -> Generator[Progress, None, CompletionResult]: ...


def completion_steps(engine: CompletionEngine, req: CompletionRequest,
                     cancel: threading.Event) -> Generator[Progress, None, CompletionResult]:
    """``req`` on ``engine`` as steps: the engine's own where it has them, else one step."""
    if isinstance(engine, SteppedEngine):
        return (yield from engine.complete_steps(req, cancel))
    return engine.complete(req, cancel)


@runtime_checkable
class StatsOnLoop(Protocol):
    """An engine whose ``stats()`` is cheap (well under a millisecond) and never waits on the
    model thread (its locks are held only briefly), so ``status`` calls it on the event loop:
    there, a thread's round trip costs several milliseconds whenever the model thread and the
    loop are busy. Engines without it (or with it False) are asked on a thread."""

    stats_on_loop: bool


@runtime_checkable
class FocusesDocuments(Protocol):
    """An engine that prefills, in idle time, where an editor's cursor came to rest."""

    def focus_document(self, uri: str, offset: int) -> bool: ...


@runtime_checkable
class CorpusEngine(Protocol):
    """An engine whose prompt lookup also searches workspace files."""

    def set_corpus_file(self, name: str, text: str | None) -> None: ...


# -- idle work: each method does about ``budget_s`` seconds of its work and returns True while
# more remains. The worker calls them between jobs, in ``idle_work``'s order.


@runtime_checkable
class PrefillsPending(Protocol):
    def prefill_pending(self, budget_s: float) -> bool:
        """Prefill the cache of the document edited last, where its last edit ended."""


@runtime_checkable
class IndexesBuffers(Protocol):
    def index_pending_buffers(self, budget_s: float) -> bool:
        """Re-tokenize the edited parts of open buffers for lookup."""


@runtime_checkable
class IndexesCorpus(Protocol):
    def index_pending_corpus(self, budget_s: float) -> bool:
        """Tokenize workspace files for lookup."""


@runtime_checkable
class WarmsContext(Protocol):
    def warm_context(self, budget_s: float) -> bool:
        """Prefill a document's cache with a new set of context chunks."""


IdleStep = Callable[[float], bool]


def idle_work(engine: object) -> list[IdleStep]:
    """The idle work ``engine`` offers, in priority order."""
    work: list[IdleStep] = []
    if isinstance(engine, PrefillsPending):
        work.append(engine.prefill_pending)
    if isinstance(engine, IndexesBuffers):
        work.append(engine.index_pending_buffers)
    if isinstance(engine, IndexesCorpus):
        work.append(engine.index_pending_corpus)
    if isinstance(engine, WarmsContext):
        work.append(engine.warm_context)
    return work
