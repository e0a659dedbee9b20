"""Completion failures reach the user: when the daemon answers a completion with an error that
is not a cancellation (an engine error here), specd-lsp shows it with ``window/showMessage``
once per distinct message, again only after a completion worked in between, and its status
carries ``lastError`` until then. Real specd-lsp, real daemon (tests/failing_engine.py).
"""

from __future__ import annotations

import pytest
from lsprotocol import types

from daemon_helpers import DaemonProcess
from lsp_helpers import link_options, lsp_session, poll, server_env

pytestmark = pytest.mark.asyncio

URI = "file:///work/failures.py"
TEXT = "a = 1  #fail:alpha\nb = 2  #fail:beta\nc = 3\n"
ALPHA, BETA, FINE = (0, 18), (1, 17), (2, 5)


@pytest.fixture
def failing_daemon(tmp_path):
    daemon = DaemonProcess(tmp_path / "daemon", env={"SPECD_TEST_ENGINE_FACTORY": "failing_engine:failing"})
    daemon.start()
    yield daemon
    daemon.stop()


def failures(session) -> list[str]:
    return [m.message for m in session.messages if m.message.startswith("specd: completion failed")]


async def test_an_engine_error_is_shown_once_per_message_until_a_success(failing_daemon, tmp_path):
    async with lsp_session(server_env(tmp_path), link_options(failing_daemon)) as session:
        session.open(URI, TEXT)
        for _ in range(3):  # typing on: the same failure again and again
            assert await session.inline(URI, *ALPHA) == []
        shown = await session.wait_for(lambda: failures(session), 10, "the failure's message")
        assert shown == ["specd: completion failed: engine_error: engine broke on alpha"]
        assert [m.type for m in session.messages if m.message in shown] == [types.MessageType.Error]
        status = await session.status()
        assert status["lastError"] == "engine_error: engine broke on alpha" and status["failed"] == 3
        assert session.statuses[-1]["lastError"] == "engine_error: engine broke on alpha"  # notified too

        assert await session.inline(URI, *BETA) == []  # another message: shown
        await session.wait_for(lambda: len(failures(session)) == 2, 10, "the second message")
        assert failures(session)[1].endswith("engine broke on beta")
        assert await session.inline(URI, *ALPHA) == []  # seen already, no success since: not again

        [item] = await session.inline(URI, *FINE)  # a completion works ...
        assert item.insert_text.endswith("c = 3]")  # the fake engine echoes what precedes the cursor
        assert (await session.status())["lastError"] is None
        assert await session.inline(URI, *ALPHA) == []  # ... so the failure is news again
        await session.wait_for(lambda: len(failures(session)) == 3, 10, "the message after a success")
        assert failures(session)[2].endswith("engine broke on alpha")
        assert (await session.status())["failed"] == 6


async def test_cancelled_completions_are_not_failures(fake_daemon, tmp_path):
    """A request superseded on the daemon while it runs answers ``cancelled``: nothing is shown."""
    import asyncio

    async with lsp_session(server_env(tmp_path), link_options(fake_daemon)) as session:
        session.open(URI, "x = 1  #slow\ny = 2\n")
        slow = asyncio.ensure_future(session.inline(URI, 0, 12))  # held 5 s by the engine
        with fake_daemon.client() as client:
            await poll(lambda: _running(client, URI), 10, what="the slow completion to run on the daemon")
        [item] = await session.inline(URI, 1, 5)  # supersedes it
        assert await slow == []
        status = await session.status()
        assert status["cancelled"] >= 1 and status["failed"] == 0
        assert status["lastError"] is None and failures(session) == []
        assert item.insert_text


async def _running(client, uri: str) -> bool:
    return client.status()["requests"]["running"] == f"complete {uri}"
