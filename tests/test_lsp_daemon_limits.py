"""specd-lsp's daemon link against the daemon's limits: it learns them at hello, keeps a file
over them out (so one huge file costs nothing but itself: docs/reliability.md), and never
reconnects in a tight loop. Also the document
mirror: 1,000 content changes in one didChange are one pass, in the store and through specd-lsp."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from daemon_helpers import DaemonProcess
from specd.protocol import ErrorCode, RpcError, pack
from specd_lsp.daemon_link import READY, DaemonLink
from specd_lsp.documents import DocumentStore
from specd_lsp.options import DaemonSettings
from specd_lsp.positions import TextIndex

LIMITS = {"daemon.max_frame_bytes": 256 * 1024, "daemon.max_document_bytes": 128 * 1024}


def _link(socket_path, documents: DocumentStore) -> DaemonLink:
    return DaemonLink(documents, lambda: DaemonSettings(socket=str(socket_path), spawn=False),
                      load_config=lambda settings: SimpleNamespace(socket_path=str(socket_path)))


async def _wait(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


@pytest.fixture
def small_daemon(tmp_path):
    d = DaemonProcess(tmp_path / "d", config=LIMITS).start()
    yield d
    d.stop()


@pytest.mark.asyncio
async def test_a_file_over_the_limits_stays_out_and_others_complete(small_daemon):
    documents = DocumentStore()
    link = _link(small_daemon.socket_path, documents)
    link.start()
    try:
        await _wait(lambda: link.state == READY)
        assert link.limits["max_document_bytes"] == LIMITS["daemon.max_document_bytes"]
        huge = documents.open("file:///huge.py", "x = 1\n" * 200_000, 1)  # 1.2 MB
        small = documents.open("file:///small.py", "abc", 1)
        link.open(huge)
        link.open(small)
        for _ in range(20):
            huge.text += "y = 2\n"
            huge.version += 1
            link.change(huge, [{"start": len(huge.text) - 6, "end": len(huge.text) - 6, "text": "y = 2\n"}])
            result = await link.complete({"uri": small.uri, "cursor": {"offset": 3}}, 5)
            assert result["text"] == "[abc]"
        with pytest.raises(RpcError) as info:
            await link.complete({"uri": huge.uri, "cursor": {"offset": 3}}, 5)
        assert info.value.code == ErrorCode.DOCUMENT_TOO_LARGE.value
        assert link.connects == 1, "the link reconnected"
        status = await link.status()
        assert status["documents"]["open"] == 1
        # an edit that brings it under the limits sends it whole
        huge.text, huge.version = "def f():\n    return 1\n", huge.version + 1
        link.change(huge, [{"text": huge.text}])
        result = await link.complete({"uri": huge.uri, "cursor": {"offset": 8}}, 5)
        assert result["text"] == "[def f():]"
        assert link.connects == 1
    finally:
        await link.close()


@pytest.mark.asyncio
async def test_a_document_over_the_open_bytes_budget_is_kept_out_until_room_is_made(tmp_path):
    """The daemon refuses a document for its byte budget: specd-lsp keeps it out (no whole-text
    resend per edit), other documents complete, and once another document is closed the next
    edit sends it whole and it completes."""
    daemon = DaemonProcess(tmp_path / "d", config={"daemon.max_open_bytes_per_connection": 64 * 1024}).start()
    documents = DocumentStore()
    link = _link(daemon.socket_path, documents)
    link.start()
    try:
        await _wait(lambda: link.state == READY)
        first = documents.open("file:///first.py", "a = 1\n" * 7000, 1)  # 42 KB
        second = documents.open("file:///second.py", "b = 2\n" * 7000, 1)  # 42 KB more: over 64 KiB
        link.open(first)
        link.open(second)
        await _wait(lambda: second.uri in link.held_out)
        with pytest.raises(RpcError) as info:
            await link.complete({"uri": second.uri, "cursor": {"offset": 3}}, 5)
        assert info.value.code == ErrorCode.DOCUMENT_TOO_LARGE.value and "budget" in info.value.message
        sent = []
        real_send = link._send
        link._send = lambda method, params, doc=None: (sent.append(method), real_send(method, params, doc))
        for n in range(20):  # typing in it: nothing is sent while it would be refused again
            second.text += "c\n"
            second.version += 1
            link.change(second, [{"start": len(second.text) - 2, "end": len(second.text) - 2, "text": "c\n"}])
        assert sent == [], f"sent {sent} while over the budget"
        assert (await link.status())["documents"]["open"] == 1
        result = await link.complete({"uri": first.uri, "cursor": {"offset": 3}}, 5)
        assert result["text"] == "[a =]"
        link.close_document(first.uri)
        documents.close(first.uri)
        second.text += "d\n"
        second.version += 1
        link.change(second, [{"start": len(second.text) - 2, "end": len(second.text) - 2, "text": "d\n"}])
        result = await link.complete({"uri": second.uri, "cursor": {"offset": 3}}, 5)
        assert result["text"] == "[b =]"
        assert second.uri not in link.held_out and link.connects == 1
    finally:
        await link.close()
        daemon.stop()


@pytest.mark.asyncio
async def test_a_daemon_that_keeps_closing_is_not_reconnected_in_a_loop(tmp_path):
    """A server that answers hello as ready and then closes at once: the link backs off."""
    path = tmp_path / "closing.sock"
    accepted = 0

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal accepted
        accepted += 1
        data = await reader.read(65536)  # the hello request: [0, msgid, "hello", [...]]
        msgid = data[1] if len(data) > 1 and data[1] < 0x80 else 1
        writer.write(pack([1, msgid, None, {"state": "ready", "limits": {"max_frame_bytes": 1 << 20}}]))
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.close()

    server = await asyncio.start_unix_server(serve, path=str(path))
    link = _link(path, DocumentStore())
    link.start()
    try:
        await asyncio.sleep(3.0)
    finally:
        await link.close()
        server.close()
    assert 1 <= accepted <= 5, f"{accepted} connections in 3 s"


def test_many_content_changes_apply_in_one_pass():
    """One didChange with 1,000 content changes on a 1 MiB file: one pass over the text."""
    line = "value = compute(alpha)\n"
    text = line * (2**20 // len(line))
    changes = []
    for number in range(1000):
        at = (number * 37) % 40_000
        changes.append({"range": {"start": {"line": at, "character": 0}, "end": {"line": at, "character": 5}},
                        "text": f"v{number}\n" if number % 3 == 0 else f"v{number}"})
    doc = DocumentStore().open("file:///big.py", text, 1)
    started = time.perf_counter()
    for change in changes:
        doc.apply(change)
    elapsed = time.perf_counter() - started
    assert elapsed < 5.0, f"{elapsed:.2f} s for 1,000 changes"
    assert doc.index.line_starts == TextIndex(doc.text).line_starts
    # the same as applying them one by one on fresh indexes (checked on the first 50)
    check = DocumentStore().open("file:///check.py", text, 1)
    expected = text
    for change in changes[:50]:
        check.apply(change)
        index = TextIndex(expected)
        start = index.offset(change["range"]["start"]["line"], 0)
        end = index.offset(change["range"]["end"]["line"], 5)
        expected = expected[:start] + change["text"] + expected[end:]
    assert check.text == expected


@pytest.mark.asyncio
async def test_a_didchange_of_a_thousand_changes_through_specd_lsp(tmp_path):
    """The real specd-lsp process: "replace all" on a 1.6 MB, 100,000-line file is answered in
    one pass (pygls's own copy of the text would be rebuilt per change: specd-lsp keeps none),
    and the daemon's copy has every edit."""
    from lsprotocol import types

    from lsp_helpers import link_options, lsp_session, server_env

    uri = "file:///work/big.py"
    text = "".join(f"a_{i} = {i}\n" for i in range(100_000))
    changes = [types.TextDocumentContentChangePartial(
        range=types.Range(types.Position(i * 97, 0), types.Position(i * 97, 1)), text="b") for i in range(1000)]
    daemon = DaemonProcess(tmp_path / "d").start()  # the default limits: an 8 MiB document fits
    try:
        async with lsp_session(server_env(tmp_path), link_options(daemon)) as session:
            session.open(uri, text)
            await session.status()
            session.versions[uri] += 1
            started = time.monotonic()
            session.client.text_document_did_change(types.DidChangeTextDocumentParams(
                types.VersionedTextDocumentIdentifier(uri=uri, version=session.versions[uri]), changes))
            await session.status()  # answered once the didChange before it is applied
            answered_s = time.monotonic() - started
            # The fake engine answers "[<text before the cursor>]": the daemon's copy has the edits.
            first = await session.inline(uri, 0, 3)
            later = await session.inline(uri, 97 * 999, 7)
    finally:
        daemon.stop()
    assert answered_s < 5.0, f"specd-lsp answered {answered_s:.2f} s after the didChange"
    assert [item.insert_text for item in first] == ["[b_0]"]
    assert [item.insert_text[-9:] for item in later] == ["\nb_96903]"]
