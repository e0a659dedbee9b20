"""What open documents cost: the byte budgets (all documents, and each connection's), the
memory each structure holds per MiB of text (tracemalloc, in process), and the daemon's RSS
after large documents are opened, edited and closed. Figures: docs/reliability.md."""

from __future__ import annotations

import asyncio
import gc
import time
import tracemalloc
from types import SimpleNamespace

import pytest

from daemon_helpers import DaemonProcess, wait_for
from specd.daemon.buffers import BufferStore, TextIndex, index_in_steps
from specd.daemon.handlers.documents import DocumentLocks, DocumentMethods
from specd.daemon.heap import ClosedMemory, trim_heap
from specd.daemon.params import parse_change, parse_close, parse_edits, parse_open
from specd.engine.front.corpus import OpenBuffers
from specd.engine.front.documents import Documents
from specd.engine.lookup import NgramIndex
from specd.protocol.errors import ErrorCode, RpcError

MiB = 1 << 20


def short_lines(size: int = MiB, seed: int = 0) -> str:
    """``size`` characters of ~6-character lines (the costliest shape for a line index)."""
    text = "".join(f"v={(i * 7 + seed) % 997}\n" for i in range(size // 4))[:size]
    return text[:text.rfind("\n") + 1]


def traced(build):
    """(what ``build`` returned, bytes it left allocated)."""
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        kept = build()
        return kept, tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()


def char_tokens(text: str) -> list[int]:
    """One token per character (the demo pair's tokenizer is about that): the most tokens a
    text can have, so the costliest case for token stores."""
    return [ord(char) % 500 for char in text]


# -- the budgets ---------------------------------------------------------------------------


def refused(code: ErrorCode, fn, *args, **kwargs) -> RpcError:
    with pytest.raises(RpcError) as info:
        fn(*args, **kwargs)
    assert info.value.code == code.value, info.value
    return info.value


def test_byte_budgets_refuse_whole_and_lose_nothing():
    store = BufferStore(max_documents=10, max_document_bytes=100, max_open_bytes=250, max_open_bytes_per_connection=150)
    store.open("a", "x" * 100, 1, owner=1)
    err = refused(ErrorCode.TOO_MANY_DOCUMENT_BYTES, store.open, "b", "é" * 30, 1, owner=1)  # 60 bytes of UTF-8
    assert "daemon.max_open_bytes_per_connection" in err.message and err.data["limit"] == 150
    store.open("b", "y" * 50, 1, owner=1)  # exactly the connection's budget
    store.open("c", "z" * 100, 1, owner=2)
    err = refused(ErrorCode.TOO_MANY_DOCUMENT_BYTES, store.open, "d", "w" * 10, 1, owner=3)
    assert "daemon.max_open_bytes" in err.message and err.data == {"bytes": 10, "total": 260, "limit": 250}
    assert "d" not in store.docs
    # A change that would go over is refused, the document keeps its text and version.
    err = refused(ErrorCode.TOO_MANY_DOCUMENT_BYTES, store.change, "b", 2,
                  parse_edits([{"start": 0, "end": 0, "text": "more"}], "utf-32"), None)
    assert store.get("b").text == "y" * 50 and store.get("b").version == 1
    store.change("b", 2, parse_edits([{"start": 0, "end": 10, "text": "é"}], "utf-32"), None)  # 40 + 2 bytes
    assert store.sizes["b"] == 42 and store.owner_bytes[1] == 142
    # A second holder counts the document in full; reopening replaces its size for both.
    refused(ErrorCode.TOO_MANY_DOCUMENT_BYTES, store.open, "a", "x" * 100, 1, owner=2)  # 2 would hold 200
    assert store.get("a").owners == {1} and (store.open_bytes, store.owner_bytes) == (242, {1: 142, 2: 100})


def test_byte_budget_accounting_follows_owners():
    store = BufferStore(max_documents=10, max_document_bytes=100, max_open_bytes=400, max_open_bytes_per_connection=150)
    store.open("a", "x" * 100, 1, owner=1)
    store.open("b", "y" * 40, 1, owner=2)
    store.open("b", "y" * 40, 1, owner=1)  # a second holder: counted for both, once in all
    assert (store.open_bytes, store.owner_bytes) == (140, {1: 140, 2: 40})
    err = refused(ErrorCode.TOO_MANY_DOCUMENT_BYTES, store.change, "b", 2, None, "y" * 60)  # 1 would hold 160
    assert "daemon.max_open_bytes_per_connection" in err.message
    assert store.get("b").text == "y" * 40
    store.change("b", 2, None, "y" * 50)
    assert (store.open_bytes, store.owner_bytes) == (150, {1: 150, 2: 50})
    assert store.close("b", owner=1) is False
    assert (store.open_bytes, store.owner_bytes) == (150, {1: 100, 2: 50})
    assert store.release_owner(2) == ["b"]
    assert store.release_owner(1) == ["a"]
    assert (store.open_bytes, store.owner_bytes, store.sizes) == (0, {}, {})
    assert store.stats(1) == {"open": 0, "chars": 0, "bytes": 0, "max_bytes": 400, "max_bytes_per_connection": 150,
                              "connection_bytes": 0}


def test_an_open_keeps_only_the_text_and_the_first_ranged_edit_builds_the_line_index():
    """The daemon builds a document's line index for the first request that needs one (a
    ranged edit, a line cursor), in steps; an open alone costs the text."""
    store = BufferStore(max_documents=4, max_document_bytes=4 * MiB)
    sent = []
    methods = DocumentMethods(store, DocumentLocks(), SimpleNamespace(set=lambda *a: sent.append(a), close=sent.append),
                              on_closed=lambda uri: None, waiting_on_thread=lambda: False)
    conn = SimpleNamespace(id=7)
    text = short_lines(MiB)

    async def scenario():
        await methods.open(conn, parse_open({"uri": "file:///a", "text": text, "version": 1}), 1)
        doc = store.get("file:///a")
        assert not doc.index.built and doc.index.nbytes() == 0
        edit = {"range": {"start": {"line": 1000, "character": 0}, "end": {"line": 1000, "character": 0}}, "text": "w\n"}
        await methods.change(conn, parse_change({"uri": "file:///a", "version": 2, "edits": [edit]}), 2)
        assert doc.index.built and doc.index.line_start(1001) == TextIndex(doc.text).line_start(1001)
        await methods.close(conn, parse_close({"uri": "file:///a"}), 3)

    asyncio.run(scenario())
    assert len(store) == 0 and store.open_bytes == 0


# -- bytes per MiB of text -----------------------------------------------------------------


def test_the_line_index_costs_about_4_bytes_a_line():
    text = short_lines(MiB)  # ~190k lines
    index, cost = traced(lambda: (lambda i: (i.line_count, i))(TextIndex(text))[1])
    assert cost < 1.5 * MiB, cost  # was ~7.6 MiB: a Python int and a pointer per line, twice
    assert index.nbytes() <= 4 * index.line_count + 1024
    stepped, cost = traced(lambda: asyncio.run(index_in_steps(text)))
    assert cost < 1.5 * MiB, cost
    edited, cost = traced(lambda: stepped.replace(1000, 1000, "x\n" * 500))
    assert edited.line_count == stepped.line_count + 500
    assert cost < 2 * MiB + 0.5 * MiB, cost  # the new text (1 MiB) and the rebuilt blocks, others shared


def test_token_stores_cost_a_small_multiple_of_the_text():
    text = short_lines(MiB // 4)
    tokens = char_tokens(text)
    index, cost = traced(lambda: NgramIndex(tokens))
    assert cost / len(tokens) < 8 + 2, cost / len(tokens)  # two 4-byte arrays, and few distinct bigrams here
    buffers = OpenBuffers(searched=2)

    def indexed():
        buffers.set("file:///a", text)
        buffers.set("file:///a", text + "x\n")  # an edit: worth tokens
        while buffers.index_pending(char_tokens, 1.0):
            pass
        return buffers

    _, cost = traced(indexed)
    assert buffers.stats()["indexed"] == 1
    assert cost / len(tokens) < 4 + 8 + 3, cost / len(tokens)  # pieces' tokens, the index, the text itself


def test_opened_buffers_hold_no_tokens_until_a_request_touches_them():
    buffers = OpenBuffers(searched=8)
    texts = {f"file:///{n}.py": short_lines(64 * 1024, n) for n in range(20)}
    for uri, text in texts.items():
        buffers.set(uri, text)
    assert not buffers.index_pending(char_tokens, 1.0)  # nothing to do: only opened
    assert buffers.stats()["indexed_tokens"] == 0
    buffers.indexes("file:///19.py", char_tokens)  # a completion there wants the 8 most recent others
    while buffers.index_pending(char_tokens, 1.0):
        pass
    assert buffers.stats()["indexed"] == 9  # those 8, and the one completed in


def test_open_buffer_tokens_are_bounded_in_characters_together():
    buffers = OpenBuffers(searched=8, max_indexed_chars=5 * 32 * 1024)  # room for two and a half
    for n in range(6):
        text = short_lines(64 * 1024, n)
        buffers.set(f"file:///{n}.py", text)
        buffers.set(f"file:///{n}.py", text + "x\n")
    while buffers.index_pending(char_tokens, 1.0):
        pass
    kept = [uri for uri, buffer in buffers._buffers.items() if buffer.index is not None]
    assert kept == ["file:///4.py", "file:///5.py"]  # the two most recent fit; a third would not


def test_the_engine_copy_of_a_document_shares_the_daemon_text():
    documents = Documents()
    text = short_lines(MiB)
    _, cost = traced(lambda: documents.open("file:///a", text))
    assert cost < 4096 and documents.text("file:///a") is text


def test_closed_memory_trims_once_enough_is_freed():
    trims = []
    memory = ClosedMemory(threshold=100, trim=lambda: trims.append(1) or True)
    memory.closed(60)
    memory.settle()
    assert trims == []
    memory.closed(60)
    memory.settle()
    memory.settle()
    assert trims == [1] and memory.trims == 1 and memory.freed == 0
    assert isinstance(trim_heap(), bool)


# -- the daemon ----------------------------------------------------------------------------


def test_the_daemon_refuses_documents_over_its_budgets_and_reports_them(tmp_path):
    d = DaemonProcess(tmp_path, config={"daemon.max_open_bytes": 3 * MiB, "daemon.max_open_bytes_per_connection": 2 * MiB,
                                        "daemon.max_document_bytes": MiB, "daemon.max_frame_bytes": 2 * MiB,
                                        "log.level": "warning"}).start()
    text = "x" * (MiB - 16)
    try:
        with d.client() as one, d.client() as two:
            limits = one.hello()["limits"]
            assert (limits["max_open_bytes"], limits["max_open_bytes_per_connection"]) == (3 * MiB, 2 * MiB)
            one.open_document("file:///a", text)
            one.open_document("file:///b", text)
            err = refused(ErrorCode.TOO_MANY_DOCUMENT_BYTES, one.open_document, "file:///c", text)
            assert "daemon.max_open_bytes_per_connection" in err.message
            two.open_document("file:///c", text)
            err = refused(ErrorCode.TOO_MANY_DOCUMENT_BYTES, two.open_document, "file:///d", "y" * 100_000)
            assert "(daemon.max_open_bytes)" in err.message
            assert one.complete("file:///a", {"line": 0, "character": 5})["text"] == "[xxxxx]"  # nothing else lost
            documents = one.status()["documents"]
            assert documents["bytes"] == 3 * len(text) and documents["connection_bytes"] == 2 * len(text)
            assert documents["max_bytes"] == 3 * MiB and documents["max_bytes_per_connection"] == 2 * MiB
            one.close_document("file:///a")
            two.open_document("file:///d", "y" * 100_000)
    finally:
        d.stop()


def test_rss_stays_near_the_text_and_comes_back_after_closing(tmp_path):
    """48 documents of 1 MiB of short lines, each edited (so its line index is built): the
    daemon grows by at most 3x the text, and 10 s after closing them it is back within 48 MiB
    of where it started (wide bounds: RSS on a busy machine)."""
    count = 48
    d = DaemonProcess(tmp_path, config={"log.level": "warning"}).start()
    try:
        with d.client() as client:
            client.status()
            time.sleep(0.5)
            baseline = d.rss_mb()
            texts = [short_lines(MiB, n) for n in range(count)]
            for n, text in enumerate(texts):
                uri = f"file:///m/{n}.py"
                client.open_document(uri, text, version=1)
                client.change_document(uri, 2, edits=[{"range": {"start": {"line": 5000, "character": 0},
                                                                 "end": {"line": 5000, "character": 0}}, "text": "e\n"}])
            grown = d.rss_mb() - baseline
            for n in range(count):
                client.close_document(f"file:///m/{n}.py")
            del texts
            wait_for(lambda: d.rss_mb() - baseline < 48, timeout=10, interval=0.25, message="RSS back near its baseline")
        print(f"\nRSS {baseline:.0f} MiB, +{grown:.0f} MiB for {count} MiB of text, "
              f"+{d.rss_mb() - baseline:.0f} MiB after closing")
        assert grown < 3 * count, grown
    finally:
        d.stop()
