"""A person at a Neovim with the specd plugin: their home (XDG dirs, the plugin installed as the
README's native package, specd-lsp on PATH), held-out files they open (rich's modules, as
installed beside this Python: third-party code no model here was trained on) with a cursor deep
in a function body, the ghost text read off the screen (Neovim draws it italic), and a
``Person`` who types and times keystroke to ghost text on screen.

Shared by the end-to-end Neovim tests and ``scripts/first-suggestion``.
"""

from __future__ import annotations

import ast
import os
import time
from pathlib import Path

from daemon_helpers import REPO, daemon_idle
from nvim_driver import Nvim, Screen
from tools import BIN, find_tool

GHOST_S = 30  # a pause's suggestion, on a loaded 2-core machine
EDIT_S = 10
KEY_GAP_S = 0.06  # between keys inside a word: a quick typist
QUIET_S = 0.3  # a pause ends once the daemon is idle and the ghost text stayed the same this long
# Lua: specd-lsp attached to the current buffer and linked to the daemon. Its status is asked for:
# the plugin forgets the one it was sent when any buffer detaches.
SPECD_READY = ("local c = vim.lsp.get_clients({ name = 'specd', bufnr = 0 })[1]"
               " local s = c and require('specd.status').fetch(c, 5000)"
               " return s and s.state == 'ready' or false")
# Lua: the cursor to the last character of line `...` (1-based), the line in mid-window.
TO_LINE_END = """
local row = ...
local line = vim.api.nvim_buf_get_lines(0, row - 1, row, true)[1]
vim.api.nvim_win_set_cursor(0, { row, math.max(#line - 1, 0) })
vim.cmd('normal! zz')
"""
MIN_LINES = 500  # a held-out file this long or longer ...
PAST_LINE = 200  # ... and a cursor past this line (1-based): the prompt at its full budget


def user_home(root: Path) -> dict[str, str]:
    """Makes ``root`` a user's home (XDG dirs, the plugin as a native package, an empty
    ``config/nvim`` for an init.lua) and returns the environment Neovim runs in: no SPECD_*
    of the caller's, specd-lsp on PATH. The daemon's socket is ``root/run/specd/specd.sock``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECD_")}
    for var, sub in (("XDG_RUNTIME_DIR", "run"), ("XDG_STATE_HOME", "state"), ("XDG_CONFIG_HOME", "config"),
                     ("XDG_CACHE_HOME", "cache"), ("XDG_DATA_HOME", "data")):
        (root / sub).mkdir(mode=0o700, exist_ok=True)
        env[var] = str(root / sub)
    env["PATH"] = os.pathsep.join([str(BIN), env.get("PATH", "")])
    env["PYTHONPATH"] = str(REPO)
    env.setdefault("OMP_NUM_THREADS", "1")  # a busy 2-core machine: no spinning OpenMP threads
    pack = root / "data" / "nvim" / "site" / "pack" / "specd" / "start"
    pack.mkdir(parents=True, exist_ok=True)
    if not (pack / "specd.nvim").exists():
        (pack / "specd.nvim").symlink_to(REPO / "editor-plugins" / "neovim")  # the README's "Native packages"
    (root / "config" / "nvim").mkdir(parents=True, exist_ok=True)
    find_tool("specd-lsp")
    return env


def held_out_files(count: int) -> list[tuple[Path, int, str]]:
    """Up to ``count`` rich modules of MIN_LINES+ lines, by name, each with its cursor line
    (1-based) and the characters its next statement starts with."""
    import rich

    chosen = []
    for path in sorted(Path(rich.__file__).parent.glob("*.py")):
        text = path.read_text(encoding="utf-8")
        if text.count("\n") < MIN_LINES:
            continue
        spot = cursor_line(text)
        if spot is not None:
            chosen.append((path, *spot))
        if len(chosen) == count:
            break
    return chosen


def cursor_line(text: str) -> tuple[int, str] | None:
    """The first one-line statement (not a docstring) past PAST_LINE inside a function body
    whose next sibling statement starts on the very next line at the same indentation with a
    name: (its line, that statement's first two characters)."""
    lines = text.splitlines()
    spots = []
    for node in ast.walk(ast.parse(text)):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for body in (getattr(child, field, None) for child in ast.walk(node)
                     for field in ("body", "orelse", "finalbody")):
            if not isinstance(body, list):
                continue
            for stmt, after in zip(body, body[1:]):
                nxt = lines[after.lineno - 1].strip()
                if (stmt.lineno > PAST_LINE and stmt.lineno == stmt.end_lineno
                        and after.lineno == stmt.lineno + 1 and after.col_offset == stmt.col_offset
                        and isinstance(stmt, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Expr))
                        and not (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant))
                        and "#" not in lines[stmt.lineno - 1] and nxt[:2].replace("_", "a").isalpha()):
                    spots.append((stmt.lineno, nxt[:2]))
    return min(spots) if spots else None


def italic_run(screen: Screen, row: int, col: int) -> str | None:
    """The italic text from `col` on `row` (ghost text is drawn italic), or None."""
    cells = screen.cells[row][col:]
    start = next((i for i, (_, hl) in enumerate(cells) if screen.highlights.get(hl, {}).get("italic")), None)
    if start is None or start > 1:
        return None
    return "".join(text for text, hl in cells[start:] if screen.highlights.get(hl, {}).get("italic")).rstrip()


def ghost(screen: Screen) -> str | None:
    """The ghost text at the cursor on screen, or None: italic cells right of the cursor, or (a
    suggestion that starts with a line break) italic virtual lines below it."""
    row, col = screen.cursor
    first = italic_run(screen, row, col)
    if first:
        return first
    below = italic_run(screen, row + 1, 0) if row + 1 < screen.height else None
    return "\n" + below if below and below.strip() else None


def whole_ghost(screen: Screen) -> str | None:
    """The whole ghost text on screen: its first line (``ghost``) and the virtual lines drawn
    below it (rows whose every non-blank cell is italic), or None."""
    first = ghost(screen)
    if first is None:
        return None
    lines = [first]
    row = screen.cursor[0] + (2 if first.startswith("\n") else 1)
    while row < screen.height:
        text = screen.text(row).rstrip()
        if not text.strip() or not all(screen.highlights.get(hl, {}).get("italic")
                                       for ch, hl in screen.cells[row][:len(text)] if ch.strip()):
            break
        lines.append(text)
        row += 1
    return "\n".join(lines)


class Person:
    """Types into a Neovim and watches its screen."""

    def __init__(self, nvim: Nvim, socket_path: Path):
        self.nvim = nvim
        self.socket_path = socket_path
        self.latencies_ms: list[float] = []
        self.whole_ms: list[float] = []  # to the ghost text each pause ended with (a streamed suggestion grown)
        self.grown = 0  # pauses whose ghost text changed after it first showed, with no key pressed
        self.cached_ms: list[float] = []  # pauses answered by specd-lsp's type-through cache
        self.overhead_ms: list[float] = []  # the others, less the daemon's own time (queue + engine)
        self._seen: dict = {}

    def type(self, text: str) -> float:
        """Types `text` one key at a time; returns when the last key went."""
        sent = 0.0
        for ch in text:
            sent = self.nvim.input({"\n": "<CR>", "<": "<lt>"}.get(ch, ch))
            time.sleep(KEY_GAP_S)
        return sent

    def ghost_after(self, sent: float, what: str, timeout: float = GHOST_S) -> str:
        """The first ghost text on screen after the key sent at ``sent``; files its latency, then
        waits out the pause (``_until_whole``). Raises AssertionError after ``timeout`` s without."""
        at, shown = self.nvim.wait_screen(ghost, timeout, what, since=sent)
        latency_ms = (at - sent) * 1000
        self.latencies_ms.append(latency_ms)
        self._until_whole(sent, at)
        self._split(latency_ms)
        return shown

    def _until_whole(self, sent: float, first_at: float) -> None:
        """Waits out the pause (the daemon idle, the ghost text unchanged for QUIET_S) and files the
        time from the last key to the ghost text it ended with."""
        deadline = time.monotonic() + GHOST_S
        while not daemon_idle(self.socket_path) and time.monotonic() < deadline:
            time.sleep(0.05)
        while True:
            changes: list[tuple[float, str | None]] = []
            for at, screen in list(self.nvim.flushes):
                if at >= sent and (text := whole_ghost(screen)) != (changes[-1][1] if changes else None):
                    changes.append((at, text))
            if not changes or time.monotonic() - changes[-1][0] >= QUIET_S or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        if changes and changes[-1][1]:
            self.whole_ms.append((changes[-1][0] - sent) * 1000)
            self.grown += changes[-1][0] > first_at

    def _split(self, latency_ms: float) -> None:
        """Files a pause's latency by what answered it, from specd-lsp's counters (read after the
        ghost text is on screen, outside the measured time)."""
        stats = self.lsp_stats()
        seen, self._seen = self._seen, stats
        if not seen or not stats:
            return
        grew = {key: (stats.get(key) or 0) - (seen.get(key) or 0) for key in ("daemonRequests", "cacheHits")}
        engine_ms = stats.get("lastLatencyMs")
        if grew["cacheHits"] and not grew["daemonRequests"]:
            self.cached_ms.append(latency_ms)
        elif grew["daemonRequests"] and engine_ms and latency_ms > engine_ms:  # not a stale item still drawn
            self.overhead_ms.append(latency_ms - engine_ms)

    def lsp_stats(self) -> dict:
        """specd-lsp's own status (its counters, the daemon's last answer), or {} before it attached."""
        return self.nvim.lua("local c = vim.lsp.get_clients({ name = 'specd' })[1]"
                             " return c and require('specd.status').fetch(c, 5000) or vim.empty_dict()")

    def line(self) -> str:
        return self.nvim.lua("return vim.api.nvim_get_current_line()")

    def buffer(self) -> str:
        return self.nvim.lua("return table.concat(vim.api.nvim_buf_get_lines(0, 0, -1, false), '\\n')")

    def status(self) -> dict:
        return self.nvim.lua("return require('specd').status() or vim.empty_dict()")

    def normal(self) -> None:
        self.nvim.input("<Esc>")
        self.nvim.wait("return vim.api.nvim_get_mode().mode == 'n'", EDIT_S, "normal mode")
