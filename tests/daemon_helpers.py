"""Run the real daemon (``python -m specd serve``) as a subprocess in private XDG dirs, or a
Daemon on a thread of the test's own process; and the buffers' operations on cursors and edits as
a client sends them (parsed, then applied)."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from specd.client import Client, DaemonUnavailable
from specd.daemon import buffers
from specd.daemon.params import parse_cursor, parse_edits
from specd.protocol import ErrorCode, RpcError

REPO = Path(__file__).resolve().parent.parent
TESTS = Path(__file__).resolve().parent


def resolve_cursor(index: buffers.TextIndex, cursor: Any, encoding: Any = None) -> int:
    """A cursor in wire form -> its code-point offset in ``index.text``."""
    return buffers.locate(index, parse_cursor(cursor, encoding))


def edit_index(index: buffers.TextIndex, edits: list[Any], encoding: str) -> buffers.TextIndex:
    """Edits in wire form applied in order to ``index``'s text."""
    return buffers.edit_index(index, parse_edits(edits, encoding))


def apply_edits(text: str, edits: list[Any], encoding: str) -> str:
    return edit_index(buffers.TextIndex(text), edits, encoding).text


def base_env(root: Path, engine: str = "fake", config: dict[str, Any] | None = None,
             extra: dict[str, str] | None = None) -> dict[str, str]:
    """A clean environment: no SPECD_* from the caller, XDG dirs under ``root``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SPECD_", "LISTEN_", "NOTIFY_SOCKET", "WATCHDOG_"))}
    for var, sub in (("XDG_RUNTIME_DIR", "run"), ("XDG_STATE_HOME", "state"), ("XDG_CONFIG_HOME", "config"),
                     ("XDG_CACHE_HOME", "cache")):
        path = root / sub
        path.mkdir(parents=True, exist_ok=True, mode=0o700)
        env[var] = str(path)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(TESTS)])
    env["PYTHONUNBUFFERED"] = "1"
    # Tiny models gain nothing from a second intra-op thread, and on a busy 2-core machine
    # OpenMP's spinning threads make every forward pass many times slower.
    env.setdefault("OMP_NUM_THREADS", "1")
    env["SPECD_TEST_ENGINE_FACTORY"] = f"fake_engine:{engine}"
    # The forward paths pinned (``config`` may name others): the auto choices time forwards at
    # load, and no test's outcome may hang on the clock.
    env["SPECD_ENGINE_FORWARD_BACKEND"] = "torch"
    env["SPECD_ENGINE_LLAMACPP_PREFILL"] = "torch"
    for dotted, value in (config or {}).items():
        env["SPECD_" + dotted.replace(".", "_").upper()] = str(value).lower() if isinstance(value, bool) else str(value)
    env.update(extra or {})
    return env


def daemon_idle(socket_path: Path) -> bool:
    """No completion waits, sits in the daemon's worker or runs, for any connection."""
    try:
        with Client.connect_unix(socket_path, timeout=2) as client:
            queues = client.status().get("queues") or []
    except (DaemonUnavailable, OSError, RpcError):
        return False
    return not any(q.get("waiting") or q.get("in_worker") or q.get("started") for q in queues)


def wait_for(condition, timeout: float = 10.0, interval: float = 0.02, message: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {message}")


def expect_error(code: ErrorCode, fn, *args, **kwargs) -> RpcError:
    """``fn(*args, **kwargs)`` answers an error with ``code`` and a message."""
    with pytest.raises(RpcError) as info:
        fn(*args, **kwargs)
    assert info.value.code == code.value, info.value
    assert info.value.message
    return info.value


class InProcessDaemon:
    """A Daemon (fake engine) on a thread of this process, so a test can set what uid it serves,
    shorten its limits and look inside. ``environ``: config as SPECD_* variables beside its
    socket's; ``daemon_options``: Daemon's keyword arguments (allowed_uid, tcp)."""

    def __init__(self, root: Path, environ: dict[str, str] | None = None,
                 listener: socket.socket | None = None, **daemon_options: Any):
        from fake_engine import FakeEngine
        from specd.config import load_config
        from specd.daemon.server import Daemon

        root.mkdir(parents=True, exist_ok=True)
        cfg = load_config(environ={"SPECD_DAEMON_SOCKET": str(root / "run" / "specd.sock"), **(environ or {})})
        self.daemon = Daemon(cfg, engine_factory=lambda: FakeEngine(cfg), **daemon_options)
        self.socket_path = self.daemon.socket_path
        self.activated = [listener] if listener is not None else []
        self.exit_code: int | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        self.exit_code = asyncio.run(self.daemon.run(activated=self.activated))

    def __enter__(self) -> InProcessDaemon:
        self.thread.start()
        wait_for(lambda: self.daemon.worker.state == "ready", 10, message="in-process daemon ready")
        return self

    def __exit__(self, *exc) -> None:
        self.daemon._loop.call_soon_threadsafe(self.daemon.request_stop, "test over")
        self.thread.join(20)
        assert self.exit_code == 0

    def on_loop(self, fn):
        """Run ``fn`` on the daemon's loop and return its result."""
        async def call():
            return fn()
        return asyncio.run_coroutine_threadsafe(call(), self.daemon._loop).result(5)


class DaemonProcess:
    def __init__(self, root: Path, engine: str = "fake", config: dict[str, Any] | None = None,
                 env: dict[str, str] | None = None, args: tuple[str, ...] = ()):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.env = base_env(self.root, engine, config, env)
        self.args = args
        configured = (config or {}).get("daemon.socket")
        self.socket_path = Path(configured) if configured else self.root / "run" / "specd" / "specd.sock"
        self.stderr_path = self.root / "daemon.stderr"
        self.proc: subprocess.Popen[bytes] | None = None

    # -- process ---------------------------------------------------------------------------

    def command(self) -> list[str]:
        return [sys.executable, "-m", "specd", "serve", *self.args]

    def start(self, wait: bool = True, timeout: float = 60.0, **popen: Any) -> DaemonProcess:
        with open(self.stderr_path, "ab") as stderr:
            self.proc = subprocess.Popen(self.command(), env=self.env, cwd=str(REPO), stdin=subprocess.DEVNULL,
                                         stdout=subprocess.DEVNULL, stderr=stderr, **popen)
        if wait:
            self.wait_ready(timeout)
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def wait_listening(self, timeout: float = 30.0) -> None:
        def listening():
            self._check_alive()
            try:
                Client.connect_unix(self.socket_path, timeout=1).close()
                return True
            except DaemonUnavailable:
                return False

        wait_for(listening, timeout, message=f"the daemon to listen on {self.socket_path}")

    def wait_ready(self, timeout: float = 60.0) -> dict[str, Any]:
        self.wait_listening(timeout)
        with self.client() as client:
            def ready():
                self._check_alive()
                info = client.status()
                return info if info["state"] == "ready" else None

            return wait_for(ready, timeout, interval=0.05, message="state ready")

    def _check_alive(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            raise AssertionError(f"daemon exited with {self.proc.returncode}:\n{self.stderr()}")

    def client(self) -> Client:
        return Client.connect_unix(self.socket_path)

    def stderr(self) -> str:
        try:
            return self.stderr_path.read_text(errors="replace")
        except OSError:
            return ""

    def terminate(self, timeout: float = 30.0) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self) -> None:
        """Best-effort cleanup for fixtures: SIGTERM, then SIGKILL."""
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            self.terminate(20)
        except subprocess.TimeoutExpired:
            self.kill()

    def rss_mb(self) -> float:
        with open(f"/proc/{self.pid}/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
        raise AssertionError("no VmRSS")


def free_port() -> int:
    """A loopback TCP port nobody listens on (for a daemon's or a server's listener)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def raw_connect(path: Path, timeout: float = 5.0) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    sock.connect(str(path))
    return sock


def read_all(sock: socket.socket, timeout: float = 5.0, limit: int = 16 * 1024 * 1024) -> bytes:
    """Everything the peer sends until it closes (or ``timeout`` of silence). A peer that closes
    with our bytes still unread resets the connection after its reply: what came before is kept."""
    sock.settimeout(timeout)
    chunks = []
    total = 0
    while total < limit:
        try:
            data = sock.recv(65536)
        except (socket.timeout, ConnectionResetError):
            break
        if not data:
            break
        chunks.append(data)
        total += len(data)
    return b"".join(chunks)
