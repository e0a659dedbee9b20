"""Logging to stderr and to the state-dir log file; never to stdout (stdout may be a protocol).

Log and state files are opened only when they are regular files of ours: never through a
symlink, and never a FIFO, device or socket (opening a FIFO for writing waits for a reader, so
a planted one would hang whoever opens it). A destination that stops taking writes (a full
disk, a closed stderr) is dropped on its first error and named once: on the other destination
when one is left, and in ``log_losses()``, which the daemon's ``status`` reports.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import sys
import threading
from pathlib import Path
from typing import IO

FORMAT = "%(asctime)s %(levelname)-7s %(name)s: %(message)s"

SPAWN_LOG_TAIL_BYTES = 64 * 1024  # what ``read_private_tail`` reads: a last line, not a whole log

# O_NONBLOCK: opening a FIFO then fails (no reader) or returns at once instead of waiting for a
# reader; O_NOCTTY: a terminal device opened by mistake never becomes our controlling terminal.
_SAFE_OPEN_FLAGS = os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY

_losses: list[str] = []
_losses_lock = threading.Lock()


class StateFileError(OSError):
    """A log or state file specd cannot use as it stands (a symlink, a FIFO, a device, no space,
    no permission). The message is one line: what is wrong and what to do."""


def log_losses() -> list[str]:
    """One line per log destination dropped since this process started, oldest first."""
    with _losses_lock:
        return list(_losses)


def _record_loss(line: str) -> None:
    with _losses_lock:
        if line not in _losses:
            _losses.append(line)


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISDIR, "a directory"), (stat.S_ISLNK, "a symlink")):
        if test(mode):
            return name
    return "not a regular file"


def _not_regular(path: Path, mode: int) -> StateFileError:
    return StateFileError(f"{path} is {_kind(mode)}, not a regular file; remove it "
                          "(specd creates a regular file of its own there)")


def _hint(err: OSError) -> str:
    if err.errno in (errno.ENOSPC, errno.EDQUOT):
        return "free space (or inodes) on its file system"
    if err.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return "make it writable for this user"
    return "check the path"


def _cannot(action: str, path: Path, err: OSError) -> StateFileError:
    if err.errno == errno.ELOOP:
        return StateFileError(f"{path} is a symlink; specd never writes through one: remove it")
    reason = err.strerror or str(err)
    return StateFileError(f"cannot {action} {path}: {reason}; {_hint(err)}")


def make_private_dir(directory: Path) -> None:
    """Create ``directory`` (and its parents) 0700 when missing; an existing one is left as it is.
    Raises StateFileError (one line) when it cannot be created."""
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    except FileExistsError:  # a file, or a dangling symlink, where the directory should be
        raise StateFileError(f"{directory} exists and is not a directory; remove it or point specd elsewhere") from None
    except OSError as err:
        raise _cannot("create the directory", directory, err) from None


def _open_regular(path: Path, flags: int) -> int:
    """A descriptor on ``path`` only if it is (or is created as) a regular file."""
    try:
        before = os.lstat(path)
    except FileNotFoundError:
        pass
    except OSError as err:
        raise _cannot("open", path, err) from None
    else:
        if not stat.S_ISREG(before.st_mode):  # refused without opening: no device is touched
            if stat.S_ISLNK(before.st_mode):
                raise StateFileError(f"{path} is a symlink; specd never writes through one: remove it")
            raise _not_regular(path, before.st_mode)
    try:
        fd = os.open(path, flags | _SAFE_OPEN_FLAGS, 0o600)
    except OSError as err:
        if err.errno == errno.ENXIO:  # a FIFO with no reader, swapped in since the lstat
            raise _not_regular(path, stat.S_IFIFO) from None
        raise _cannot("open", path, err) from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):  # swapped in between the lstat and the open
            raise _not_regular(path, info.st_mode)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_private(path: Path, mode: str = "a") -> IO[str]:
    """Open a log file of ours for writing: created 0600, a regular file only (never through a
    symlink, never a FIFO, device or socket); an existing file we own is narrowed to 0600
    (completions' context is in it). Its directory is created 0700 when missing; an existing one
    is left as it is. Raises StateFileError, one line, when the file cannot be used."""
    make_private_dir(path.parent)
    flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if mode == "a" else os.O_TRUNC)
    fd = _open_regular(path, flags)
    try:
        info = os.fstat(fd)
        if stat.S_IMODE(info.st_mode) & 0o077 and info.st_uid == os.getuid():
            os.fchmod(fd, 0o600)
        return open(fd, mode, encoding="utf-8", closefd=True)
    except BaseException:
        os.close(fd)
        raise


def read_private_tail(path: Path, limit: int = SPAWN_LOG_TAIL_BYTES) -> str:
    """The last ``limit`` bytes of a log file of ours, as text; StateFileError (OSError) when it
    is missing or not a regular file (a FIFO would block a plain read until a writer came)."""
    fd = _open_regular(path, os.O_RDONLY)
    with open(fd, "rb", closefd=True) as file:
        size = os.fstat(fd).st_size
        if size > limit:
            file.seek(size - limit)
        return file.read(limit).decode("utf-8", errors="replace")


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever sys.stderr is at emit time (it may be swapped, e.g. by test capture).
    Its first write error (stderr on a full disk, or closed) drops it, named once on the log
    file when there is one."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)
        self.lost = False

    @property
    def stream(self):  # type: ignore[override]
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass

    def emit(self, record: logging.LogRecord) -> None:
        if not self.lost:
            super().emit(record)

    def handleError(self, record: logging.LogRecord) -> None:  # noqa: N802 - logging's name
        error = sys.exc_info()[1]
        if not isinstance(error, OSError):
            super().handleError(record)
            return
        self.lost = True
        line = f"cannot write to stderr ({error}); logging to the log file only"
        _record_loss(line)
        # The other handlers, if any, carry the note; this one is muted, so it cannot recurse.
        logging.getLogger("specd").warning("%s", line)


class _PrivateFileHandler(logging.FileHandler):
    """A FileHandler on ``open_private``; the first write error (a full disk) is reported in one
    line and the file dropped, instead of a traceback for every record after it."""

    def __init__(self, filename: Path) -> None:
        super().__init__(filename, encoding="utf-8")
        self.lost = False

    def _open(self):  # type: ignore[override]
        return open_private(Path(self.baseFilename), self.mode)

    def emit(self, record: logging.LogRecord) -> None:
        if not self.lost:
            super().emit(record)

    def handleError(self, record: logging.LogRecord) -> None:  # noqa: N802 - logging's name
        error = sys.exc_info()[1]
        self.lost = True
        line = f"cannot write log file {self.baseFilename} ({error}); logging to stderr only"
        _record_loss(line)
        try:
            sys.stderr.write(f"specd: {line}\n")
            sys.stderr.flush()
        except Exception:  # stderr itself may be gone (the same full disk)
            pass
        try:
            self.close()
        except Exception:  # closing flushes, into the same error
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
            file_handler = _PrivateFileHandler(log_file)
        except OSError as err:  # an unusable log file must not stop the daemon: stderr only
            line = f"{err}; logging to stderr only" if isinstance(err, StateFileError) else \
                f"cannot write log file {log_file}: {err}; logging to stderr only"
            _record_loss(line)
            logging.getLogger("specd").warning("%s", line)
        else:
            file_handler.setFormatter(formatter)
            root.addHandler(file_handler)
    # Third-party chatter stays at warning unless we debug.
    for noisy in ("transformers", "urllib3", "filelock", "watchdog"):
        logging.getLogger(noisy).setLevel(logging.DEBUG if level == "debug" else logging.WARNING)
