"""systemd without systemd: socket activation and sd_notify exercised for real, units linted.

A pre-bound socket goes to a daemon subprocess as fd 3 with LISTEN_FDS/LISTEN_PID, as systemd
passes it; a datagram socket stands in for NOTIFY_SOCKET and receives READY=1, WATCHDOG=1 and
STOPPING=1. ``systemd-analyze verify`` lints the unit files where it is installed.
"""

from __future__ import annotations

import os
import shutil
import socket
import stat
import subprocess
import sys
import time
from argparse import Namespace
from pathlib import Path

import pytest

from daemon_helpers import REPO, DaemonProcess, wait_for
from specd import systemd_units
from specd.daemon import commands, systemd

UNIT_DIR = REPO / "systemd"


# -- the protocols, in process ----------------------------------------------------------------


def test_listen_fds_only_for_our_pid(monkeypatch):
    monkeypatch.setenv("LISTEN_PID", str(os.getpid() + 1))
    monkeypatch.setenv("LISTEN_FDS", "1")
    assert systemd.listen_fds() == []
    assert "LISTEN_FDS" not in os.environ and "LISTEN_PID" not in os.environ  # unset either way
    monkeypatch.setenv("LISTEN_PID", "garbage")
    assert systemd.listen_fds() == []
    assert systemd.listen_fds() == []  # nothing set at all


def test_listen_fds_adopts_fd_3(monkeypatch, tmp_path):
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(tmp_path / "s.sock"))
    listener.listen()
    saved = os.dup(3) if _fd_open(3) else None
    try:
        os.dup2(listener.fileno(), 3)
        monkeypatch.setenv("LISTEN_PID", str(os.getpid()))
        monkeypatch.setenv("LISTEN_FDS", "1")
        [adopted] = systemd.listen_fds()
        assert adopted.fileno() == 3 and adopted.family == socket.AF_UNIX
        assert not os.get_inheritable(3)
        adopted.detach()
    finally:
        if saved is not None:
            os.dup2(saved, 3)
            os.close(saved)
        else:
            os.close(3)
        listener.close()


def _fd_open(fd: int) -> bool:
    try:
        os.fstat(fd)
        return True
    except OSError:
        return False


def test_notify_path_and_abstract_sockets(tmp_path):
    receiver = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    receiver.bind(str(tmp_path / "notify"))
    receiver.settimeout(2)
    assert systemd.notify("READY=1\nSTATUS=ok", {"NOTIFY_SOCKET": str(tmp_path / "notify")})
    assert receiver.recv(4096) == b"READY=1\nSTATUS=ok"
    abstract = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    name = f"specd-test-{os.getpid()}-{time.monotonic_ns()}"
    abstract.bind("\0" + name)
    abstract.settimeout(2)
    assert systemd.notify("WATCHDOG=1", {"NOTIFY_SOCKET": "@" + name})
    assert abstract.recv(4096) == b"WATCHDOG=1"
    assert not systemd.notify("READY=1", {})
    assert not systemd.notify("READY=1", {"NOTIFY_SOCKET": "relative/path"})


def test_watchdog_interval():
    assert systemd.watchdog_interval({}) is None
    assert systemd.watchdog_interval({"WATCHDOG_USEC": "30000000"}) == 15.0
    assert systemd.watchdog_interval({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": str(os.getpid())}) == 15.0
    assert systemd.watchdog_interval({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "1"}) is None
    assert systemd.watchdog_interval({"WATCHDOG_USEC": "0"}) is None


# -- the real daemon under "systemd" ----------------------------------------------------------

# Put the listener at fd 3 and LISTEN_PID to our own pid, then exec the daemon: what systemd does
# between fork and exec.
LAUNCHER = (
    "import os, sys; fd = int(sys.argv[1]); os.dup2(fd, 3); os.close(fd); "
    "os.environ.update(LISTEN_PID=str(os.getpid()), LISTEN_FDS='1', LISTEN_FDNAMES='specd.socket'); "
    "os.execv(sys.executable, [sys.executable, '-m', 'specd', 'serve'])"
)


class ActivatedDaemon(DaemonProcess):
    def __init__(self, root: Path, listener: socket.socket, **kwargs):
        super().__init__(root, **kwargs)
        self.listener = listener

    def command(self) -> list[str]:
        return [sys.executable, "-c", LAUNCHER, str(self.listener.fileno())]

    def start(self, wait: bool = True, timeout: float = 60.0, **popen):
        return super().start(wait, timeout, pass_fds=(self.listener.fileno(),), **popen)


def _messages(receiver: socket.socket) -> list[str]:
    out = []
    receiver.setblocking(False)
    while True:
        try:
            out.extend(receiver.recv(4096).decode().splitlines())
        except BlockingIOError:
            return out


def test_socket_activation_with_notify_and_watchdog(tmp_path):
    path = tmp_path / "systemd-run" / "specd" / "specd.sock"  # as systemd makes %t/specd/specd.sock
    path.parent.mkdir(parents=True, mode=0o700)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    os.chmod(path, 0o600)
    listener.listen(16)
    receiver = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    receiver.bind(str(tmp_path / "notify"))
    env = {"NOTIFY_SOCKET": str(tmp_path / "notify"), "WATCHDOG_USEC": "200000"}
    d = ActivatedDaemon(tmp_path / "d", listener, config={"daemon.socket": str(path)}, env=env)
    try:
        d.start()
        listener.close()  # the daemon holds its own copy now, as it would from systemd
        with d.client() as c:
            assert c.hello()["state"] == "ready"
        own = d.root / "run" / "specd" / "specd.sock"
        assert not own.exists()  # it served the passed socket and bound none of its own
        received: list[str] = []
        wait_for(lambda: received.extend(_messages(receiver)) or received.count("WATCHDOG=1") >= 2, 10,
                 message="two WATCHDOG=1 pings")
        assert "READY=1" in received
        assert any(m.startswith("STATUS=") for m in received)
        assert d.terminate() == 0
        received.extend(_messages(receiver))
        assert "STOPPING=1" in received
        assert path.exists()  # systemd owns the activated socket file; the daemon leaves it
    finally:
        d.stop()
        receiver.close()


def test_ready_comes_only_after_the_models_load(tmp_path):
    receiver = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    receiver.bind(str(tmp_path / "notify"))
    env = {"NOTIFY_SOCKET": str(tmp_path / "notify"), "SPECD_TEST_FAKE_LOAD_S": "1.0"}
    d = DaemonProcess(tmp_path / "d", env=env)
    try:
        d.start(wait=False)
        d.wait_listening()
        with d.client() as c:
            assert c.status()["state"] == "loading"
            assert "READY=1" not in _messages(receiver)
        d.wait_ready()
        wait_for(lambda: "READY=1" in _messages(receiver), 5, message="READY=1")
    finally:
        d.stop()
        receiver.close()


# -- unit files ---------------------------------------------------------------------------------


def test_repository_units_are_the_packaged_ones():
    for name, text in systemd_units.UNITS.items():
        assert (UNIT_DIR / name).read_text(encoding="utf-8") == text, f"systemd/{name} differs from specd/systemd_units.py"
    socket_unit = systemd_units.SOCKET_UNIT
    assert "ListenStream=%t/specd/specd.sock" in socket_unit and "SocketMode=0600" in socket_unit
    service = systemd_units.SERVICE_UNIT
    for line in ("Type=notify", "WatchdogSec=", "Restart=on-failure"):
        assert line in service


def test_render_uses_this_interpreter_and_a_configured_socket():
    units = systemd_units.render(socket_path="/run/user/1000/custom.sock", python="/opt/py/bin/python3")
    assert "ExecStart=/opt/py/bin/python3 -m specd serve" in units["specd.service"]
    assert "ListenStream=/run/user/1000/custom.sock" in units["specd.socket"]


def _verify(tmp_path: Path, units: dict[str, str]) -> subprocess.CompletedProcess[str]:
    for name, text in units.items():
        (tmp_path / name).write_text(text, encoding="utf-8")
    runtime = tmp_path / "xdg-runtime"
    runtime.mkdir(mode=0o700, exist_ok=True)
    env = {**os.environ, "XDG_RUNTIME_DIR": str(runtime), "SYSTEMD_LOG_LEVEL": "notice"}
    return subprocess.run(["systemd-analyze", "verify", "--user", *(str(tmp_path / n) for n in units)],
                          capture_output=True, text=True, env=env, timeout=60, cwd=tmp_path)


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
@pytest.mark.parametrize("which", ["repository", "rendered"])
def test_systemd_analyze_verify(tmp_path, which):
    units = systemd_units.UNITS if which == "repository" else systemd_units.render()
    done = _verify(tmp_path, units)
    assert done.returncode == 0, done.stderr
    assert done.stderr.strip() == "", done.stderr  # no warnings either (unknown keys, bad values)


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_systemd_analyze_catches_a_broken_unit(tmp_path):
    broken = dict(systemd_units.UNITS)
    broken["specd.service"] = broken["specd.service"].replace("Type=notify", "Typ=notify")
    assert "Unknown key" in _verify(tmp_path, broken).stderr  # so the lint above is not vacuous


# -- install-service ----------------------------------------------------------------------------


def _cfg(**env):
    from specd.config import load_config

    return load_config(environ=env)


def test_install_service_writes_units_and_prints_commands(tmp_path, capsys):
    args = Namespace(unit_dir=str(tmp_path / "units"), enable=False)
    assert commands.install_service(args, _cfg()) == 0
    out = capsys.readouterr().out
    assert "systemctl --user daemon-reload" in out and "systemctl --user enable --now specd.socket" in out
    service = (tmp_path / "units" / "specd.service").read_text()
    assert f"ExecStart={sys.executable} -m specd serve" in service
    assert (tmp_path / "units" / "specd.socket").read_text() == systemd_units.render()["specd.socket"]


def test_install_service_default_dir_and_enable_runs_systemctl(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "systemctl.log"
    fake = bin_dir / "systemctl"
    fake.write_text(f"#!/bin/sh\necho \"$@\" >> {log}\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    args = Namespace(unit_dir=None, enable=True)
    assert commands.install_service(args, _cfg(SPECD_DAEMON_SOCKET="/tmp/x/specd.sock")) == 0
    unit_dir = tmp_path / "config" / "systemd" / "user"
    assert "ListenStream=/tmp/x/specd.sock" in (unit_dir / "specd.socket").read_text()
    assert log.read_text().splitlines() == ["--user daemon-reload", "--user enable --now specd.socket"]
