"""The daemon's document mirror: the engine hears each document's latest text, and a cursor's
focus after the text it was given on (``DocumentMirror.focus``)."""

from __future__ import annotations

import threading
import time

import pytest

from specd.daemon.worker import DocumentMirror


class RecordingEngine:
    def __init__(self):
        self.calls: list[tuple] = []
        self.lock = threading.Lock()

    def _record(self, *call):
        with self.lock:
            self.calls.append(call)

    def open_document(self, uri, text):
        self._record("open", uri, text)

    def update_document(self, uri, text, cursor=None):
        self._record("update", uri, text, cursor)

    def close_document(self, uri):
        self._record("close", uri)

    def focus_document(self, uri, offset):
        self._record("focus", uri, offset)
        return True


class Worker:
    def __init__(self, engine):
        self.engine = engine
        self.woken = 0

    def wake(self):
        self.woken += 1


def settled(engine, count, timeout=5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with engine.lock:
            if len(engine.calls) >= count:
                return list(engine.calls)
        time.sleep(0.005)
    raise AssertionError(f"the engine heard {engine.calls}, not {count} calls")


@pytest.fixture
def mirrored():
    """(a recording engine, the mirror that feeds it)."""
    engine = RecordingEngine()
    mirror = DocumentMirror(Worker(engine))
    mirror.start()
    yield engine, mirror
    mirror.stop()


def test_a_focus_reaches_the_engine_after_the_text_it_was_given_on(mirrored):
    engine, mirror = mirrored
    mirror.set("a", "hello world")
    mirror.focus("a", 5)  # before the mirror sent the open: it follows it
    assert settled(engine, 2) == [("open", "a", "hello world"), ("focus", "a", 5)]
    mirror.focus("a", 3)  # a focus alone on a document the engine holds
    assert settled(engine, 3)[-1] == ("focus", "a", 3)
    mirror.focus("never-opened", 0)  # the engine never held it: nothing to prefill
    mirror.set("a", "hello there", 11)
    assert settled(engine, 4)[-1] == ("update", "a", "hello there", 11)
    time.sleep(0.05)
    assert [call for call in engine.calls if call[1] == "never-opened"] == []


def test_a_focus_on_a_document_closing_is_moot(mirrored):
    engine, mirror = mirrored
    mirror.set("a", "text")
    settled(engine, 1)
    mirror.close("a")  # a focus after a close: whether the close was sent yet or not, moot
    mirror.focus("a", 2)
    calls = settled(engine, 2)
    time.sleep(0.05)
    assert engine.calls == [("open", "a", "text"), ("close", "a")], calls
