"""Cancellation: $/cancelRequest, supersession by a newer request, and debounce.

The test daemons hold a completion whose text before the cursor contains ``#slow`` for up to
5 s, polling for cancellation; a request that comes back well before that was cancelled on the
daemon, not merely abandoned by specd-lsp.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from lsprotocol import types
from pygls.exceptions import JsonRpcRequestCancelled

from lsp_helpers import link_options, lsp_session, poll, server_env

pytestmark = pytest.mark.asyncio

URI = "file:///work/slow.py"
DOC = "def f():\n    return 1\n#slow\n"
SLOW = (3, 0)  # after the marker: held by the daemon
FAST = (1, 12)  # before it


def daemon_counts(daemon) -> dict:
    with daemon.client() as client:
        return client.status()["requests"]


async def test_cancel_request_cancels_the_daemons_work(daemon, tmp_path):
    async with lsp_session(server_env(tmp_path), link_options(daemon)) as session:
        session.open(URI, DOC)
        before = daemon_counts(daemon)
        params = session.inline_params(URI, *SLOW)
        started = time.monotonic()
        pending = asyncio.ensure_future(session.client.protocol.send_request_async(
            types.TEXT_DOCUMENT_INLINE_COMPLETION, params, msg_id=4242))
        await poll(lambda: asyncio.to_thread(lambda: daemon_counts(daemon)["running"]), 10, what="the daemon to run it")
        session.client.protocol.notify(types.CANCEL_REQUEST, types.CancelParams(id=4242))
        with pytest.raises(JsonRpcRequestCancelled):
            await asyncio.wait_for(pending, 5)
        assert time.monotonic() - started < 4.0
        after = await poll(lambda: asyncio.to_thread(
            lambda: (counts := daemon_counts(daemon))["cancelled"] > before["cancelled"] and counts), 5,
            what="the daemon to count the cancel")
        assert after["running"] is None
        status = await session.status()
        assert status["cancelled"] == 1 and status["state"] == "ready"
        # The server goes on serving.
        assert isinstance(await session.inline(URI, *FAST), list)


async def test_a_newer_request_supersedes_the_running_one(daemon, tmp_path):
    async with lsp_session(server_env(tmp_path), link_options(daemon)) as session:
        session.open(URI, DOC)
        started = time.monotonic()
        slow = asyncio.ensure_future(session.inline(URI, *SLOW))
        await poll(lambda: asyncio.to_thread(lambda: daemon_counts(daemon)["running"]), 10, what="the daemon to run it")
        fast = await session.inline(URI, *FAST)
        assert await asyncio.wait_for(slow, 5) == []  # superseded: an empty answer, at once
        assert time.monotonic() - started < 4.0
        status = await session.status()
        assert status["cancelled"] == 1 and status["daemonRequests"] == 2
        assert isinstance(fast, list)


async def test_debounce_sends_only_the_last_of_a_burst(fake_daemon, tmp_path):
    async with lsp_session(server_env(tmp_path), link_options(fake_daemon, debounceMs=300)) as session:
        session.open(URI, "abcdef\n")
        burst = [session.inline(URI, 0, column) for column in (2, 4, 6)]
        results = await asyncio.gather(*burst)
        assert results[0] == [] and results[1] == []
        assert [item.insert_text for item in results[2]] == ["[abcdef]"]
        status = await session.status()
        assert status["daemonRequests"] == 1 and status["requests"] == 3
        # Invoked requests are not debounced.
        started = time.monotonic()
        assert await session.inline(URI, 0, 3, invoked=True)
        assert time.monotonic() - started < 0.3 + 2.0
