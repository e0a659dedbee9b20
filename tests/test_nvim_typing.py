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

import pytest

from nvim_driver import Nvim
from nvim_person import EDIT_S, Person, ghost as ghost_on, user_home
from specd.client import Client, DaemonUnavailable
from tools import find_tool

pytestmark = pytest.mark.slow

READY_S = 240  # specd-lsp spawns the daemon, which loads the demo pair (seconds; minutes on a busy machine)
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


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    """A user's home: XDG dirs, the plugin as a native package, specd-lsp on PATH."""
    root = tmp_path_factory.mktemp("typing")
    env = user_home(root)
    env["SPECD_MODEL_TARGET"] = "demo"  # the embedded pair: these measure the editor side, not the model
    yield root, env
    try:
        with Client.connect_unix(root / "run" / "specd" / "specd.sock", timeout=5) as client:
            client.shutdown()
    except (DaemonUnavailable, OSError):
        pass


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
        # What Tab takes: the ghost text the pause ended with (a first line shown while it was
        # being written has grown since).
        ghost = ghost_on(nvim.screen)
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
        person.ghost_after(sent, "a suggestion on the next line")
        ghost = ghost_on(nvim.screen)  # as the pause ended
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
