"""Neovim as a person uses it: the plugin installed as its README says (a native package plus
``require('specd').setup()`` in init.lua), a UI attached whose screen is read back cell by cell
(a terminal without 'termguicolors'), keys typed one at a time, the real specd-lsp starting the
real daemon with the shipped demo pair.

One session per renderer goes through what a person meets: Enter inside a method body and the
suggestion on the fresh indented line (accepting must not indent it twice), Tab, undo, typing
word by word with pauses (keystroke-to-ghost-text latency is measured at each pause), a partial
accept counted by specd-lsp, a second buffer, ``:checkhealth specd``, and the daemon killed
mid-session and started again by specd-lsp while the person keeps typing.

Latency: SPECD_TEST_TYPING_REPORT names a JSON file to write the figures to (docs/editors.md
quotes a run).
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import time
from pathlib import Path

import pytest

from daemon_helpers import REPO, daemon_idle
from nvim_driver import Nvim, Screen
from specd.client import Client, DaemonUnavailable
from tools import BIN, find_tool

pytestmark = pytest.mark.slow

READY_S = 240  # specd-lsp spawns the daemon, which loads the demo pair (seconds; minutes on a busy machine)
GHOST_S = 30  # a pause's suggestion, on a loaded 2-core machine
EDIT_S = 10
KEY_GAP_S = 0.06  # between keys inside a word: a quick typist
QUIET_S = 0.3  # a pause ends once the daemon is idle and the ghost text stayed the same this long
REPORT = os.environ.get("SPECD_TEST_TYPING_REPORT")  # read now: the autouse fixture clears SPECD_* for the tests
SOURCE = '''class Stack:
    """A last-in, first-out stack."""

    def __init__(self):
        self.items = []

    def push(self, item):
        self.items.append(item)

    def pop(self):
        return self.items.pop()

    def peek(self):
'''
# Typed word by word on a fresh line of peek(), pausing after each piece for the suggestion.
PIECES = ["if", " not", " self", ".items", ":", "\n", "return", " None"]


def _italic_run(screen: Screen, row: int, col: int) -> str | None:
    """The italic text from `col` on `row` (ghost text is drawn italic), or None."""
    cells = screen.cells[row][col:]
    start = next((i for i, (_, hl) in enumerate(cells) if screen.highlights.get(hl, {}).get("italic")), None)
    if start is None or start > 1:
        return None
    return "".join(text for text, hl in cells[start:] if screen.highlights.get(hl, {}).get("italic")).rstrip()


def _ghost(screen: Screen) -> str | None:
    """The ghost text at the cursor on screen, or None: italic cells right of the cursor, or (a
    suggestion that starts with a line break) italic virtual lines below it."""
    row, col = screen.cursor
    first = _italic_run(screen, row, col)
    if first:
        return first
    below = _italic_run(screen, row + 1, 0) if row + 1 < screen.height else None
    return "\n" + below if below and below.strip() else None


def _whole_ghost(screen: Screen) -> str | None:
    """The whole ghost text on screen: its first line (``_ghost``) and the virtual lines drawn
    below it (rows whose every non-blank cell is italic), or None."""
    first = _ghost(screen)
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


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    """A user's home: XDG dirs, the plugin as a native package, specd-lsp on PATH."""
    root = tmp_path_factory.mktemp("typing")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECD_")}
    for var, sub in (("XDG_RUNTIME_DIR", "run"), ("XDG_STATE_HOME", "state"), ("XDG_CONFIG_HOME", "config"),
                     ("XDG_CACHE_HOME", "cache"), ("XDG_DATA_HOME", "data")):
        (root / sub).mkdir(mode=0o700)
        env[var] = str(root / sub)
    env["PATH"] = os.pathsep.join([str(BIN), env.get("PATH", "")])
    env["PYTHONPATH"] = str(REPO)
    env.setdefault("OMP_NUM_THREADS", "1")  # a busy 2-core machine: no spinning OpenMP threads
    env["SPECD_MODEL_TARGET"] = "demo"  # the embedded pair: these measure the editor side, not the model
    pack = root / "data" / "nvim" / "site" / "pack" / "specd" / "start"
    pack.mkdir(parents=True)
    (pack / "specd.nvim").symlink_to(REPO / "editor-plugins" / "neovim")  # the README's "Native packages"
    (root / "config" / "nvim").mkdir(parents=True)
    find_tool("specd-lsp")
    yield root, env
    try:
        with Client.connect_unix(root / "run" / "specd" / "specd.sock", timeout=5) as client:
            client.shutdown()
    except (DaemonUnavailable, OSError):
        pass


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

    def ghost_after(self, sent: float, what: str) -> str:
        at, ghost = self.nvim.wait_screen(_ghost, GHOST_S, what, since=sent)
        latency_ms = (at - sent) * 1000
        self.latencies_ms.append(latency_ms)
        self._until_whole(sent, at)
        self._split(latency_ms)
        return ghost

    def _until_whole(self, sent: float, first_at: float) -> None:
        """Waits out the pause (the daemon idle, the ghost text unchanged for QUIET_S) and files the
        time from the last key to the ghost text it ended with."""
        deadline = time.monotonic() + GHOST_S
        while not daemon_idle(self.socket_path) and time.monotonic() < deadline:
            time.sleep(0.05)
        while True:
            changes: list[tuple[float, str | None]] = []
            for at, screen in list(self.nvim.flushes):
                if at >= sent and (text := _whole_ghost(screen)) != (changes[-1][1] if changes else None):
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
        stats = self.nvim.lua("local c = vim.lsp.get_clients({ name = 'specd' })[1]"
                              " return c and require('specd.status').fetch(c, 5000) or vim.empty_dict()")
        seen, self._seen = self._seen, stats
        if not seen or not stats:
            return
        grew = {key: (stats.get(key) or 0) - (seen.get(key) or 0) for key in ("daemonRequests", "cacheHits")}
        engine_ms = stats.get("lastLatencyMs")
        if grew["cacheHits"] and not grew["daemonRequests"]:
            self.cached_ms.append(latency_ms)
        elif grew["daemonRequests"] and engine_ms and latency_ms > engine_ms:  # not a stale item still drawn
            self.overhead_ms.append(latency_ms - engine_ms)

    def line(self) -> str:
        return self.nvim.lua("return vim.api.nvim_get_current_line()")

    def buffer(self) -> str:
        return self.nvim.lua("return table.concat(vim.api.nvim_buf_get_lines(0, 0, -1, false), '\\n')")

    def status(self) -> dict:
        return self.nvim.lua("return require('specd').status() or vim.empty_dict()")

    def normal(self) -> None:
        self.nvim.input("<Esc>")
        self.nvim.wait("return vim.api.nvim_get_mode().mode == 'n'", EDIT_S, "normal mode")


@pytest.mark.parametrize("renderer", ["auto", "native"])
def test_a_person_typing_in_neovim(home, renderer, tmp_path):
    root, env = home
    setup = "require('specd').setup()" if renderer == "auto" else "require('specd').setup({ renderer = 'native' })"
    (root / "config" / "nvim" / "init.lua").write_text(setup + "\n")
    work = tmp_path / "project"
    work.mkdir()
    (work / "stack.py").write_text(SOURCE)
    (work / "big.py").write_text("".join(f"value_{i} = {i}\n" for i in range(1, 301)))
    nvim = Nvim(find_tool("nvim"), ["stack.py"], work, env)
    person = Person(nvim, root / "run" / "specd" / "specd.sock")
    try:
        ready = nvim.wait("local s = require('specd').status(); return s and s.state == 'ready' and s", READY_S,
                          "specd ready (specd-lsp spawning the daemon with the demo pair)")
        assert ready["daemon"]["models"]["target"].endswith("demo/pair/target")
        first_pid = ready["daemon"]["pid"]

        # Enter at the end of `def peek(self):`: autoindent puts 8 spaces; the suggestion follows them.
        nvim.command("normal! G")
        ghost = person.ghost_after(nvim.input("A<CR>"), "a suggestion on the fresh indented line")
        assert person.line() == " " * 8
        assert not ghost.startswith(" "), f"the ghost text would indent the line again: {ghost!r}"
        row = nvim.lua("return vim.api.nvim_win_get_cursor(0)[1]")
        nvim.input("<Tab>")
        # The fresh line as accepted (a suggestion of several lines leaves the cursor on its last).
        line = nvim.wait("local l = vim.api.nvim_buf_get_lines(0, ... - 1, ..., true)[1]; return l:find('%S') and l",
                         EDIT_S, "the accept", row)
        assert line == " " * 8 + ghost, "accepted as shown, indented once"
        assert nvim.lua("return vim.api.nvim_get_mode().mode") == "i"
        # Undo takes back the insert session: the Enter and the accepted text together.
        person.normal()
        nvim.input("u")
        nvim.wait("return vim.api.nvim_buf_line_count(0) == 13", EDIT_S, "undo")
        assert person.buffer() == SOURCE.rstrip("\n")

        # Typing word by word on a fresh line, pausing after each piece.
        nvim.command("normal! G")
        nvim.input("o")
        for piece in PIECES:
            person.ghost_after(person.type(piece), f"a suggestion after typing {piece!r}")
        typed = "".join(PIECES).split("\n")
        assert person.buffer().endswith(f"        {typed[0]}\n            {typed[1]}")

        # A partial accept: the next word goes in, specd-lsp counts it, the rest stays offered.
        sent = person.type("\n")
        ghost = person.ghost_after(sent, "a suggestion on the next line")
        before = person.line()
        nvim.input("<M-w>")
        grown = nvim.wait("local l = vim.api.nvim_get_current_line(); return l ~= ... and l", EDIT_S, "a word taken",
                          before)
        assert ghost.startswith(grown[len(before):].lstrip()) and len(grown) > len(before)
        nvim.wait("local s = require('specd').status(); return s and (s.acceptedPartial or 0) >= 1", EDIT_S,
                  "specd-lsp counting the partial accept")
        person.normal()
        nvim.input("u")  # undoes this insert session, the taken word with it
        nvim.wait("return not vim.api.nvim_get_current_line():find(...)", EDIT_S, "undo of the partial accept",
                  grown.strip())

        # A second buffer: typing there gets its suggestion, the first buffer stays quiet.
        nvim.command("edit big.py")
        nvim.command("normal! G")
        nvim.wait("return #vim.lsp.get_clients({ name = 'specd', bufnr = 0 }) == 1", EDIT_S, "specd-lsp attached")
        person.ghost_after(nvim.input("ovalue_301 = "), "a suggestion in the second buffer")
        person.normal()

        report = "\n".join(nvim.lua("vim.cmd.checkhealth('specd'); return vim.api.nvim_buf_get_lines(0, 0, -1, false)"))
        assert "ERROR" not in report and "OK daemon pid" in report, report
        assert renderer == "auto" or "native" in report
        nvim.command("tabclose")

        # Where the time went, as specd-lsp and the daemon saw it (before the daemon is replaced).
        server = nvim.lua("return require('specd.status').fetch(vim.lsp.get_clients({ name = 'specd' })[1], 5000)")

        # The daemon dies (kill -9) mid-session; the person keeps typing; specd-lsp starts a new one.
        nvim.command("buffer stack.py")
        nvim.command("normal! G")
        nvim.input("o")
        killed = time.monotonic()
        os.kill(first_pid, signal.SIGKILL)
        person.type("return")
        status = nvim.wait("local s = require('specd').status(); return s and s.state == 'ready' and s.daemon"
                           " and s.daemon.pid ~= ... and s", READY_S, "specd-lsp and a new daemon", first_pid)
        recovery_s = time.monotonic() - killed
        assert status["daemon"]["connects"] >= 2
        person.ghost_after(person.type(" "), "a suggestion from the new daemon")

        messages = nvim.lua("return vim.fn.execute('messages')")
        for bad in ("Error", "E5108", "out of bounds", "Traceback"):
            assert bad not in messages, messages
    finally:
        nvim.close()

    latencies = sorted(person.latencies_ms)
    p50 = statistics.median(latencies)
    p95 = latencies[min(len(latencies) - 1, round(0.95 * (len(latencies) - 1)))]
    figures = {"renderer": renderer, "pauses": len(latencies), "p50_ms": round(p50), "p95_ms": round(p95),
               "max_ms": round(latencies[-1]), "recovery_s": round(recovery_s, 1),
               "whole_p50_ms": round(statistics.median(person.whole_ms)),
               "whole_p95_ms": round(sorted(person.whole_ms)[min(len(person.whole_ms) - 1,
                                                                 round(0.95 * (len(person.whole_ms) - 1)))]),
               "pauses_grown": person.grown, "whole_ms": [round(x) for x in person.whole_ms],
               "latencies_ms": [round(x) for x in person.latencies_ms],
               "cached_ms": [round(x) for x in person.cached_ms],
               "overhead_ms": [round(x) for x in person.overhead_ms],
               "overhead_p50_ms": round(statistics.median(person.overhead_ms)) if person.overhead_ms else None,
               "server": {key: server.get(key) for key in ("requests", "daemonRequests", "cacheHits", "cancelled",
                                                           "shown", "accepted", "acceptedPartial")},
               "daemon_latency_ms": server["daemon"].get("latencyMs")}
    print(json.dumps(figures))
    if REPORT:
        with open(REPORT, "a", encoding="utf-8") as out:
            out.write(json.dumps(figures) + "\n")
