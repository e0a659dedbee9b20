"""Incremental document sync, mirrored to the daemon.

Another client reads the daemon's copy of the document back through the fake engine (it
echoes the 12 characters before a cursor), so the test sees exactly what the daemon holds.
"""

from __future__ import annotations

import asyncio

import pytest
from lsprotocol import types

from lsp_helpers import link_options, lsp_session, server_env
from specd.protocol import RpcError

pytestmark = pytest.mark.asyncio

URI = "file:///work/sync.py"
ECHO = 12


def daemon_holds(daemon, uri: str, text: str, version: int) -> bool:
    """Whether the daemon's copy of ``uri`` is ``text`` at ``version``, echo by echo."""
    with daemon.client() as client:
        try:
            for offset in range(0, len(text) + 1, 3):
                result = client.complete(uri=uri, cursor={"offset": offset})
                if result["text"] != f"[{text[max(0, offset - ECHO):offset]}]" or result["version"] != version:
                    return False
            end = client.complete(uri=uri, cursor={"offset": len(text)})
            if end["text"] != f"[{text[-ECHO:]}]":
                return False
            client.complete(uri=uri, cursor={"offset": len(text) + 1})
        except RpcError as err:
            return err.code == "out_of_range"  # past the end: the lengths agree
        return False


async def wait_daemon_text(daemon, uri: str, text: str, version: int) -> None:
    for _ in range(100):  # bounded: the daemon applies edits as they arrive
        if await asyncio.to_thread(daemon_holds, daemon, uri, text, version):
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"the daemon does not hold {text!r} at version {version}")


async def test_edits_reach_the_daemon_in_order(fake_daemon, tmp_path):
    async with lsp_session(server_env(tmp_path), link_options(fake_daemon)) as session:
        session.open(URI, "def f(a):\n    return a\n")
        session.edit(URI, (0, 7), (0, 7), ", b")  # insert
        session.edit(URI, (1, 12), (1, 12), " + b")
        session.edit(URI, (0, 0), (0, 4), "")  # delete
        session.edit(URI, (1, 4), (2, 0), "pass\n\nx = 1\n")  # multi-line replace
        await wait_daemon_text(fake_daemon, URI, "f(a, b):\n    pass\n\nx = 1\n", 5)
        # Several changes in one notification apply in order, each to the result of the one before.
        session.versions[URI] += 1
        session.client.text_document_did_change(types.DidChangeTextDocumentParams(
            types.VersionedTextDocumentIdentifier(uri=URI, version=session.versions[URI]),
            [types.TextDocumentContentChangePartial(range=types.Range(types.Position(0, 0), types.Position(0, 0)),
                                                    text="def "),
             types.TextDocumentContentChangePartial(range=types.Range(types.Position(3, 4), types.Position(3, 5)),
                                                    text="2"),
             types.TextDocumentContentChangeWholeDocument(text="y = 3\n")]))
        await wait_daemon_text(fake_daemon, URI, "y = 3\n", 6)
        items = await session.inline(URI, 0, 4)
        assert [item.insert_text for item in items] == ["[y = ]"]


async def test_close_releases_the_document_on_the_daemon(fake_daemon, tmp_path):
    async with lsp_session(server_env(tmp_path), link_options(fake_daemon)) as session:
        session.open(URI, "a = 1\n")
        await wait_daemon_text(fake_daemon, URI, "a = 1\n", 1)
        session.close(URI)
        with fake_daemon.client() as client:
            for _ in range(100):
                try:
                    client.complete(uri=URI, cursor=0)
                except RpcError as err:
                    if err.code == "unknown_document":
                        break
                    assert err.code == "cancelled"  # the close landed while it ran
                await asyncio.sleep(0.05)
            else:
                raise AssertionError("the daemon still holds the closed document")
        assert await session.inline(URI, 0, 0) == []  # never-opened (now closed) documents: empty
        assert (await session.status())["documents"] == 0
