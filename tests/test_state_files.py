"""Log and state files that are not what specd expects, and a daemon that must stop whatever its
threads hold: a FIFO, socket, directory or symlink at a log path, a full disk under the logs, a
runtime directory that cannot be made, a load stuck on a progress bar's lock. Each ends in one
line (exit 2 from the CLI) or in the daemon serving on, and none hangs."""

from __future__ import annotations

import errno
import logging
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from daemon_helpers import REPO, DaemonProcess, base_env, wait_for
from specd import logs
from specd.logs import StateFileError, open_private, read_private_tail

HANG_S = 5.0  # nothing here may take longer than this to answer or to stop


@pytest.fixture
def fresh_losses(monkeypatch):
    monkeypatch.setattr(logs, "_losses", [])


def _plant(path: Path, kind: str) -> None:
    """Something that is not a regular file of ours at ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "symlink":
        path.symlink_to(path.parent / "elsewhere.log")
    elif kind == "directory":
        path.mkdir()
    elif kind == "socket":
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(str(path))
        sock.close()
    else:
        raise AssertionError(kind)


KINDS = [("fifo", "is a FIFO"), ("symlink", "is a symlink"), ("socket", "is a socket"), ("directory", "is a directory")]


def _run_cli(args: list[str], env: dict[str, str], timeout: float = 60.0) -> tuple[subprocess.CompletedProcess, float]:
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "specd", *args], env=env, cwd=str(REPO), capture_output=True,
                          text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    return proc, time.monotonic() - started


def _stop_with_the_cli(d: DaemonProcess) -> None:
    """``specd stop`` ends the daemon, cleanly and within HANG_S."""
    proc, took = _run_cli(["stop"], d.env)
    assert proc.returncode == 0, proc.stderr
    assert d.proc.wait(HANG_S) == 0 and took < HANG_S


def _specd_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


# -- opening ---------------------------------------------------------------------------------


@pytest.mark.parametrize("kind, fragment", KINDS)
@pytest.mark.parametrize("mode", ["a", "w"])
def test_open_private_refuses_what_is_not_a_regular_file_at_once(tmp_path, kind, fragment, mode):
    path = tmp_path / "state" / "specd.log"
    _plant(path, kind)
    started = time.monotonic()
    with pytest.raises(StateFileError, match=fragment) as info:
        open_private(path, mode)
    assert time.monotonic() - started < 1.0
    assert "\n" not in str(info.value) and str(path) in str(info.value) and "remove it" in str(info.value)


def test_a_fifo_with_a_reader_is_refused_too(tmp_path):
    """Opening succeeds when someone reads the FIFO; the type check after the open refuses it."""
    path = tmp_path / "specd.log"
    os.mkfifo(path)
    reader = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        with pytest.raises(StateFileError, match="is a FIFO"):
            open_private(path)
        with pytest.raises(StateFileError, match="is a FIFO"):
            logs._open_regular(path, os.O_WRONLY)  # past the lstat: the fstat after the open
    finally:
        os.close(reader)


def test_reading_the_spawn_log_never_blocks_on_a_fifo(tmp_path):
    path = tmp_path / "spawn.log"
    os.mkfifo(path)
    with pytest.raises(StateFileError, match="is a FIFO"):
        read_private_tail(path)
    path.unlink()
    path.write_text("x" * 100 + "\nspecd: the last word\n")
    assert read_private_tail(path, limit=30).endswith("specd: the last word\n")


def test_a_directory_that_cannot_be_made_is_one_line(tmp_path, monkeypatch):
    def no_inodes(self, *args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(Path, "mkdir", no_inodes)
    with pytest.raises(StateFileError) as info:
        open_private(tmp_path / "state" / "specd.log")
    assert "No space left on device" in str(info.value) and "free space" in str(info.value)


# -- write errors: a full disk ---------------------------------------------------------------


def test_a_log_file_on_a_full_disk_is_dropped_and_named_once(tmp_path, fresh_losses, capsys):
    handler = logs._PrivateFileHandler(tmp_path / "specd.log")
    handler.stream.close()
    handler.stream = open("/dev/full", "w", encoding="utf-8")  # every write fails with ENOSPC
    logger = logging.getLogger("specd.test_full_disk")
    logger.propagate = False
    logger.addHandler(handler)
    try:
        for number in range(5):
            logger.warning("record %d", number)
    finally:
        logger.removeHandler(handler)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot write log file" in err and "No space left on device" in err
    assert len(logs.log_losses()) == 1 and "specd.log" in logs.log_losses()[0]
    assert handler.lost


def test_stderr_on_a_full_disk_is_dropped_and_named_on_the_log_file(tmp_path, fresh_losses):
    log_file = tmp_path / "specd.log"
    full = open("/dev/full", "w", encoding="utf-8", buffering=1)
    saved = logging.getLogger().handlers[:], logging.getLogger().level, sys.stderr
    sys.stderr = full
    try:
        logs.setup_logging("info", log_file)
        for number in range(5):
            logging.getLogger("specd").info("record %d", number)
    finally:
        root = logging.getLogger()
        for handler in root.handlers[:]:
            root.removeHandler(handler)
            handler.close()
        for handler in saved[0]:
            root.addHandler(handler)
        root.setLevel(saved[1])
        sys.stderr = saved[2]
        try:
            full.close()
        except OSError:
            pass
    text = log_file.read_text()
    assert text.count("cannot write to stderr") == 1 and text.count("record") == 5
    assert len(logs.log_losses()) == 1 and "cannot write to stderr" in logs.log_losses()[0]


def test_model_loading_draws_no_progress_bar_on_a_full_disk(tiny_root):
    """transformers' loading bars go to stderr; on a non-terminal stderr that fails (the spawn
    log on a full disk), the load still succeeds."""
    from tiny import make_tiny_pair
    from specd.engine.models import load_pair
    from transformers.utils import logging as hf_logging

    target, draft = make_tiny_pair(tiny_root / "llama", "llama")
    full = open("/dev/full", "w", encoding="utf-8", buffering=1)
    saved, sys.stderr = sys.stderr, full
    try:
        pair = load_pair(str(target), str(draft), device="cpu")
    finally:
        sys.stderr = saved
        try:
            full.close()
        except OSError:
            pass
    assert pair.target is not None and pair.draft is not None
    assert hf_logging.is_progress_bar_enabled()  # restored for whoever draws on a terminal


# -- the CLI and the daemon ------------------------------------------------------------------


@pytest.mark.parametrize("kind, fragment", KINDS)
def test_spawn_log_that_is_not_a_regular_file_is_one_line_exit_2(tmp_path, kind, fragment):
    env = base_env(tmp_path)
    spawn_log = Path(env["XDG_STATE_HOME"]) / "specd" / "spawn.log"
    _plant(spawn_log, kind)
    source = tmp_path / "a.py"
    source.write_text("def f(\n")
    proc, took = _run_cli(["complete", "--line", "1", "--col", "6", str(source)], env)
    assert proc.returncode == 2, proc.stderr
    assert _specd_lines(proc.stderr) == [proc.stderr.strip()] and fragment in proc.stderr
    assert str(spawn_log) in proc.stderr and "Traceback" not in proc.stderr
    assert took < HANG_S
    assert not (Path(env["XDG_RUNTIME_DIR"]) / "specd" / "specd.sock").exists()  # nothing was spawned


def test_daemon_serves_on_with_a_fifo_at_its_log_file(tmp_path):
    d = DaemonProcess(tmp_path / "d")
    log_file = Path(d.env["XDG_STATE_HOME"]) / "specd" / "specd.log"
    _plant(log_file, "fifo")
    started = time.monotonic()
    d.start(wait=False)
    try:
        d.wait_listening(timeout=HANG_S)
        assert time.monotonic() - started < HANG_S
        with d.client() as client:
            assert client.complete(text="abc", cursor=3)["text"] == "[abc]"
            errors = client.status()["log_errors"]
        assert len(errors) == 1 and "is a FIFO" in errors[0] and "logging to stderr only" in errors[0]
        assert d.stderr().count("is a FIFO") == 1
        _stop_with_the_cli(d)
    finally:
        d.stop()


def test_daemon_with_stderr_on_a_full_disk_serves_and_stops(tmp_path):
    """The spawned daemon's stderr is the spawn log: on a full disk every write to it fails."""
    d = DaemonProcess(tmp_path / "d")
    with open("/dev/full", "wb") as full:
        d.proc = subprocess.Popen(d.command(), env=d.env, cwd=str(REPO), stdin=subprocess.DEVNULL,
                                  stdout=subprocess.DEVNULL, stderr=full)
    try:
        d.wait_ready(timeout=30)
        with d.client() as client:
            assert client.complete(text="abc", cursor=3)["text"] == "[abc]"
            errors = client.status()["log_errors"]
        assert len(errors) == 1 and "cannot write to stderr" in errors[0]
        log_file = Path(d.env["XDG_STATE_HOME"]) / "specd" / "specd.log"
        assert log_file.read_text().count("cannot write to stderr") == 1
        _stop_with_the_cli(d)
    finally:
        d.stop()


@pytest.mark.slow
def test_real_daemon_loads_with_its_stderr_on_a_full_disk(tmp_path, tiny_root):
    """transformers' loading bars once failed the load with ENOSPC on a full spawn log."""
    from tiny import make_tiny_pair

    target, draft = make_tiny_pair(tiny_root / "llama", "llama")
    d = DaemonProcess(tmp_path / "d", engine="real",
                      config={"model.target": target, "model.draft": draft, "model.device": "cpu"})
    with open("/dev/full", "wb") as full:
        d.proc = subprocess.Popen(d.command(), env=d.env, cwd=str(REPO), stdin=subprocess.DEVNULL,
                                  stdout=subprocess.DEVNULL, stderr=full)
    try:
        info = d.wait_ready(timeout=120)
        assert "last_error" not in info
        proc, took = _run_cli(["stop"], d.env)
        assert proc.returncode == 0 and d.proc.wait(HANG_S) == 0, proc.stderr
    finally:
        d.stop()


def test_stop_ends_a_daemon_whose_load_is_stuck_on_a_progress_bar_lock(tmp_path):
    d = DaemonProcess(tmp_path / "d", engine="stuck_in_progress_bar")
    d.env["SPECD_TEST_ENGINE_FACTORY"] = "stuck_engine:stuck_in_progress_bar"
    d.start(wait=False)
    try:
        d.wait_listening(timeout=30)
        with d.client() as client:
            wait_for(lambda: client.status()["state"] == "loading", 10, 0.05, "the stuck load")
        started = time.monotonic()
        proc = subprocess.Popen([sys.executable, "-m", "specd", "stop"], env=d.env, cwd=str(REPO),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        code = d.proc.wait(HANG_S)
        ended = time.monotonic() - started
        out, err = proc.communicate(timeout=HANG_S)
        assert code == 0 and ended < HANG_S, err
        assert proc.returncode == 0 and "stopped the daemon" in out, err
    finally:
        d.kill()


@pytest.mark.parametrize("failure", [errno.ENOSPC, errno.EACCES])
def test_a_runtime_dir_that_cannot_be_made_is_one_line_exit_2(tmp_path, failure):
    """Out of inodes (ENOSPC from mkdir), or not writable (EACCES, as root cannot be refused by
    a mode): `specd serve` says what to fix in one line and exits 2."""
    env = base_env(tmp_path)
    runtime = Path(env["XDG_RUNTIME_DIR"]) / "specd"
    code = (
        "import os, sys\n"
        "real_mkdir = os.mkdir\n"
        "def mkdir(path, *args, **kwargs):\n"
        f"    if os.fspath(path) == {str(runtime)!r}:\n"
        f"        raise OSError({failure}, os.strerror({failure}), os.fspath(path))\n"
        "    return real_mkdir(path, *args, **kwargs)\n"
        "os.mkdir = mkdir\n"
        "from specd.cli import main\n"
        "sys.exit(main(['serve']))\n"
    )
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=str(REPO), capture_output=True, text=True,
                          timeout=60, stdin=subprocess.DEVNULL)
    assert time.monotonic() - started < 30
    lines = [line for line in proc.stderr.splitlines() if line.startswith("specd:")]
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1 and str(runtime) in lines[0] and os.strerror(failure) in lines[0], proc.stderr
    assert "daemon.socket" in lines[0] and "Traceback" not in proc.stderr


@pytest.mark.asyncio
async def test_lsp_reports_a_fifo_at_the_spawn_log_instead_of_spawning_for_ever(tmp_path):
    from lsp_helpers import lsp_session, server_env

    env = server_env(tmp_path)
    spawn_log = Path(env["XDG_STATE_HOME"]) / "specd" / "spawn.log"
    _plant(spawn_log, "fifo")
    started = time.monotonic()
    async with lsp_session(env, {"daemon": {"spawn": True}}, wait_ready=False) as session:
        status = await session.wait_state("unavailable", 30)
        await session.wait_for(lambda: session.messages, 10, "the message")
        assert time.monotonic() - started < 30
        message = session.messages[0].message
        assert "is a FIFO" in message and str(spawn_log) in message and "\n" not in message
        assert "is a FIFO" in status.get("reason", "") or "is a FIFO" in str(status)


RUNTIME_PLANTS = {
    "a file": ("exists and is not a directory", lambda path: path.write_text("")),
    "a symlink": ("is a symlink", lambda path: path.symlink_to(path.parent)),
    "a shared directory": ("has mode 0755", lambda path: (path.mkdir(), path.chmod(0o755))),
    "a file at the socket path": ("is not a socket", lambda path: (path.mkdir(mode=0o700),
                                                                   (path / "specd.sock").write_text("x"))),
}


@pytest.mark.parametrize("plant", sorted(RUNTIME_PLANTS))
def test_what_stands_at_the_runtime_dir_is_one_line_exit_2_from_serve_and_a_spawning_complete(tmp_path, plant):
    """The user must move it or set daemon.socket: exit 2 from `specd serve`, and from `specd
    complete` that spawned it, in one line each; what stood there is left as it was."""
    fragment, make = RUNTIME_PLANTS[plant]
    env = base_env(tmp_path)
    runtime = Path(env["XDG_RUNTIME_DIR"]) / "specd"
    make(runtime)
    def standing():  # what is there, less the lock file the daemon takes before binding
        return sorted(n for n in os.listdir(runtime) if not n.endswith(".lock")) if runtime.is_dir() else None

    before = standing()
    source = tmp_path / "a.py"
    source.write_text("def f(\n")
    for args in (["serve"], ["complete", "--line", "1", "--col", "6", str(source)]):
        proc, took = _run_cli(args, env)
        assert proc.returncode == 2, (args, proc.stderr)
        assert _specd_lines(proc.stderr) == [proc.stderr.strip()] and fragment in proc.stderr, (args, proc.stderr)
        assert "daemon.socket" in proc.stderr or "chmod 700" in proc.stderr
        assert took < HANG_S and proc.stdout == ""
    assert standing() == before
    if plant == "a file at the socket path":
        assert (runtime / "specd.sock").read_text() == "x"
