"""Logging to stderr and to the state-dir log file; never to stdout (stdout may be a protocol)."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

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
            log_file.parent.mkdir(parents=True, exist_ok=True)
            file_handler = logging.FileHandler(log_file, encoding="utf-8")
        except OSError as err:  # an unwritable state dir must not stop the daemon
            logging.getLogger("specd").warning("cannot write log file %s: %s", log_file, err)
        else:
            file_handler.setFormatter(formatter)
            root.addHandler(file_handler)
    # Third-party chatter stays at warning unless we debug.
    for noisy in ("transformers", "urllib3", "filelock", "watchdog"):
        logging.getLogger(noisy).setLevel(logging.DEBUG if level == "debug" else logging.WARNING)
