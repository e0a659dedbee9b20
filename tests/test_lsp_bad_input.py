"""Bad input from the editor never crashes specd-lsp: it answers with a JSON-RPC error or an
empty result and goes on serving."""

from __future__ import annotations

import asyncio
import json

import pytest
from lsprotocol import types
from pygls.exceptions import JsonRpcException

from lsp_helpers import link_options, lsp_session, server_env

pytestmark = pytest.mark.asyncio

URI = "file:///work/bad.py"


async def raw_request(session, msg_id: str, method: str, params) -> object:
    """Send a request as raw JSON (the typed client refuses to send malformed params)."""
    protocol = session.client.protocol
    future = asyncio.get_running_loop().create_future()
    protocol._request_futures[msg_id] = future
    body = json.dumps({"jsonrpc": "2.0", "id": msg_id, "method": method, "params": params})
    protocol.writer.write(f"Content-Length: {len(body.encode())}\r\n\r\n{body}".encode())
    return await asyncio.wait_for(future, 10)


async def test_unopened_documents_out_of_range_positions_and_malformed_params(fake_daemon, tmp_path):
    async with lsp_session(server_env(tmp_path), link_options(fake_daemon)) as session:
        # Never opened: empty. A change or close for it: ignored.
        assert await session.inline("file:///work/never.py", 0, 0) == []
        session.versions["file:///work/never.py"] = 1
        session.edit("file:///work/never.py", (0, 0), (0, 0), "x")
        session.close("file:///work/never.py")
        session.open(URI, "ab\ncd\n")
        # Positions past the end clamp (LSP's rule for characters; lines clamp to the end).
        assert [i.insert_text for i in await session.inline(URI, 1, 99)] == ["[ab\ncd]"]
        assert [i.insert_text for i in await session.inline(URI, 99, 0)] == ["[ab\ncd\n]"]
        # An edit range past the end clamps too, and the mirror stays in step with the daemon.
        session.edit(URI, (5, 0), (9, 9), "ef")
        assert [i.insert_text for i in await session.inline(URI, 2, 2)] == ["[ab\ncd\nef]"]
        # Malformed params: a JSON-RPC error for that request only.
        good = {"textDocument": {"uri": URI}, "position": {"line": 0, "character": 1},
                "context": {"triggerKind": 2}}
        for number, params in enumerate(({"textDocument": 5}, {**good, "position": {"line": -1, "character": 0}},
                                         None, [1, 2], {**good, "context": {"triggerKind": "soon"}})):
            with pytest.raises(JsonRpcException):
                await raw_request(session, f"bad{number}", types.TEXT_DOCUMENT_INLINE_COMPLETION, params)
        with pytest.raises(JsonRpcException):
            await raw_request(session, "bad-command", types.WORKSPACE_EXECUTE_COMMAND, {"command": "specd.nope"})
        # An accept for a proposal that does not exist is ignored.
        await session.client.workspace_execute_command_async(
            types.ExecuteCommandParams(command="specd.accepted", arguments=["no-such-id"]))
        assert (await session.status())["accepted"] == 0
        assert [i.insert_text for i in await session.inline(URI, 0, 2)] == ["[ab]"]


async def test_huge_lines_and_text_the_socket_cannot_carry(fake_daemon, tmp_path):
    async with lsp_session(server_env(tmp_path), link_options(fake_daemon)) as session:
        long_line = "x = '" + "é" * 100_000 + "'"  # 200 kB on one line, under the test daemon's limit
        session.open(URI, long_line + "\n")
        items = await session.inline(URI, 0, len(long_line))
        assert [i.insert_text for i in items] == [f"[{long_line[-12:]}]"]
        too_big = "y" * 300_000  # over the test daemon's 256 kB document limit: empty, not a crash
        session.open("file:///work/big.py", too_big)
        assert await session.inline("file:///work/big.py", 0, 10) == []
        lone = "s = '\ud800'\n"  # JSON can carry a lone surrogate; msgpack's UTF-8 cannot
        session.open("file:///work/lone.py", lone)
        assert await session.inline("file:///work/lone.py", 0, 7) == []
        status = await session.status()
        assert status["state"] == "ready" and status["failed"] >= 2
        assert (await session.inline(URI, 0, 4))[0].insert_text == "[x = ]"
