"""The daemon's lifecycle as the editor sees it: spawn, unavailable, a failed start, and a
daemon killed in the middle of a request (respawned, documents re-sent, next request served)."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from daemon_helpers import DaemonProcess
from lsp_helpers import TIME_BUDGET_MS, daemon_options, lsp_session, server_env
from specd_lsp.completion import context_at, postprocess
from specd_lsp.positions import TextIndex
from specd.client import Client, DaemonUnavailable
from specd.protocol import RpcError
from tiny import make_tiny_pair

pytestmark = pytest.mark.asyncio

URI = "file:///work/life.py"
DOC = "def f():\n    return 1\n\n\ndef g(x):\n    return x\n#slow\n"
SLOW = (7, 0)


def _daemon_status(socket_path):
    try:
        with Client.connect_unix(socket_path, timeout=1) as client:
            return client.status()
    except (DaemonUnavailable, RpcError):
        return None


def _stop_daemon(socket_path, pid: int | None) -> None:
    try:
        with Client.connect_unix(socket_path, timeout=1) as client:
            client.shutdown()
    except (DaemonUnavailable, RpcError):
        pass
    deadline = time.monotonic() + 20
    while pid and time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)  # bounded wait for the spawned daemon to exit
    if pid:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


async def test_unavailable_daemon_gives_empty_results_fast_and_one_message(tmp_path):
    socket_path = tmp_path / "nobody" / "specd.sock"
    options = {"daemon": {"socket": str(socket_path), "spawn": False}, "debounceMs": 0}
    async with lsp_session(server_env(tmp_path / "lsp"), options, wait_ready=False) as session:
        await session.wait_state("unavailable", 15)
        session.open(URI, "x = 1\n")
        for _ in range(3):
            started = time.monotonic()
            assert await session.inline(URI, 0, 5, invoked=True) == []
            assert time.monotonic() - started < 0.5
        await session.wait_for(lambda: session.messages, 5, "the message")
        assert len(session.messages) == 1 and "specd serve" in session.messages[0].message
        # A daemon started by hand later is picked up, and the open document is sent to it.
        daemon = DaemonProcess(tmp_path / "later", engine="fake", config={"daemon.socket": str(socket_path)})
        daemon.start()
        try:
            await session.wait_state("ready", 15)
            assert [item.insert_text for item in await session.inline(URI, 0, 5)] == ["[x = 1]"]
            assert len(session.messages) == 1
        finally:
            daemon.stop()


async def test_a_failed_spawn_is_reported_once_with_its_reason(tmp_path):
    env = server_env(tmp_path, "fake", extra={"SPECD_TEST_FAKE_LOAD_FAIL": "target and draft tokenizers differ"})
    async with lsp_session(env, {"daemon": {"spawn": True}}, wait_ready=False) as session:
        await session.wait_for(lambda: session.messages, 30, "the message")
        assert "target and draft tokenizers differ" in session.messages[0].message
        assert (await session.status())["state"] in ("unavailable", "spawning", "connecting", "loading")
        assert len(session.messages) == 1


@pytest.mark.slow
async def test_daemon_killed_mid_request_is_respawned_and_documents_resent(tmp_path, tiny_root):
    target, draft = make_tiny_pair(tiny_root / "llama", "llama")
    config = {"model.target": target, "model.draft": draft, "model.device": "cpu", "log.level": "debug"}
    env = server_env(tmp_path, "real", config)
    socket_path = tmp_path / "run" / "specd" / "specd.sock"
    options = {"daemon": {"spawn": True, "requestTimeoutMs": TIME_BUDGET_MS}, "debounceMs": 0, "maxTokens": 16,
               "timeBudgetMs": TIME_BUDGET_MS}
    pids: list[int] = []
    try:
        async with lsp_session(env, options, ready_timeout=180) as session:
            first = await session.status()
            pids.append(first["daemon"]["pid"])
            assert first["daemon"]["connects"] == 1
            session.open(URI, DOC)
            assert isinstance(await session.inline(URI, 1, 12), list)
            slow = asyncio.ensure_future(session.inline(URI, *SLOW))
            for _ in range(200):  # bounded: until the daemon is running the held request
                if ((await asyncio.to_thread(_daemon_status, socket_path)) or {}).get("requests", {}).get("running"):
                    break
                await asyncio.sleep(0.05)
            killed = time.monotonic()
            os.kill(pids[0], signal.SIGKILL)
            assert await asyncio.wait_for(slow, 5) == []
            assert time.monotonic() - killed < 1.0, "the pending request must be answered within a second"
            # The editor keeps typing while the daemon is down; nothing of it may be lost.
            session.edit(URI, (0, 0), (0, 0), "# edited while the daemon was down\n")
            text = "# edited while the daemon was down\n" + DOC
            ready = await session.wait_for(
                lambda: session.statuses[-1]["state"] == "ready" and session.statuses[-1]["daemon"]["connects"] == 2
                and session.statuses[-1], 180, "the respawned daemon")
            pids.append(ready["daemon"]["pid"])
            assert pids[1] != pids[0]
            with Client.connect_unix(socket_path) as client:  # the daemon holds the document as edited
                held = client.complete(uri=URI, cursor={"offset": len(text)}, options={"max_tokens": 1})
                assert held["version"] == 2 and held["offset"] == len(text)
            failed = (await session.status())["failed"]
            for line in (2, 6):  # the next requests are served, as the daemon itself answers them
                items = await session.inline(URI, line, 12)
                offset = TextIndex(text).offset(line, 12)
                with Client.connect_unix(socket_path) as client:
                    raw = client.complete(uri=URI, text=text, cursor={"offset": offset}, options=daemon_options())
                want = postprocess(raw["text"], context_at(text, offset))
                assert [i.insert_text for i in items] == ([want.insert_text] if want else [])
            status = await session.status()
            assert status["failed"] == failed and status["state"] == "ready" and status["daemonRequests"] >= 4
            assert session.messages == []  # a restart the user need not hear about
    finally:
        for pid in reversed(pids):
            await asyncio.to_thread(_stop_daemon, socket_path, pid)
