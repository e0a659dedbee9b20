"""Cancellation: $/cancelRequest, supersession by a newer request, and debounce.

The test daemons hold a completion whose text before the cursor contains ``#slow`` for up to
5 s, polling for cancellation; a request that comes back well before that was cancelled on the
daemon, not merely abandoned by specd-lsp.
"""

from __future__ import annotations

import asyncio
import contextlib
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


@pytest.mark.parametrize("which, invoked, debounce_ms", [
    ("fake_daemon", False, 0), ("daemon", True, 0), ("daemon", False, 30)])
async def test_a_request_after_a_cancelled_one_is_never_left_empty(request, which, invoked, debounce_ms, tmp_path):
    """$/cancelRequest for one request, then the identical request at once, 200 times, with the
    cancel landing before, during and after the first one's answer: the second always gets what
    the same request gets unraced (a cancel that lost its race leaves nothing behind)."""
    import random

    rng = random.Random(7)
    text = "def f():\n    return 1\n"
    columns = range(4, 12)
    serving = request.getfixturevalue(which)
    # One greedy item per request, invoked too: sampled alternatives are not repeated bit for bit
    # across cache states (speculative sampling keeps the law, not the draws), greedy is.
    options = link_options(serving, debounceMs=debounce_ms, alternatives=1)
    async with lsp_session(server_env(tmp_path), options) as session:
        # The unraced answers, from a twin document (the type-through cache is per document).
        session.open(URI + ".twin", text)
        expected = {column: [item.insert_text for item in await session.inline(URI + ".twin", 1, column, invoked)]
                    for column in columns}
        assert sum(1 for answer in expected.values() if answer) >= 4, expected
        assert all(len(answer) <= 1 for answer in expected.values()), expected
        session.open(URI, text)
        protocol = session.client.protocol
        wrong = []
        for n in range(200):
            column = columns[n % len(columns)]
            params = session.inline_params(URI, 1, column, invoked=invoked)
            first = asyncio.ensure_future(protocol.send_request_async(
                types.TEXT_DOCUMENT_INLINE_COMPLETION, params, msg_id=10_000 + n))
            await asyncio.sleep(rng.choice([0, 0, 0.0005, 0.001, 0.002, 0.004, 0.008, 0.016]))
            protocol.notify(types.CANCEL_REQUEST, types.CancelParams(id=10_000 + n))
            second = [item.insert_text for item in await session.inline(URI, 1, column, invoked=invoked)]
            if second != expected[column]:
                wrong.append((n, column, second))
            with contextlib.suppress(JsonRpcRequestCancelled):
                await asyncio.wait_for(first, 5)
    assert wrong == [], f"{len(wrong)} of 200 differ from the unraced answer: {wrong[:5]}; expected {expected}"
