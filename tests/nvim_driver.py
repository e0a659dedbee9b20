"""A Neovim driven as a person drives it: ``nvim --embed`` with a UI attached (the screen is read
back cell by cell, with each cell's highlight), keys typed through ``nvim_input``.

msgpack-rpc over the child's stdin/stdout, the same framing specd's socket uses. One reader
thread takes every message: responses wake the request waiting for them, ``redraw``
notifications update the screen (ext_linegrid events), and each ``flush`` publishes a snapshot
with the time it arrived, so a test can say when something appeared on screen.
"""

from __future__ import annotations

import itertools
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import msgpack

REQUEST, RESPONSE, NOTIFICATION = 0, 1, 2


class NvimError(Exception):
    pass


@dataclass
class Screen:
    """The default grid as the UI sees it: rows of (text, highlight id) cells."""

    width: int = 0
    height: int = 0
    cells: list[list[list[Any]]] = field(default_factory=list)
    highlights: dict[int, dict[str, Any]] = field(default_factory=lambda: {0: {}})  # id -> cterm attributes
    cursor: tuple[int, int] = (0, 0)

    def resize(self, width: int, height: int) -> None:
        self.width, self.height = width, height
        self.cells = [[[" ", 0] for _ in range(width)] for _ in range(height)]

    def line(self, row: int, col: int, cells: list[list[Any]]) -> None:
        hl = 0
        for cell in cells:
            text = cell[0]
            if len(cell) > 1:
                hl = cell[1]
            repeat = cell[2] if len(cell) > 2 else 1
            for _ in range(repeat):
                if 0 <= row < self.height and 0 <= col < self.width:
                    self.cells[row][col] = [text, hl]
                col += 1

    def scroll(self, top: int, bot: int, left: int, right: int, rows: int) -> None:
        if rows > 0:
            order = range(top, bot - rows)
        else:
            order = range(bot - 1, top - rows - 1, -1)
        for row in order:
            self.cells[row][left:right] = [list(c) for c in self.cells[row + rows][left:right]]

    def text(self, row: int) -> str:
        return "".join(cell[0] for cell in self.cells[row])

    def attrs(self, row: int, col: int) -> dict[str, Any]:
        return self.highlights.get(self.cells[row][col][1], {})

    def snapshot(self) -> Screen:
        copy = Screen(self.width, self.height, [[list(c) for c in row] for row in self.cells], dict(self.highlights),
                      self.cursor)
        return copy


class Nvim:
    """``nvim --embed`` with a UI of ``width`` x ``height`` cells; ``rgb=False`` is a terminal
    without 'termguicolors' (cells carry cterm attributes)."""

    def __init__(self, nvim: str, args: list[str], cwd: Path, env: dict[str, str], width: int = 100,
                 height: int = 30, rgb: bool = False):
        self.proc = subprocess.Popen([nvim, "--embed", *args], cwd=cwd, env=env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self._ids = itertools.count(1)
        self._pending: dict[int, list[Any]] = {}
        self._cond = threading.Condition()
        self._screen = Screen()
        self.flushes: list[tuple[float, Screen]] = []  # (time.monotonic(), screen) after each flush
        self.closed = False
        self._reader = threading.Thread(target=self._read, name="nvim-reader", daemon=True)
        self._reader.start()
        # --embed without --headless waits for a UI before it reads the user's init.lua, as the TUI does.
        self.request("nvim_ui_attach", width, height, {"rgb": rgb, "ext_linegrid": True})

    # -- rpc -------------------------------------------------------------------------------

    def _read(self) -> None:
        unpacker = msgpack.Unpacker(raw=False, strict_map_key=False)
        stdout = self.proc.stdout
        while True:
            chunk = stdout.read1(65536) if hasattr(stdout, "read1") else stdout.read(65536)
            if not chunk:
                break
            unpacker.feed(chunk)
            for message in unpacker:
                self._dispatch(message)
        with self._cond:
            self.closed = True
            self._cond.notify_all()

    def _dispatch(self, message: list[Any]) -> None:
        kind = message[0]
        if kind == RESPONSE:
            with self._cond:
                self._pending[message[1]] = message
                self._cond.notify_all()
        elif kind == NOTIFICATION and message[1] == "redraw":
            self._redraw(message[2])
        elif kind == REQUEST:  # nothing here serves requests from Neovim
            self._send([RESPONSE, message[1], "no handler", None])

    def _send(self, message: list[Any]) -> None:
        self.proc.stdin.write(msgpack.packb(message, use_bin_type=True))
        self.proc.stdin.flush()

    def request(self, method: str, *args: Any, timeout: float = 60.0) -> Any:
        msgid = next(self._ids)
        with self._cond:
            self._send([REQUEST, msgid, method, list(args)])
            if not self._cond.wait_for(lambda: msgid in self._pending or self.closed, timeout):
                raise TimeoutError(f"{method}: no answer within {timeout} s")
            if msgid not in self._pending:
                raise NvimError(f"{method}: nvim exited: {self.proc.stderr.read().decode(errors='replace')[-2000:]}")
            _, _, error, result = self._pending.pop(msgid)
        if error:
            raise NvimError(f"{method}: {error}")
        return result

    def lua(self, code: str, *args: Any) -> Any:
        return self.request("nvim_exec_lua", code, list(args))

    def command(self, command: str) -> None:
        self.request("nvim_command", command)

    def input(self, keys: str) -> float:
        """Types keys as if at the keyboard (mappings apply); returns when they were sent."""
        sent = time.monotonic()
        self.request("nvim_input", keys)
        return sent

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self._send([NOTIFICATION, "nvim_command", ["qall!"]])
                self.proc.wait(5)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(5)

    # -- screen ----------------------------------------------------------------------------

    def _redraw(self, events: list[Any]) -> None:
        screen = self._screen
        for event in events:
            name, calls = event[0], event[1:]
            for args in calls:
                if name == "grid_resize":
                    screen.resize(args[1], args[2])
                elif name == "grid_clear":
                    screen.resize(screen.width, screen.height)
                elif name == "grid_line":
                    screen.line(args[1], args[2], args[3])
                elif name == "grid_scroll":
                    screen.scroll(args[1], args[2], args[3], args[4], args[5])
                elif name == "grid_cursor_goto":
                    screen.cursor = (args[1], args[2])
                elif name == "hl_attr_define":
                    screen.highlights[args[0]] = args[2]  # cterm attributes (rgb=False)
                elif name == "flush":
                    with self._cond:
                        self.flushes.append((time.monotonic(), screen.snapshot()))
                        self._cond.notify_all()

    @property
    def screen(self) -> Screen:
        with self._cond:
            return self.flushes[-1][1] if self.flushes else self._screen.snapshot()

    def wait_screen(self, condition: Callable[[Screen], Any], timeout: float, what: str,
                    since: float = 0.0) -> tuple[float, Any]:
        """The first flush at or after ``since`` whose screen satisfies ``condition``: (its time,
        the condition's value). Waits for new flushes up to ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        seen = 0
        with self._cond:
            while True:
                for index in range(seen, len(self.flushes)):
                    at, screen = self.flushes[index]
                    if at >= since:
                        value = condition(screen)
                        if value:
                            return at, value
                seen = len(self.flushes)
                left = deadline - time.monotonic()
                if left <= 0 or self.closed:
                    last = self.flushes[-1][1] if self.flushes else self._screen
                    rows = "\n".join(f"{row:2d}|{last.text(row)}" for row in range(last.height))
                    raise AssertionError(f"timed out after {timeout} s waiting for {what}; the screen:\n{rows}")
                self._cond.wait(min(left, 0.5))

    def wait(self, code: str, timeout: float, what: str, *args: Any) -> Any:
        """Polls a Lua expression in Neovim until it is truthy (bounded)."""
        deadline = time.monotonic() + timeout
        while True:
            value = self.lua(code, *args)
            if value:
                return value
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout} s waiting for {what} (last: {value!r})")
            time.sleep(0.02)
