"""specd-lsp's daemon link against the daemon's limits: it learns them at hello, keeps a file
over them out (so one huge file costs nothing but itself: docs/reliability.md), and never
reconnects in a tight loop. Also the document
mirror: 1,000 content changes in one didChange are one pass."""

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
    """One didChange with 1,000 content changes on a 1 MiB file left specd-lsp deaf for 61 s."""
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
