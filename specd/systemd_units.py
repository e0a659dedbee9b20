"""The systemd user units, shipped inside the package (``specd install-service`` writes them).

The repository's ``systemd/specd.socket`` and ``systemd/specd.service`` are these texts
verbatim (a test keeps them equal). ``render`` fills in this installation's interpreter and,
when configured, a non-default socket path.
"""

from __future__ import annotations

import sys
import sysconfig
from pathlib import Path

SOCKET_UNIT = """\
[Unit]
Description=specd code-completion daemon socket

[Socket]
ListenStream=%t/specd/specd.sock
SocketMode=0600
DirectoryMode=0700
# One daemon serves every connection (Accept=no): the models are loaded once.
Accept=no

[Install]
WantedBy=sockets.target
"""

SERVICE_UNIT = """\
[Unit]
Description=specd code-completion daemon (lossless speculative decoding)
Requires=specd.socket
After=specd.socket
# A daemon that cannot load its models should not restart forever.
StartLimitIntervalSec=120
StartLimitBurst=4

[Service]
Type=notify
NotifyAccess=main
ExecStart=/usr/bin/env specd serve
# READY=1 comes once the models are loaded, which can take minutes for large ones.
TimeoutStartSec=600
# WATCHDOG=1 pings every WatchdogSec/2 while the event loop and the model thread live.
WatchdogSec=30
Restart=on-failure
RestartSec=2
# Exit status 2 is a config error: restarting cannot fix it.
RestartPreventExitStatus=2
# SIGTERM lets the running completion answer and removes nothing systemd owns.
TimeoutStopSec=30
KillMode=mixed
NoNewPrivileges=yes

[Install]
Also=specd.socket
"""

UNITS = {"specd.socket": SOCKET_UNIT, "specd.service": SERVICE_UNIT}


def _exec_start(python: str) -> str:
    return f"ExecStart={python} -m specd serve"


def render(socket_path: str | None = None, python: str | None = None) -> dict[str, str]:
    """The unit texts for this installation: {file name: text}."""
    python = python or sys.executable
    service = SERVICE_UNIT.replace("ExecStart=/usr/bin/env specd serve", _exec_start(python))
    package_root = Path(__file__).resolve().parent.parent
    installed = {Path(sysconfig.get_paths()[key]).resolve() for key in ("purelib", "platlib")}
    if package_root not in installed:  # a source checkout: the interpreter must be told where specd is
        service = service.replace(
            _exec_start(python), f"Environment=PYTHONPATH={package_root}\n{_exec_start(python)}"
        )
    socket_unit = SOCKET_UNIT
    if socket_path:
        socket_unit = socket_unit.replace("ListenStream=%t/specd/specd.sock", f"ListenStream={socket_path}")
    return {"specd.socket": socket_unit, "specd.service": service}
