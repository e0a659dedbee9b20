"""systemd integration written by hand: socket activation and sd_notify, no libsystemd.

Both protocols are tiny. Activation: systemd passes listening sockets as fds 3..3+N-1 and
sets LISTEN_FDS=N and LISTEN_PID=<our pid> (sd_listen_fds(3)). Notification: a datagram of
``KEY=VALUE`` lines sent to the socket named by NOTIFY_SOCKET, where a leading ``@`` means the
abstract namespace (sd_notify(3)).
"""

from __future__ import annotations

import os
import socket

SD_LISTEN_FDS_START = 3


def listen_fds(unset_environment: bool = True) -> list[socket.socket]:
    """The sockets systemd passed us, or [] when we were not socket-activated."""
    try:
        pid = int(os.environ.get("LISTEN_PID", ""))
        count = int(os.environ.get("LISTEN_FDS", ""))
    except ValueError:
        return []
    finally:
        if unset_environment:  # children we spawn must not think the fds are theirs
            for name in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"):
                os.environ.pop(name, None)
    if pid != os.getpid() or count <= 0:
        return []
    sockets = []
    for fd in range(SD_LISTEN_FDS_START, SD_LISTEN_FDS_START + count):
        os.set_inheritable(fd, False)
        sockets.append(socket.socket(fileno=fd))  # family and type are read from the fd
    return sockets


def notify(state: str, environ: dict[str, str] | None = None) -> bool:
    """Send ``state`` (e.g. "READY=1") to systemd; False when not run under a notify service."""
    address = (environ if environ is not None else os.environ).get("NOTIFY_SOCKET", "")
    if not address or address[0] not in ("/", "@"):
        return False
    if address[0] == "@":
        address = "\0" + address[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.sendto(state.encode("utf-8"), address)
        return True
    except OSError:
        return False


def watchdog_interval(environ: dict[str, str] | None = None) -> float | None:
    """Seconds between WATCHDOG=1 pings (half of WatchdogSec), or None when there is no watchdog."""
    env = environ if environ is not None else os.environ
    try:
        usec = int(env.get("WATCHDOG_USEC", ""))
    except ValueError:
        return None
    pid = env.get("WATCHDOG_PID")
    if usec <= 0 or (pid and pid != str(os.getpid())):
        return None
    return usec / 2 / 1_000_000
