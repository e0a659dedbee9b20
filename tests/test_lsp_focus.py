"""The cursor hint: an editor plugin's ``specd/didFocus`` (the cursor came to rest) reaches the
daemon as ``focus``, with the cursor in code points, once per line, only for documents the
daemon holds, and the last one again once a daemon that was not there is ready. specd-lsp talks
to a recording stand-in for the daemon here, so each test checks exactly what went over the
socket; one test runs against the real daemon, which counts the ``focus`` calls it took."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from types import SimpleNamespace
from typing import Any, AsyncIterator

import pytest
from lsprotocol import types

from lsp_helpers import inline_capabilities, link_options, lsp_session, poll, server_env
from specd.protocol import FrameDecoder, MessageType, pack
from specd.protocol.methods import LSP_FOCUS_NOTIFICATION, Method

pytestmark = pytest.mark.asyncio

URI = "file:///work/focus.py"
# Line 1 holds a character outside the BMP: two UTF-16 units, one code point.
TEXT = "import os\nname = '𝔸' + x\n\ndef main():\n    pass\n"


class RecordingDaemon:
    """Answers like a ready daemon (hello, status, document sync) and records every message."""

    def __init__(self, path: Path):
        self.path = path
        self.messages: list[tuple[str, str, dict[str, Any]]] = []  # (request|notification, method, params)
        self.arrived = asyncio.Event()
        self._server: asyncio.AbstractServer | None = None

    async def start(self) -> RecordingDaemon:
        self._server = await asyncio.start_unix_server(self._serve, path=str(self.path))
        return self

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    def focuses(self) -> list[dict[str, Any]]:
        return [params for _, method, params in self.messages if method == Method.FOCUS.value]

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        decoder = FrameDecoder(1 << 24)
        with contextlib.suppress(ConnectionError):
            while data := await reader.read(65536):
                for message in decoder.feed(data):
                    if message[0] == MessageType.REQUEST:
                        _, msgid, method, params = message
                        self._record("request", method, params)
                        writer.write(pack([MessageType.RESPONSE, msgid, None, self._answer(method)]))
                    elif message[0] == MessageType.NOTIFICATION:
                        self._record("notification", message[1], message[2])
                await writer.drain()
        writer.close()

    def _record(self, kind: str, method: str, params: list[Any]) -> None:
        self.messages.append((kind, method, params[0] if params else {}))
        self.arrived.set()

    @staticmethod
    def _answer(method: str) -> Any:
        if method in (Method.HELLO.value, Method.STATUS.value):
            return {"state": "ready", "limits": {"max_frame_bytes": 1 << 24}}
        if method == Method.FOCUS.value:
            return {"uri": URI, "focused": True}
        return {}


@contextlib.asynccontextmanager
async def recording_daemon(tmp_path: Path) -> AsyncIterator[RecordingDaemon]:
    daemon = await RecordingDaemon(tmp_path / "d.sock").start()
    try:
        yield daemon
    finally:
        await daemon.stop()


def focus(session, uri: str, line: int, character: int) -> None:
    session.client.protocol.notify(LSP_FOCUS_NOTIFICATION, {
        "textDocument": {"uri": uri}, "position": {"line": line, "character": character}})


async def wait_focuses(daemon: RecordingDaemon, count: int, timeout: float = 20.0) -> list[dict[str, Any]]:
    """The focus messages, once ``count`` have arrived."""
    async def arrived() -> None:
        while len(daemon.focuses()) < count:
            daemon.arrived.clear()
            await daemon.arrived.wait()

    try:
        await asyncio.wait_for(arrived(), timeout)
    except asyncio.TimeoutError:
        raise AssertionError(f"{count} focus messages expected; the daemon got {daemon.messages}") from None
    return daemon.focuses()


def expected(line: int, character: int, uri: str = URI) -> dict[str, Any]:
    return {"uri": uri, "cursor": {"line": line, "character": character}, "encoding": "utf-32"}


async def test_a_cursor_hint_reaches_the_daemon_in_code_points(tmp_path):
    async with recording_daemon(tmp_path) as daemon, \
            lsp_session(server_env(tmp_path), link_options(SimpleNamespace(socket_path=daemon.path)),
                        inline_capabilities(["utf-16"])) as session:
        assert session.init_result.capabilities.position_encoding == types.PositionEncodingKind.Utf16
        session.open(URI, TEXT)
        focus(session, URI, 1, 11)  # after "name = '𝔸'": 11 UTF-16 units, 10 code points
        [sent] = await wait_focuses(daemon, 1)
        assert sent == expected(1, 10)
        kinds = [kind for kind, method, _ in daemon.messages if method == Method.FOCUS.value]
        assert kinds == ["request"], "the daemon routes requests to its methods (and ignores other notifications)"
        # The document was on the daemon before its focus.
        methods = [method for _, method, _ in daemon.messages]
        assert methods.index(Method.OPEN.value) < methods.index(Method.FOCUS.value)


async def test_once_per_line_and_only_for_documents_the_daemon_holds(tmp_path):
    async with recording_daemon(tmp_path) as daemon, \
            lsp_session(server_env(tmp_path), link_options(SimpleNamespace(socket_path=daemon.path))) as session:
        session.open(URI, TEXT)
        focus(session, URI, 3, 0)
        await wait_focuses(daemon, 1)
        focus(session, URI, 3, 4)  # along the same line: nothing new to prefill
        focus(session, "file:///work/never-opened.py", 0, 0)
        focus(session, URI, 99, 0)  # past the end: clamped to the document's end
        got = await wait_focuses(daemon, 2)
        assert got == [expected(3, 0), expected(5, 0)]
        focus(session, URI, 5, 0)  # the same line again: dropped
        session.close(URI)
        session.open(URI, TEXT)
        focus(session, URI, 3, 2)  # reopened: the daemon holds no prefill of it, so it goes
        got = await wait_focuses(daemon, 3)
        assert got == [expected(3, 0), expected(5, 0), expected(3, 2)]
        # Completions are untouched by hints: the link is still the one it was.
        assert (await session.status())["daemon"]["connects"] == 1


async def test_a_hint_before_the_daemon_is_there_is_sent_once_it_is_ready(tmp_path):
    path = tmp_path / "d.sock"
    options = link_options(SimpleNamespace(socket_path=path))
    async with lsp_session(server_env(tmp_path), options, wait_ready=False) as session:
        await session.wait_state("unavailable")
        session.open(URI, TEXT)
        focus(session, URI, 1, 2)
        focus(session, URI, 4, 4)  # the cursor moved on before the daemon came: only this one goes
        async with recording_daemon(tmp_path) as daemon:
            await session.wait_state("ready")
            got = await wait_focuses(daemon, 1)
            assert got == [expected(4, 4)]
            focus(session, URI, 4, 1)  # the same line as the replayed hint: already sent
            focus(session, URI, 0, 3)
            assert await wait_focuses(daemon, 2) == [expected(4, 4), expected(0, 3)]


async def test_the_real_daemon_takes_the_hint(fake_daemon, tmp_path):
    def counts() -> dict[str, int]:
        with fake_daemon.client() as client:
            return client.status()["documents"]["focus"]

    async with lsp_session(server_env(tmp_path), link_options(fake_daemon)) as session:
        session.open(URI, TEXT)
        before = counts()
        focus(session, URI, 1, 11)
        after = await poll(lambda: asyncio.to_thread(lambda: (c := counts())["received"] > before["received"] and c),
                           what="the daemon's focus count")
        assert after == {**before, "received": before["received"] + 1}
