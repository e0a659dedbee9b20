"""Logging to stderr and to the state-dir log file; never to stdout (stdout may be a protocol)."""

from __future__ import annotations

import logging
import os
import stat
import sys
from pathlib import Path
from typing import IO

FORMAT = "%(asctime)s %(levelname)-7s %(name)s: %(message)s"


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever sys.stderr is at emit time (it may be swapped, e.g. by test capture)."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self):  # type: ignore[override]
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


def open_private(path: Path, mode: str = "a") -> IO[str]:
    """Open a log file of ours for writing: created 0600, never through a symlink; an existing
    file we own is narrowed to 0600 (completions' context is in it). Its directory is created
    0700 when missing; an existing one is left as it is."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    flags = os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | (os.O_APPEND if mode == "a" else os.O_TRUNC)
    fd = os.open(path, flags, 0o600)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise OSError(f"{path} is not a regular file")
        if stat.S_IMODE(info.st_mode) & 0o077 and info.st_uid == os.getuid():
            os.fchmod(fd, 0o600)
        return open(fd, mode, encoding="utf-8", closefd=True)
    except BaseException:
        os.close(fd)
        raise


class _PrivateFileHandler(logging.FileHandler):
    """A FileHandler on ``open_private``; the first write error (a full disk) is reported in one
    line and the file dropped, instead of a traceback for every record after it."""

    def _open(self):  # type: ignore[override]
        return open_private(Path(self.baseFilename), self.mode)

    def handleError(self, record: logging.LogRecord) -> None:  # noqa: N802 - logging's name
        error = sys.exc_info()[1]
        logging.getLogger().removeHandler(self)
        try:
            sys.stderr.write(f"specd: cannot write log file {self.baseFilename} ({error}); logging to stderr only\n")
        except Exception:  # stderr itself may be gone
            pass
        try:
            self.close()
        except Exception:
            pass


def setup_logging(level: str = "info", log_file: Path | None = None, stderr: bool = True) -> None:
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    root.setLevel(level.upper())
    formatter = logging.Formatter(FORMAT)
    if stderr:
        handler = _StderrHandler()
        handler.setFormatter(formatter)
        root.addHandler(handler)
    if log_file is not None:
        try:
            log_file.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            file_handler = _PrivateFileHandler(log_file, encoding="utf-8")
        except OSError as err:  # an unwritable state dir must not stop the daemon
            logging.getLogger("specd").warning("cannot write log file %s: %s", log_file, err)
        else:
            file_handler.setFormatter(formatter)
            root.addHandler(file_handler)
    # Third-party chatter stays at warning unless we debug.
    for noisy in ("transformers", "urllib3", "filelock", "watchdog"):
        logging.getLogger(noisy).setLevel(logging.DEBUG if level == "debug" else logging.WARNING)
