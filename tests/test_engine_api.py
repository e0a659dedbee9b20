"""What the daemon's model worker calls on an engine is declared (specd.daemon.engine_api), and
the engines declare it: a renamed idle method fails here, not silently in the worker."""

from __future__ import annotations

from fake_engine import FakeEngine
from specd.daemon.engine_api import (
    CompletionEngine,
    CorpusEngine,
    IndexesBuffers,
    IndexesCorpus,
    PrefillsPending,
    WarmsContext,
    idle_work,
)

IDLE = (PrefillsPending, IndexesBuffers, IndexesCorpus, WarmsContext)


def test_the_local_engine_declares_all_idle_work():
    from specd.engine.engine import Engine

    assert issubclass(Engine, CompletionEngine) and issubclass(Engine, CorpusEngine)
    assert all(issubclass(Engine, protocol) for protocol in IDLE)


def test_the_remote_engine_declares_warming_only():
    from specd.engine.remote.engine import RemoteEngine

    assert issubclass(RemoteEngine, CompletionEngine) and issubclass(RemoteEngine, CorpusEngine)
    assert [protocol for protocol in IDLE if issubclass(RemoteEngine, protocol)] == [WarmsContext]


def test_the_fake_engine_has_no_idle_work():
    engine = FakeEngine(cfg=None)
    assert isinstance(engine, CompletionEngine)
    assert idle_work(engine) == []


def test_idle_work_runs_in_priority_order():
    class Busy:
        def warm_context(self, budget_s: float) -> bool: return False
        def index_pending_corpus(self, budget_s: float) -> bool: return False
        def index_pending_buffers(self, budget_s: float) -> bool: return False
        def prefill_pending(self, budget_s: float) -> bool: return False

    names = [work.__name__ for work in idle_work(Busy())]
    assert names == ["prefill_pending", "index_pending_buffers", "index_pending_corpus", "warm_context"]
