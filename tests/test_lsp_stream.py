"""The first line first, then the rest: specd-lsp asks the real daemon with ``stream`` and
answers an automatic request once the suggestion's first line is settled, while the daemon still
writes the rest; the rest arrives into its cache and the editor hears ``specd/suggestionGrew``;
asking again shows the longer item, and typing through the first line (or accepting it) is
served from the cache with no new daemon complete. With ``partialLineMs`` a first line slower
than that wait answers while it is being written, never with a partial the completed line could
withdraw, and grows to the whole suggestion the same way. The daemon runs
``fake_engine:streaming``, which writes a known four-line suggestion a few characters per step,
so the order of events is the test's to check."""

from __future__ import annotations

import time
from typing import Any

import pytest

from conftest import SHARED_DAEMON_CONFIG
from daemon_helpers import DaemonProcess
from fake_engine import STREAMED_TEXT
from lsp_helpers import link_options, lsp_session, plain, server_env
from specd.protocol.methods import LSP_SUGGESTION_GREW_METHOD

pytestmark = pytest.mark.asyncio

URI = "file:///work/stream.py"
TEXT = "def f():\n    \n"
CURSOR = (1, 4)
FIRST = STREAMED_TEXT.split("\n")[0]


# The first line as shown while it is being written: the stepped fake's first step ("x ="),
# its line settled a step later.
PARTIAL = "x ="
SLOW_STEP_S = 0.25  # the slow daemon's pace: the partial wait ends well inside its first line
PARTIAL_LINE_MS = 100
WHOLE_LINES = {"partialLineMs": 0}  # the first settled line answers (the behaviour the first tests check)


@pytest.fixture(scope="module")
def streaming_daemon(tmp_path_factory):
    proc = DaemonProcess(tmp_path_factory.mktemp("stream-daemon"), engine="streaming",
                         config=SHARED_DAEMON_CONFIG).start()
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def slow_daemon(tmp_path_factory):
    proc = DaemonProcess(tmp_path_factory.mktemp("slow-stream-daemon"), engine="streaming",
                         config=SHARED_DAEMON_CONFIG, env={"SPECD_TEST_STREAM_STEP_S": str(SLOW_STEP_S)}).start()
    yield proc
    proc.stop()


def daemon_completes(daemon) -> int:
    with daemon.client() as client:
        return client.status()["requests"]["completed"]


async def _session_with_grew(session) -> list[tuple[float, dict[str, Any]]]:
    grew: list[tuple[float, dict[str, Any]]] = []

    @session.client.feature(LSP_SUGGESTION_GREW_METHOD)
    def _grew(params: Any) -> None:
        grew.append((time.monotonic(), plain(params)))
        session.changed.set()

    return grew


async def test_the_first_line_answers_while_the_rest_is_written(streaming_daemon, tmp_path):
    async with lsp_session(server_env(tmp_path), link_options(streaming_daemon, cache={"prefetch": False},
                                                              **WHOLE_LINES)) as session:
        grew = await _session_with_grew(session)
        session.open(URI, TEXT)
        before = daemon_completes(streaming_daemon)
        asked = time.monotonic()
        [item] = await session.inline(URI, *CURSOR)
        answered = time.monotonic()
        assert item.insert_text == FIRST
        assert daemon_completes(streaming_daemon) == before  # the daemon is still writing the rest
        # The rest arrives after the answer; the editor hears of it at the request's place.
        await session.wait_for(lambda: daemon_completes(streaming_daemon) > before and len(grew) >= 3, 20,
                               "the whole suggestion and its growth notices")
        assert all(at > answered for at, _ in grew)
        assert {(p["uri"], p["version"], p["position"]["line"], p["position"]["character"]) for _, p in grew} == \
            {(URI, 1, *CURSOR)}
        # Asked again there (a plugin's answer to the notice): the whole suggestion, from the cache.
        [whole] = await session.inline(URI, *CURSOR)
        assert whole.insert_text == STREAMED_TEXT
        status = await session.status()
        assert status["daemonRequests"] == 1 and status["streamed"] == 1 and status["cacheHits"] == 1
        assert status["grew"] == len(grew)
        assert answered - asked < grew[-1][0] - asked


async def test_typing_through_the_first_line_needs_no_daemon(streaming_daemon, tmp_path):
    async with lsp_session(server_env(tmp_path), link_options(streaming_daemon, **WHOLE_LINES)) as session:
        session.open(URI, TEXT)
        [item] = await session.inline(URI, *CURSOR)
        assert item.insert_text == FIRST
        # Accept the first line at once (the next lines are not written yet): the next request at
        # its end waits for them on the stream instead of asking the daemon, and no prefetch runs.
        session.edit(URI, CURSOR, CURSOR, item.insert_text)
        await session.accept(item)
        [rest] = await session.inline(URI, CURSOR[0], CURSOR[1] + len(FIRST))
        assert rest.insert_text.startswith("\n    y = 2")
        # Type part of the next line: still the cache.
        line = CURSOR[0] + 1
        session.edit(URI, (CURSOR[0], CURSOR[1] + len(FIRST)), (CURSOR[0], CURSOR[1] + len(FIRST)), "\n    y")
        [more] = await session.inline(URI, line, 5)
        assert (FIRST + "\n    y" + more.insert_text).startswith(STREAMED_TEXT[:len(FIRST) + 10])
        status = await session.status()
        assert status["daemonRequests"] == 1 and status["cacheHits"] == 2 and status["prefetches"] == 0, status


async def test_a_slow_first_line_answers_while_written_then_grows_to_the_whole(slow_daemon, tmp_path):
    options = link_options(slow_daemon, cache={"prefetch": False}, partialLineMs=PARTIAL_LINE_MS)
    async with lsp_session(server_env(tmp_path), options) as session:
        grew = await _session_with_grew(session)
        session.open(URI, TEXT)
        before = daemon_completes(slow_daemon)
        asked = time.monotonic()
        [item] = await session.inline(URI, *CURSOR)
        answered = time.monotonic()
        assert item.insert_text == PARTIAL  # the first line, still being written
        assert answered - asked >= PARTIAL_LINE_MS / 1000
        # The partial grows: to its whole line, then the next lines, told to the editor each time.
        await session.wait_for(lambda: daemon_completes(slow_daemon) > before and len(grew) >= 4, 30,
                               "the whole suggestion and its growth notices")
        assert all(at > answered for at, _ in grew)
        [whole] = await session.inline(URI, *CURSOR)
        assert whole.insert_text == STREAMED_TEXT
        status = await session.status()
        assert status["daemonRequests"] == 1 and status["streamed"] == 1 and status["grew"] == len(grew)


async def test_a_partial_the_next_line_could_withdraw_is_not_shown(slow_daemon, tmp_path):
    """The document's next line is the cursor's line completed by the suggestion's first
    ("y" + "x = 1"): the partial ("x =") makes a prefix of it, and the completed line is cut
    to nothing (the suffix-line rule), so nothing is shown, at any time."""
    options = link_options(slow_daemon, cache={"prefetch": False}, partialLineMs=PARTIAL_LINE_MS)
    async with lsp_session(server_env(tmp_path), options) as session:
        grew = await _session_with_grew(session)
        session.open(URI, "def f():\n    y\n    y" + FIRST + "\n")
        assert await session.inline(URI, CURSOR[0], CURSOR[1] + 1) == []
        before = daemon_completes(slow_daemon)
        await session.wait_for(lambda: daemon_completes(slow_daemon) > before, 30, "the whole suggestion")
        assert grew == []


async def test_with_partial_line_ms_0_a_slow_first_line_answers_once_settled(slow_daemon, tmp_path):
    async with lsp_session(server_env(tmp_path), link_options(slow_daemon, **WHOLE_LINES)) as session:
        session.open(URI, TEXT)
        [item] = await session.inline(URI, *CURSOR)
        assert item.insert_text == FIRST
