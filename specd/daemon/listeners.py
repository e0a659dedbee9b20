"""Where the daemon listens, and the checks that keep those places private.

The Unix socket lives in a directory only its user can enter (0700, owned by that user, not a
symlink); the daemon creates that directory, or checks an existing one and refuses it with one
line when it is not private. It never changes the mode of a directory it did not create (a
1777 ``/tmp``, or whatever a planted symlink points at). The lock file beside the socket is
opened without following symlinks. The TCP listener binds loopback addresses only.
"""

from __future__ import annotations

import errno
import fcntl
import ipaddress
import logging
import os
import socket
import stat
import struct
from pathlib import Path

from specd.config import parse_loopback_address

log = logging.getLogger("specd.daemon")

PRIVATE_DIR_MODE = 0o700


class StartupError(Exception):
    """The daemon cannot start (socket in use, bad TCP config); the message is one line."""

    exit_code = 1


class UnusableRuntimeDir(StartupError):
    """The runtime directory or a file in it cannot be made (no inodes or space, no permission),
    or what stands there is not ours to use (a file, a symlink, another user's or a shared
    directory, a non-socket at the socket path): the surroundings must change, as for a config
    error, so `specd serve` exits 2. Another daemon already serving stays exit 1."""

    exit_code = 2


def _runtime_error(action: str, path: Path, err: OSError) -> StartupError:
    """One line for an OSError met while making the socket's place: what failed, what to do."""
    if err.errno in (errno.ENOSPC, errno.EDQUOT):
        hint = "free space or inodes on its file system, or set daemon.socket to a path elsewhere"
    elif err.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        hint = "make it writable for this user, or set daemon.socket to a path elsewhere"
    else:
        hint = "set daemon.socket to a path elsewhere"
    return UnusableRuntimeDir(f"cannot {action} {path}: {err.strerror or err}; {hint}")


def peer_uid(sock: socket.socket) -> int | None:
    """The connecting process's uid from SO_PEERCRED (Linux), or None where unavailable."""
    if not hasattr(socket, "SO_PEERCRED"):
        return None
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", creds)
    return uid


def prepare_private_dir(directory: Path) -> None:
    """Create ``directory`` 0700, or check that an existing one is a real directory, ours and
    private. Refuses (StartupError, one line) instead of repairing what it did not create."""
    try:
        directory.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise _runtime_error("create", directory.parent, err) from None
    try:
        os.mkdir(directory, PRIVATE_DIR_MODE)
        created = True
    except FileExistsError:
        created = False
    except OSError as err:  # out of inodes, read-only, not ours to write
        raise _runtime_error("create", directory, err) from None
    info = os.lstat(directory)
    if stat.S_ISLNK(info.st_mode):
        raise UnusableRuntimeDir(f"{directory} is a symlink; refusing to use it (remove it, or set "
                                 "daemon.socket elsewhere)")
    if not stat.S_ISDIR(info.st_mode):
        raise UnusableRuntimeDir(f"{directory} exists and is not a directory (remove it, or set "
                                 "daemon.socket elsewhere)")
    if info.st_uid != os.getuid():
        raise UnusableRuntimeDir(f"{directory} belongs to uid {info.st_uid}, not to us (uid {os.getuid()})")
    mode = stat.S_IMODE(info.st_mode)
    if mode != PRIVATE_DIR_MODE:
        if not created:
            raise UnusableRuntimeDir(
                f"{directory} has mode {mode:04o}, not 0700: other users could reach the socket; "
                f"run `chmod 700 {directory}` or set daemon.socket to a private directory"
            )
        os.chmod(directory, PRIVATE_DIR_MODE)  # ours, just made: a umask cannot have widened it


def prepare_socket_dir(path: Path) -> None:
    """The socket's directory, private (see ``prepare_private_dir``)."""
    prepare_private_dir(path.parent)


def socket_is_live(path: Path, timeout: float = 1.0) -> bool:
    """True when something accepts connections on the Unix socket at ``path``."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(timeout)
    try:
        probe.connect(str(path))
        return True
    except OSError:
        return False
    finally:
        probe.close()


def bind_unix(path: Path) -> socket.socket:
    """Bind a listening Unix socket with mode 0600, replacing a stale file a crashed daemon left."""
    prepare_socket_dir(path)
    if path.exists() or path.is_symlink():
        if not stat.S_ISSOCK(path.lstat().st_mode):
            raise UnusableRuntimeDir(f"{path} exists and is not a socket; not touching it (move it, or "
                                     "set daemon.socket elsewhere)")
        if socket_is_live(path):
            raise StartupError(f"another daemon is already serving {path}")
        log.info("removing stale socket %s", path)
        path.unlink()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old_umask = os.umask(0o177)  # the socket file is born 0600: no window where others could connect
    try:
        sock.bind(str(path))
    except OSError as err:
        sock.close()
        if err.errno in (errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EROFS):
            raise _runtime_error("bind", path, err) from None
        raise StartupError(f"cannot bind {path}: {err.strerror}") from None
    finally:
        os.umask(old_umask)
    os.chmod(path, 0o600)
    sock.listen(128)
    return sock


def bind_tcp(spec: str) -> socket.socket:
    """A loopback-only TCP listener for ``HOST:PORT`` (the config's rule: port 1-65535)."""
    try:
        host, port = parse_loopback_address(spec)
    except ValueError as err:
        raise StartupError(f"daemon.tcp {spec!r} {err}") from None
    family = socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        raise StartupError(f"cannot listen on {spec}: {err.strerror}") from None
    sock.listen(128)
    return sock


def open_private_file(path: Path, flags: int = os.O_RDWR) -> int:
    """Open (creating 0600) a file we own, never through a symlink; returns the descriptor."""
    try:
        # O_NONBLOCK: a FIFO planted there fails or opens at once instead of waiting for a peer.
        fd = os.open(path, flags | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY, 0o600)
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise UnusableRuntimeDir(f"{path} is a symlink; refusing to open it") from None
        if err.errno == errno.ENXIO:  # a FIFO with no reader (O_NONBLOCK)
            raise UnusableRuntimeDir(f"{path} is not a regular file of ours; refusing to use it") from None
        raise _runtime_error("create", path, err) from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid():
        os.close(fd)
        raise UnusableRuntimeDir(f"{path} is not a regular file of ours; refusing to use it")
    os.set_blocking(fd, True)
    return fd


class RuntimeLock:
    """An flock next to the socket, held for the daemon's life: one daemon per socket path."""

    def __init__(self, socket_path: Path):
        self.path = socket_path.with_name(socket_path.name + ".lock")
        self._fd: int | None = None

    def acquire(self) -> None:
        prepare_socket_dir(self.path)
        fd = open_private_file(self.path)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            os.close(fd)
            if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise StartupError(f"another specd daemon holds {self.path}") from None
            raise
        try:  # the pid is for people reading the file; the lock is what matters
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())
        except OSError as err:  # a full file system: the daemon serves on without it
            log.warning("cannot write the pid to %s: %s", self.path, err.strerror)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
