"""The daemon end to end: a real `python -m specd serve` subprocess over its real socket.

Most tests share two session daemons (conftest.py): ``daemon`` with the real engine on the
tiny llama pair, ``fake_daemon`` with a model-free engine. Lifecycle tests (SIGTERM, restart,
stale socket, idle unload, load failure, limits, TCP) start their own, with the fake engine,
because they test the daemon's mechanics and each start costs a torch import otherwise.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgpack
import pytest

from tools import find_tool

from daemon_helpers import DaemonProcess, InProcessDaemon, expect_error, free_port, raw_connect, read_all, wait_for
from specd.client import AsyncClient, Client, DaemonUnavailable, complete_via_daemon, ensure_daemon
from specd.protocol import ErrorCode, RpcError, pack

DOC = "def add(a, b):\n    return a + b\n\n\ndef mul(a, b):\n    #slow\n    return a * b\n"
SLOW_CURSOR = {"line": 6, "character": 4}  # after "#slow": held up to 5 s unless cancelled
FAST_CURSOR = {"line": 1, "character": 4}


def uri(name: str) -> str:
    return f"file:///work/{name}"


@pytest.fixture
def client(daemon):
    with daemon.client() as c:
        yield c


@pytest.fixture
def fclient(fake_daemon):
    with fake_daemon.client() as c:
        yield c


# -- the socket -----------------------------------------------------------------------------------


def test_socket_and_directory_are_private(daemon):
    assert daemon.socket_path == daemon.root / "run" / "specd" / "specd.sock"
    assert stat.S_ISSOCK(daemon.socket_path.stat().st_mode)
    assert stat.S_IMODE(daemon.socket_path.stat().st_mode) == 0o600
    assert stat.S_IMODE(daemon.socket_path.parent.stat().st_mode) == 0o700


def test_socket_falls_back_to_the_state_dir_without_xdg_runtime_dir(tmp_path):
    d = DaemonProcess(tmp_path / "d")
    del d.env["XDG_RUNTIME_DIR"]
    d.socket_path = tmp_path / "d" / "state" / "specd" / "run" / "specd.sock"
    try:
        d.start()
        assert stat.S_IMODE(d.socket_path.stat().st_mode) == 0o600
        assert stat.S_IMODE(d.socket_path.parent.stat().st_mode) == 0o700
        done = run_cli(d, "status", "--json")  # the CLI finds it the same way
        assert json.loads(done.stdout)["socket"] == str(d.socket_path)
    finally:
        d.stop()


# -- every method, round trip ---------------------------------------------------------------------


def test_hello(client):
    info = client.hello(client="pytest")
    assert info["server"] == "specd" and info["protocol"] == 1
    assert {"cancel", "supersede", "ranged_edits"} <= set(info["capabilities"])
    assert set(info["methods"]) >= {"hello", "open", "change", "close", "complete", "cancel", "status", "shutdown"}
    assert info["models"]["target"].endswith("target")
    assert info["state"] == "ready"
    assert info["limits"]["max_frame_bytes"] == 1024 * 1024


def test_open_change_close_and_complete_with_the_real_engine(client):
    u = uri("roundtrip.py")
    assert client.open_document(u, "def f(x):\n    return x\n", version=1) == {"uri": u, "version": 1}
    # A ranged edit in UTF-16 units after an astral character: "😀" is 2 units, 1 code point.
    client.change_document(u, 2, edits=[{"range": {"start": {"line": 0, "character": 0},
                                                   "end": {"line": 0, "character": 0}}, "text": "# 😀\n"}],
                           encoding="utf-16")
    client.change_document(u, 3, edits=[{"range": {"start": {"line": 0, "character": 4},
                                                   "end": {"line": 0, "character": 4}}, "text": "!"}],
                           encoding="utf-16")
    result = client.complete(uri=u, cursor={"line": 2, "character": 12}, options={"max_tokens": 6})
    assert result["version"] == 3
    text = "# 😀!\ndef f(x):\n    return x\n"
    assert result["offset"] == text.index("return x") + len("return x")
    assert isinstance(result["text"], str)
    assert 1 <= len(result["token_ids"]) <= 6
    assert result["stop_reason"] in {"eos", "max_tokens", "single_line", "block_end", "time_budget", "line_ending",
                                     "repeated_line", "suffix_line", "current_line"}
    assert result["target_forwards"] >= 1 and result["latency_ms"] > 0
    assert client.close_document(u) == {"uri": u, "closed": True}
    expect_error(ErrorCode.UNKNOWN_DOCUMENT, client.complete, uri=u, cursor=0)


def test_cursor_forms_agree(fclient):
    text = "é = 1\n😀x = 2\nzz"
    u = uri("cursor.py")
    fclient.open_document(u, text)
    want = text.index("x =")
    forms = [
        want,
        {"offset": want},
        {"byte_offset": len(text[:want].encode())},
        {"line": 1, "character": 1},
        {"line": 1, "col": 1},
        {"line": 1, "character": 2, "encoding": "utf-16"},
        {"line": 1, "character": 4, "encoding": "utf-8"},
    ]
    for cursor in forms:
        result = fclient.complete(uri=u, cursor=cursor)
        assert result["offset"] == want, cursor
        assert result["text"] == f"[{text[:want][-12:]}]"
    # A character past the end of its line means the end of the line (LSP's rule).
    assert fclient.complete(uri=u, cursor={"line": 0, "character": 99})["offset"] == text.index("\n")
    fclient.close_document(u)


def test_stateless_complete_with_extra_context(client):
    result = client.complete(text="import os\n\nprint(os.", cursor={"offset": 19}, path="x.py",
                             extra_context=[{"path": "util.py", "text": "def helper():\n    pass\n"}],
                             options={"max_tokens": 4, "single_line": True, "temperature": 0.0})
    assert result["uri"] is None and result["offset"] == 19
    assert len(result["token_ids"]) <= 4


def test_status_reports_models_memory_cache_acceptance_latency(client):
    client.complete(text="x = 1\ny = ", cursor=10, options={"max_tokens": 4})
    info = client.status()
    assert info["state"] == "ready"
    assert info["models"]["target"].endswith("target") and info["models"]["draft"].endswith("draft")
    assert info["device"] == "cpu" and info["dtype"]
    assert info["memory"]["rss_mb"] > 0
    assert "bytes" in info["cache"]
    assert isinstance(info["acceptance"], dict)
    assert info["latency_ms"]["count"] >= 1 and info["latency_ms"]["p50"] <= info["latency_ms"]["p95"]
    assert info["uptime_s"] > 0 and info["pid"] > 0
    assert info["requests"]["completed"] >= 1


# -- errors ---------------------------------------------------------------------------------------


def test_every_bad_request_gets_a_coded_error_and_the_connection_lives(client):
    expect_error(ErrorCode.METHOD_NOT_FOUND, client.request, "no_such_method", {})
    expect_error(ErrorCode.INVALID_PARAMS, client.request, "open", {"uri": 5, "text": "x"})
    expect_error(ErrorCode.INVALID_PARAMS, client.request, "open", {"uri": "u"})
    expect_error(ErrorCode.INVALID_PARAMS, client.complete, text="abc")  # no cursor
    expect_error(ErrorCode.INVALID_PARAMS, client.complete, text="abc", cursor=1, options={"max_tokn": 3})
    expect_error(ErrorCode.INVALID_PARAMS, client.complete, text="abc", cursor=1, options={"temperature": "hot"})
    expect_error(ErrorCode.OUT_OF_RANGE, client.complete, text="abc", cursor=4)
    expect_error(ErrorCode.OUT_OF_RANGE, client.complete, text="abc", cursor={"line": 3, "character": 0})
    expect_error(ErrorCode.UNKNOWN_DOCUMENT, client.change_document, uri("never-opened.py"), 1, text="x")
    expect_error(ErrorCode.INVALID_PARAMS, client.cancel)
    u = uri("errors.py")
    client.open_document(u, "abc", version=5)
    expect_error(ErrorCode.STALE_VERSION, client.change_document, u, 5, text="abd")
    expect_error(ErrorCode.OUT_OF_RANGE, client.change_document, u, 6, edits=[{"start": 2, "end": 9, "text": "x"}])
    # Atomic: a batch whose second edit fails leaves the first unapplied.
    expect_error(ErrorCode.INVALID_PARAMS, client.change_document, u, 6,
                 edits=[{"start": 0, "end": 0, "text": "X"}, {"start": 0, "text": 7}])
    assert client.complete(uri=u, cursor=3, options={"max_tokens": 1})["version"] == 5
    client.close_document(u)
    assert client.hello()["server"] == "specd"


def test_limits_give_clear_errors_and_lose_nothing(client):
    keep = uri("keep.py")
    client.open_document(keep, "keep = 1\n")
    big = "x" * (256 * 1024 + 1)
    err = expect_error(ErrorCode.DOCUMENT_TOO_LARGE, client.open_document, uri("big.py"), big)
    assert "daemon.max_document_bytes" in err.message
    err = expect_error(ErrorCode.DOCUMENT_TOO_LARGE, client.change_document, keep, 1, text=big)
    opened = []
    with pytest.raises(RpcError) as info:
        for number in range(100):
            client.open_document(uri(f"many{number}.py"), "")
            opened.append(uri(f"many{number}.py"))
    assert info.value.code == ErrorCode.TOO_MANY_DOCUMENTS.value
    for u in opened:
        client.close_document(u)
    assert client.complete(uri=keep, cursor=4, options={"max_tokens": 1})["version"] == 0  # unharmed
    client.close_document(keep)


def test_oversized_frame_closes_only_that_connection(daemon, client):
    with raw_connect(daemon.socket_path) as sock:
        payload = pack([0, 1, "open", [{"uri": "u", "text": "x" * (1024 * 1024 + 10)}]])
        try:
            sock.sendall(payload)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the daemon may close before we finish writing
        unpacker = msgpack.Unpacker(raw=False)
        unpacker.feed(read_all(sock))
        replies = list(unpacker)
    assert replies and replies[-1][0] == 2 and replies[-1][1] == "specd/error"
    assert replies[-1][2][0]["code"] == "frame_too_large"  # params: an array holding one map
    assert client.hello()["server"] == "specd"


def test_raw_neovim_style_frames(daemon):
    """Exactly what vim.rpcrequest sends: params is an array holding one map."""
    with raw_connect(daemon.socket_path) as sock:
        sock.sendall(pack([0, 7, "hello", [{"client": "nvim"}]]) + pack([0, 8, "bogus", []]) + pack([2, "cancel", [{"uri": "x"}]]))
        unpacker = msgpack.Unpacker(raw=False)
        replies = []
        while len(replies) < 2:
            unpacker.feed(sock.recv(65536))
            replies.extend(unpacker)
    by_id = {r[1]: r for r in replies}
    assert by_id[7][0] == 1 and by_id[7][2] is None and by_id[7][3]["server"] == "specd"
    assert by_id[8][2]["code"] == "method_not_found" and by_id[8][3] is None


def test_string_errors_for_neovim(daemon):
    """After hello {errors = "string"} the error slot is "code: message" (Neovim shows strings only)."""
    with daemon.client() as c:
        assert "string" in c.hello(errors="string")["error_formats"]
        with pytest.raises(RpcError) as info:
            c.request("bogus", {})
        assert info.value.code == "method_not_found"  # the client parses the string form back
        msgid, pending = c.send_request("complete", {"text": "x", "cursor": 5})
        with pytest.raises(RpcError) as info:
            pending.result(10)
        assert info.value.code == "out_of_range"
        expect_error(ErrorCode.INVALID_PARAMS, c.hello, errors="xml")
    with raw_connect(daemon.socket_path) as sock:
        sock.sendall(pack([0, 1, "hello", [{"errors": "string"}]]) + pack([0, 2, "bogus", []]))
        unpacker = msgpack.Unpacker(raw=False)
        replies = []
        while len(replies) < 2:
            unpacker.feed(sock.recv(65536))
            replies.extend(unpacker)
    by_id = {reply[1]: reply for reply in replies}  # answers come as they finish, not in order
    assert by_id[2][2].startswith("method_not_found: no method 'bogus'")


# -- supersede, cancel, queueing ------------------------------------------------------------------


def test_new_complete_supersedes_the_in_flight_one(client):
    u = uri("supersede.py")
    client.open_document(u, DOC)
    _, first = client.send_request("complete", {"uri": u, "cursor": SLOW_CURSOR})
    time.sleep(0.2)  # let it start
    started = time.monotonic()
    second = client.complete(uri=u, cursor=FAST_CURSOR, options={"max_tokens": 4})
    with pytest.raises(RpcError) as info:
        first.result(10)
    assert info.value.code == "cancelled" and "superseded" in info.value.message
    assert second["offset"] == DOC.index("return a + b")
    assert time.monotonic() - started < 4  # did not wait out the slow one
    client.close_document(u)


def test_supersede_of_a_queued_request_answers_it_at_once(fclient):
    blocker, u = uri("blocker.py"), uri("queued.py")
    fclient.open_document(blocker, DOC)
    fclient.open_document(u, DOC)
    _, slow = fclient.send_request("complete", {"uri": blocker, "cursor": SLOW_CURSOR})
    _, queued = fclient.send_request("complete", {"uri": u, "cursor": FAST_CURSOR})
    time.sleep(0.1)
    _, newer = fclient.send_request("complete", {"uri": u, "cursor": FAST_CURSOR})
    with pytest.raises(RpcError) as info:
        queued.result(2)  # cancelled while queued: answered before the slow job ends
    assert info.value.code == "cancelled"
    fclient.cancel(uri=blocker)
    assert newer.result(10)["uri"] == u
    with pytest.raises(RpcError):
        slow.result(10)
    fclient.close_document(u)
    fclient.close_document(blocker)


def test_cancel_by_msgid_uri_and_notification(client):
    u = uri("cancel.py")
    client.open_document(u, DOC)
    for how in ("msgid", "uri", "notification"):
        msgid, pending = client.send_request("complete", {"uri": u, "cursor": SLOW_CURSOR})
        time.sleep(0.1)
        if how == "msgid":
            assert client.cancel(msgid=msgid) == {"cancelled": 1}
        elif how == "uri":
            assert client.cancel(uri=u) == {"cancelled": 1}
        else:
            client.notify("cancel", {"uri": u})
        with pytest.raises(RpcError) as info:
            pending.result(3)
        assert info.value.code == "cancelled", how
    assert client.cancel(msgid=999999) == {"cancelled": 0}
    client.close_document(u)


def test_other_documents_queue_and_the_loop_stays_responsive(fclient, fake_daemon):
    a, b = uri("qa.py"), uri("qb.py")
    fclient.open_document(a, DOC)
    fclient.open_document(b, DOC)
    _, slow = fclient.send_request("complete", {"uri": a, "cursor": SLOW_CURSOR})
    _, queued = fclient.send_request("complete", {"uri": b, "cursor": FAST_CURSOR})
    time.sleep(0.2)
    with fake_daemon.client() as other:
        started = time.monotonic()
        info = other.status()
        assert time.monotonic() - started < 1.0  # the model thread is busy; the socket is not
    assert info["requests"]["running"].endswith("qa.py") and info["requests"]["queued"] == 1
    assert not queued.done()
    fclient.cancel(uri=a)
    assert queued.result(5)["uri"] == b  # ran after a, not cancelled by it
    with pytest.raises(RpcError):
        slow.result(5)


def test_two_concurrent_clients(daemon):
    results: dict[int, dict] = {}
    errors: list[BaseException] = []

    def work(number: int) -> None:
        try:
            with daemon.client() as c:
                u = uri(f"concurrent{number}.py")
                c.open_document(u, f"def f{number}(x):\n    return x * {number}\n")
                for _ in range(3):
                    results[number] = c.complete(uri=u, cursor={"line": 1, "character": 4}, options={"max_tokens": 4})
        except BaseException as err:  # reported below
            errors.append(err)

    threads = [threading.Thread(target=work, args=(n,)) for n in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    assert {r["uri"] for r in results.values()} == {uri("concurrent0.py"), uri("concurrent1.py")}


def test_client_disconnect_cancels_its_work_and_frees_its_documents(fake_daemon, fclient):
    before = fclient.status()
    c = fake_daemon.client()
    u = uri("disconnect.py")
    c.open_document(u, DOC)
    c.send_request("complete", {"uri": u, "cursor": SLOW_CURSOR})
    time.sleep(0.1)
    c.close()
    started = time.monotonic()
    fclient.complete(text="abc", cursor=3)  # queued behind the slow job unless it was cancelled
    assert time.monotonic() - started < 2.0
    after = fclient.status()
    assert after["requests"]["cancelled"] == before["requests"]["cancelled"] + 1
    assert after["documents"]["open"] == before["documents"]["open"]


def test_async_client(fake_daemon):
    async def main():
        async with await AsyncClient.connect_unix(fake_daemon.socket_path) as c:
            assert (await c.hello(client="lsp"))["server"] == "specd"
            u = uri("async.py")
            await c.open_document(u, DOC)
            _, slow = c.send_request("complete", {"uri": u, "cursor": SLOW_CURSOR})
            await asyncio.sleep(0.1)
            fast = await c.complete(uri=u, cursor=FAST_CURSOR)
            with pytest.raises(RpcError) as info:
                await slow
            assert info.value.code == "cancelled"
            assert fast["offset"] == DOC.index("return a + b")
            with pytest.raises(RpcError) as info:
                await c.request("nope", {})
            assert info.value.code == "method_not_found"
            await c.close_document(u)

    asyncio.run(main())


# -- CLI ------------------------------------------------------------------------------------------


def run_cli(daemon: DaemonProcess, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "specd", *args], env=daemon.env, capture_output=True,
                          text=True, timeout=timeout, cwd=str(daemon.root))


def test_cli_status(daemon):
    done = run_cli(daemon, "status")
    assert done.returncode == 0, done.stderr
    assert "ready" in done.stdout and "latency" in done.stdout and "target" in done.stdout
    done = run_cli(daemon, "status", "--json")
    assert json.loads(done.stdout)["state"] == "ready"


# -- lifecycle ------------------------------------------------------------------------------------


def test_sigterm_answers_in_flight_removes_socket_and_restarts(tmp_path):
    d = DaemonProcess(tmp_path / "d", env={"SPECD_TEST_SLOW_S": "1"}).start()
    try:
        c = d.client()
        _, pending = c.send_request("complete", {"text": "#slow\nx", "cursor": 7})
        time.sleep(0.2)
        started = time.monotonic()
        assert d.terminate() == 0
        result = pending.result(1)  # answered before the daemon left
        assert result["offset"] == 7
        assert not d.socket_path.exists()
        assert time.monotonic() - started < 10
        c.close()
        d.start()  # restart on the same path
        with d.client() as c:
            assert c.hello()["state"] == "ready"
        assert d.terminate() == 0 and not d.socket_path.exists()
    finally:
        d.stop()


def test_shutdown_method_via_cli_stop(tmp_path):
    d = DaemonProcess(tmp_path / "d").start()
    try:
        done = run_cli(d, "stop")
        assert done.returncode == 0, done.stderr
        assert "stopped" in done.stdout
        assert d.proc.wait(10) == 0
        assert not d.socket_path.exists()
        done = run_cli(d, "status")
        assert done.returncode == 3 and "no daemon" in done.stdout
        assert run_cli(d, "stop").returncode == 0  # idempotent
    finally:
        d.stop()


def test_stale_socket_from_a_crashed_daemon_is_replaced(tmp_path):
    d = DaemonProcess(tmp_path / "d").start()
    try:
        d.kill()  # SIGKILL: no cleanup, the socket file stays
        assert d.socket_path.exists()
        d.start()
        with d.client() as c:
            assert c.hello()["pid"] == d.pid
    finally:
        d.stop()


def test_second_daemon_on_the_same_socket_refuses_to_start(tmp_path):
    first = DaemonProcess(tmp_path / "d").start()
    try:
        second = DaemonProcess(tmp_path / "d")
        second.start(wait=False)
        assert second.proc.wait(20) == 1
        assert "another specd daemon" in second.stderr() or "already serving" in second.stderr()
        with first.client() as c:
            assert c.hello()["pid"] == first.pid
    finally:
        first.stop()


def test_a_non_socket_file_at_the_path_is_left_alone(tmp_path):
    d = DaemonProcess(tmp_path / "d")
    d.socket_path.parent.mkdir(parents=True, mode=0o700)
    d.socket_path.write_text("precious")
    d.start(wait=False)
    assert d.proc.wait(20) == 2  # the surroundings to fix, as a config error
    assert "not a socket" in d.stderr()
    assert d.socket_path.read_text() == "precious"


def test_idle_unload_and_reload(tmp_path):
    d = DaemonProcess(tmp_path / "d", args=("--idle-unload", "1")).start()
    try:
        with d.client() as c:
            wait_for(lambda: c.status()["state"] == "unloaded", 10, 0.1, "idle unload")
            assert c.status()["engine"]["releases"] == 1
            assert c.complete(text="abc", cursor=3)["text"] == "[abc]"
            info = c.status()
            assert info["state"] == "ready" and info["engine"]["loads"] == 2
    finally:
        d.stop()


def test_loading_state_and_requests_wait_for_the_load(tmp_path):
    d = DaemonProcess(tmp_path / "d", env={"SPECD_TEST_FAKE_LOAD_S": "1.5"}).start(wait=False)
    try:
        d.wait_listening()
        with d.client() as c:
            assert c.hello()["state"] == "loading"
            assert c.complete(text="abc", cursor=3)["text"] == "[abc]"
            assert c.status()["state"] == "ready"
    finally:
        d.stop()


def test_model_load_failure_is_one_line_and_exits_nonzero(tmp_path):
    d = DaemonProcess(tmp_path / "d", env={"SPECD_TEST_FAKE_LOAD_FAIL": "model dir /nope has no config.json"})
    d.start(wait=False)
    assert d.proc.wait(30) == 1
    lines = [line for line in d.stderr().splitlines() if line.startswith("specd:")]
    assert lines == ["specd: cannot load models: model dir /nope has no config.json"]
    assert not d.socket_path.exists()


@pytest.mark.slow
def test_real_engine_bad_model_dir_fails_fast(tmp_path):
    d = DaemonProcess(tmp_path / "d", engine="real", config={"model.target": str(tmp_path / "missing")})
    d.start(wait=False)
    assert d.proc.wait(120) == 1
    lines = [line for line in d.stderr().splitlines() if line.startswith("specd:")]
    assert len(lines) == 1 and "cannot load models" in lines[0] and "missing" in lines[0]


def test_connection_limit(tmp_path):
    d = DaemonProcess(tmp_path / "d", config={"daemon.max_connections": 2}).start()
    try:
        with d.client() as a, d.client() as b:
            a.hello(), b.hello()
            with d.client() as refused:
                with pytest.raises(RpcError) as info:
                    refused.hello()
            assert info.value.code == "too_many_connections"
            assert a.hello() and b.hello()  # the others are untouched
        wait_for(lambda: _hello_ok(d), 5, message="a free slot")
    finally:
        d.stop()


def _hello_ok(d: DaemonProcess) -> bool:
    try:
        with d.client() as c:
            return bool(c.hello())
    except RpcError:
        return False


# -- ensure_daemon / complete_via_daemon ----------------------------------------------------------


def _spawn_env(monkeypatch, root: Path, **extra: str):
    from daemon_helpers import base_env

    env = base_env(root, "fake", extra=extra)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.chdir(root)


def test_ensure_daemon_spawns_and_complete_via_daemon(tmp_path, monkeypatch):
    from specd.config import load_config

    _spawn_env(monkeypatch, tmp_path)
    cfg = load_config()
    with pytest.raises(DaemonUnavailable):
        ensure_daemon(cfg, spawn=False)
    source = tmp_path / "m.py"
    source.write_text("def f():\n    return 1\n")
    result = complete_via_daemon(cfg, source.read_text(), line=1, character=10, path=source)
    assert result["text"] == "[:\n    return]"
    assert result["uri"] == source.resolve().as_uri()
    with ensure_daemon(cfg, spawn=False) as c:  # now one runs
        pid = c.hello()["pid"]
        c.shutdown()
    wait_for(lambda: not cfg.socket_path.exists(), 10, message="the spawned daemon to stop")
    wait_for(lambda: not _alive(pid), 10, message="the spawned daemon to exit")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_spawned_daemon_gets_our_config_but_not_our_service_handshake(monkeypatch, tmp_path):
    from specd.client import _child_environment
    from specd.config import load_config

    config = tmp_path / "specd.toml"
    config.write_text("[engine]\nmax_tokens = 7\n")
    monkeypatch.setenv("NOTIFY_SOCKET", "/run/user/1/systemd/notify")
    monkeypatch.setenv("LISTEN_FDS", "1")
    cfg = load_config(config, overrides={"model.target": "/models/t", "engine.use_lookup": False})
    env = _child_environment(cfg)
    assert env["SPECD_CONFIG"] == str(config)
    assert env["SPECD_MODEL_TARGET"] == "/models/t" and env["SPECD_ENGINE_USE_LOOKUP"] == "false"
    assert "NOTIFY_SOCKET" not in env and "LISTEN_FDS" not in env
    assert load_config(environ=env)["model.target"] == "/models/t"


def test_ensure_daemon_reports_a_failed_start(tmp_path, monkeypatch):
    from specd.config import load_config

    _spawn_env(monkeypatch, tmp_path, SPECD_TEST_FAKE_LOAD_FAIL="target and draft tokenizers differ")
    with pytest.raises(RpcError) as info:
        complete_via_daemon(load_config(), "abc", offset=3)
    assert "target and draft tokenizers differ" in info.value.message


# -- access: peer uid, TCP token --------------------------------------------------------------------


def test_another_uid_is_refused_mocked(tmp_path):
    """The daemon serves uid N+1 (mocked); our real uid N arrives through SO_PEERCRED and is refused."""
    with InProcessDaemon(tmp_path, allowed_uid=os.getuid() + 1) as d:
        with Client.connect_unix(d.daemon.socket_path) as c:
            with pytest.raises(RpcError) as info:
                c.hello()
        assert info.value.code == "unauthorized" and str(os.getuid()) in info.value.message
    with InProcessDaemon(tmp_path / "b", allowed_uid=os.getuid()) as d:  # and the right uid is served
        with Client.connect_unix(d.daemon.socket_path) as c:
            assert c.hello()["server"] == "specd"


# Runs as another uid, so it may not be able to read our interpreter or site-packages: plain
# Python, bytes in and out (the parent packs the request and unpacks the reply).
REAL_UID_PROBE = """
import socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect(sys.argv[1])
s.sendall(bytes.fromhex(sys.argv[2]))
reply = b""
while True:
    data = s.recv(4096)
    if not data:
        break
    reply += data
print(reply.hex())
"""


def _probe_interpreter() -> str | None:
    """An interpreter uid 65534 can execute (ours may live under root's private home)."""
    for candidate in (sys.executable, "/usr/bin/python3", "/usr/local/bin/python3"):
        try:
            done = subprocess.run([candidate, "-c", "pass"], user=65534, group=65534, capture_output=True, timeout=30)
        except (PermissionError, FileNotFoundError):
            continue
        if done.returncode == 0:
            return candidate
    return None


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to run a client as another uid")
def test_another_uid_is_refused_for_real(tmp_path):
    """A client really running as uid 65534 (nobody). The socket is made world-reachable on purpose,
    so only the SO_PEERCRED check stands between it and the daemon."""
    try:
        python = _probe_interpreter()
    except OSError:
        python = None
    if python is None:
        pytest.skip("this sandbox cannot run a process as uid 65534")
    public = tmp_path / "public"
    public.mkdir(mode=0o755)
    for parent in (tmp_path, *tmp_path.parents):  # uid 65534 must be able to reach the socket
        if parent.stat().st_mode & 0o001 == 0:
            os.chmod(parent, parent.stat().st_mode | 0o011)
    path = public / "specd.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    os.chmod(path, 0o666)
    listener.listen()
    with InProcessDaemon(tmp_path / "d", allowed_uid=os.getuid(), listener=listener):
        done = subprocess.run([python, "-c", REAL_UID_PROBE, str(path), pack([0, 1, "hello", [{}]]).hex()],
                              user=65534, group=65534, capture_output=True, text=True, timeout=30, cwd="/")
    assert done.returncode == 0, done.stderr
    unpacker = msgpack.Unpacker(raw=False)
    unpacker.feed(bytes.fromhex(done.stdout.strip()))
    replies = list(unpacker)
    assert replies == [[2, "specd/error", [{"code": "unauthorized", "message": "uid 65534 may not use this daemon"}]]]


def test_tcp_listener_needs_the_token(tmp_path):
    port = free_port()
    d = DaemonProcess(tmp_path / "d", config={"daemon.tcp_token": "s3cret"}, args=("--tcp", f"127.0.0.1:{port}")).start()
    try:
        sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        anonymous = Client(sock)
        with pytest.raises(RpcError) as info:
            anonymous.status()
        assert info.value.code == "unauthorized"
        with pytest.raises(RpcError) as info:
            anonymous.hello(token="wrong")
        assert info.value.code == "unauthorized"
        wait_for(lambda: anonymous.closed, 5, message="the daemon to drop a wrong-token client")
        with pytest.raises(RpcError):
            Client.connect_tcp("127.0.0.1", port, token="")
        with Client.connect_tcp("127.0.0.1", port, token="s3cret") as c:
            assert c.complete(text="abc", cursor=3)["text"] == "[abc]"
    finally:
        d.stop()


@pytest.mark.parametrize("spec, config, message", [
    ("0.0.0.0:{port}", {"daemon.tcp_token": "t"}, "not a loopback address"),
    ("127.0.0.1:{port}", {}, "needs a token"),
])
def test_tcp_misconfiguration_refuses_to_start(tmp_path, spec, config, message):
    d = DaemonProcess(tmp_path / "d", config=config, args=("--tcp", spec.format(port=free_port())))
    d.start(wait=False)
    assert d.proc.wait(30) == 2  # a config error, told before anything is bound
    assert message in d.stderr()
    assert not d.socket_path.exists()


# -- the Neovim example from docs/socket-api.md, run verbatim --------------------------------------


def _doc_lua_example() -> str:
    doc = (Path(__file__).resolve().parent.parent / "docs" / "socket-api.md").read_text(encoding="utf-8")
    start = doc.index("```lua\n", doc.index("### Neovim")) + len("```lua\n")
    return doc[start:doc.index("```", start)]


def test_neovim_lua_example_from_the_docs(fake_daemon, tmp_path):
    script = tmp_path / "example.lua"
    script.write_text(_doc_lua_example(), encoding="utf-8")
    source = tmp_path / "m.py"
    source.write_text("def f(x):\n    return x\n", encoding="utf-8")
    env = {**fake_daemon.env, "HOME": str(tmp_path)}
    # Cursor on line 2 after "    re" (byte column 6), then run the example and quit.
    done = subprocess.run(
        [find_tool("nvim"), "--headless", "--clean", str(source), "-c", "call cursor(2, 7)", "-c", f"luafile {script}", "-c", "qa!"],
        env=env, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert "specd 0.1.0, target fake-target, ready" in output, output
    # The fake engine echoes the 12 characters before the cursor: byte column 6 of line 2.
    assert "[f(x):\n    re]" in output and "2 tokens in" in output, output
    assert "specd error" not in output and "E5113" not in output, output


# -- load -----------------------------------------------------------------------------------------


@pytest.mark.slow
def test_load_eight_clients_with_edits_cancels_and_supersedes(tmp_path):
    """8 clients x 200 completes over 20 shared documents, random edits, ~30% cancelled or
    superseded: every complete gets exactly one answer (a result or `cancelled`), none hangs,
    and the daemon's memory comes back to its baseline. The engine is the model-free one: this
    measures the daemon, not the model."""
    d = DaemonProcess(tmp_path / "d").start()
    try:
        run_load(d, clients=8, per_client=200, rss_slack_mb=32)
    finally:
        d.stop()


@pytest.mark.slow
def test_load_on_the_real_engine(daemon):
    """The same mix, smaller, through the real engine on the tiny pair (KV caches and lookup
    indexes for 20 documents are real allocations, so the memory slack is larger)."""
    run_load(daemon, clients=4, per_client=25, rss_slack_mb=96, max_tokens=8)


def run_load(d: DaemonProcess, clients: int, per_client: int, rss_slack_mb: float, max_tokens: int | None = None) -> None:
    import random

    documents = [uri(f"load/doc{n}.py") for n in range(20)]
    options = {"max_tokens": max_tokens} if max_tokens else None
    with d.client() as warm:  # baseline after the first requests have allocated what they need
        warm.complete(text="x" * 1000, cursor=500)
    baseline = d.rss_mb()
    outcomes: list[str] = []
    latencies: list[float] = []
    failures: list[str] = []
    lock = threading.Lock()

    def client_main(seed: int) -> None:
        rng = random.Random(seed)
        with d.client() as c:
            for doc in documents:
                c.open_document(doc, "def f(x):\n    return x\n" * 20)
            for _ in range(per_client):
                doc = rng.choice(documents)
                if rng.random() < 0.5:  # an edit that is valid whatever the others did to the doc
                    c.change_document(doc, edits=[{"start": 0, "end": 0, "text": f"# {rng.random()}\n"}])
                params = {"uri": doc, "cursor": {"line": rng.randrange(5), "character": rng.randrange(30)}}
                if options:
                    params["options"] = options
                started = time.monotonic()
                msgid, first = c.send_request("complete", params)
                pending = [first]
                roll = rng.random()
                if roll < 0.15:
                    c.cancel(msgid=msgid)
                elif roll < 0.30:
                    pending.append(c.send_request("complete", params)[1])  # supersedes the first
                for future in pending:
                    try:
                        future.result(60)
                        outcome = "result"
                    except RpcError as err:
                        outcome = err.code
                    except Exception as err:  # a timeout is a hang: recorded, fails below
                        outcome = f"{type(err).__name__}"
                    with lock:
                        outcomes.append(outcome)
                with lock:
                    latencies.append((time.monotonic() - started) * 1000)

    def guarded(seed: int) -> None:
        try:
            client_main(seed)
        except BaseException as err:
            failures.append(repr(err))

    started = time.monotonic()
    threads = [threading.Thread(target=guarded, args=(seed,)) for seed in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    elapsed = time.monotonic() - started
    assert not failures, failures[:3]
    counts = {code: outcomes.count(code) for code in set(outcomes)}
    assert set(counts) <= {"result", "cancelled"}, counts  # exactly one answer each, of these two kinds
    assert len(outcomes) >= clients * per_client
    assert counts.get("cancelled", 0) >= 0.10 * clients * per_client
    with d.client() as c:
        info = c.status()
    assert info["requests"]["queued"] == 0 and info["requests"]["running"] is None
    assert info["documents"]["open"] == 0
    grown = d.rss_mb() - baseline
    assert grown < rss_slack_mb, f"RSS grew {grown:.1f} MiB"
    latencies.sort()
    print(f"load: {len(outcomes)} completes in {elapsed:.1f} s ({len(outcomes) / elapsed:.0f}/s), "
          f"{counts}, latency p50 {latencies[len(latencies) // 2]:.1f} ms "
          f"p95 {latencies[int(len(latencies) * 0.95)]:.1f} ms, RSS {baseline:.0f} -> {d.rss_mb():.0f} MiB")
