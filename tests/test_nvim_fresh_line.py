"""Neovim 0.12's native renderer on a fresh indented line of a third-party file: the accepted
suggestion keeps the line's indentation, its first line and every line after it.

The file is rich's ``progress_bar.py`` (as installed with the test extra's dependencies); the
fresh line is the first line of ``ProgressBar.__init__``'s body, 8 blanks put in with
``nvim_buf_set_lines``. In normal mode Neovim keeps the cursor on a line's last character, so
``nvim_win_set_cursor`` to column 8 leaves it on column 7, inside the indentation with one blank
after it, and ``vim.lsp.inline_completion`` asks from there. The demo pair re-types that blank
(its completion starts with one) and indents its later lines at 8, as the file does; each item
must replace the blank after the cursor rather than drop the completion's own, or the line and
all later lines land at 7.

Real headless Neovim with the plugin installed as a native package (``renderer = 'native'``,
default settings), the real specd-lsp spawning the real daemon with the shipped demo pair.
Steps as a user's report had them: an invoked ``textDocument/inlineCompletion``, then the
automatic request (``Completor:request(2)``) and ``vim.lsp.inline_completion.get()``; the buffer
is read back.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path

import pytest

from daemon_helpers import REPO
from nvim_driver import Nvim
from specd.client import Client, DaemonUnavailable
from specd_lsp.options import Settings
from tools import BIN, find_tool

pytestmark = pytest.mark.slow

READY_S = 240  # specd-lsp spawns the daemon, which loads the demo pair (minutes on a busy machine)
ANSWER_S = 60
INDENT = " " * 8
ANCHOR = INDENT + "self.total = total"  # the first statement of ProgressBar.__init__'s body
ATTEMPTS = 4  # fresh lines tried, the reported one first, until one gets a suggestion of several lines

# Lua run inside Neovim; `...` are the arguments.
FRESH_LINE = """
local row = ...
local buf = vim.api.nvim_get_current_buf()
vim.api.nvim_buf_set_lines(buf, row - 1, row - 1, true, { string.rep(' ', 8) })
vim.api.nvim_win_set_cursor(0, { row, 8 })
return { cursor = vim.api.nvim_win_get_cursor(0), mode = vim.api.nvim_get_mode().mode }
"""
INVOKED = """
local buf = vim.api.nvim_get_current_buf()
local client = vim.lsp.get_clients({ name = 'specd', bufnr = buf })[1]
local params = vim.lsp.util.make_position_params(0, client.offset_encoding)
params.context = { triggerKind = 1 }
-- The buffer's number, not 0: Client:request flushes pending didChange for the buffer it is
-- given before it resolves 0 to the current one, so with 0 the server would answer on stale text.
local answer = client:request_sync('textDocument/inlineCompletion', params, ... * 1000, buf)
return { encoding = client.offset_encoding, position = params.position,
         items = answer and answer.result and answer.result.items or vim.NIL, err = answer and answer.err }
"""
AUTOMATIC = """
local completor = require('vim.lsp._capability').all.inline_completion.active[vim.api.nvim_get_current_buf()]
completor:abort() -- no item current until this request's answer
completor:request(2)
"""
CURRENT = """
local current = require('vim.lsp._capability').all.inline_completion.active[vim.api.nvim_get_current_buf()].current
if not current then return nil end
local r = current.range
return { text = current.insert_text, range = r and { r.start.row, r.start.col, r.end_.row, r.end_.col } or vim.NIL }
"""
BUFFER = "return vim.api.nvim_buf_get_lines(0, 0, -1, false)"


def _third_party_file() -> Path:
    spec = importlib.util.find_spec("rich")
    if spec is None or spec.origin is None:
        pytest.fail("rich is not installed: transformers brings it (through typer) with the test extra")
    return Path(spec.origin).parent / "progress_bar.py"


@pytest.fixture
def session(tmp_path):
    """A user's home (XDG dirs, the plugin as a native package, specd-lsp on PATH) and a
    project holding the third-party file; the daemon specd-lsp spawns is stopped afterwards."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECD_")}
    for var, sub in (("XDG_RUNTIME_DIR", "run"), ("XDG_STATE_HOME", "state"), ("XDG_CONFIG_HOME", "config"),
                     ("XDG_CACHE_HOME", "cache"), ("XDG_DATA_HOME", "data")):
        (tmp_path / sub).mkdir(mode=0o700)
        env[var] = str(tmp_path / sub)
    env["PATH"] = os.pathsep.join([str(BIN), env.get("PATH", "")])
    env["PYTHONPATH"] = str(REPO)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["SPECD_MODEL_TARGET"] = "demo"  # the embedded pair: these measure the editor side, not the model
    pack = tmp_path / "data" / "nvim" / "site" / "pack" / "specd" / "start"
    pack.mkdir(parents=True)
    (pack / "specd.nvim").symlink_to(REPO / "editor-plugins" / "neovim")
    (tmp_path / "config" / "nvim").mkdir(parents=True)
    (tmp_path / "config" / "nvim" / "init.lua").write_text("require('specd').setup({ renderer = 'native' })\n")
    project = tmp_path / "project"
    project.mkdir()
    shutil.copy(_third_party_file(), project / "progress_bar.py")
    find_tool("specd-lsp")
    nvim = Nvim(find_tool("nvim"), ["--headless", "progress_bar.py"], project, env)
    try:
        yield nvim, tmp_path / "run" / "specd" / "specd.sock"
    finally:
        nvim.close()
        try:
            with Client.connect_unix(tmp_path / "run" / "specd" / "specd.sock", timeout=5) as client:
                client.shutdown()
        except (DaemonUnavailable, OSError):
            pass


def _fresh_rows(lines: list[str]) -> list[int]:
    """1-based rows to open a fresh line at: before the reported statement, then before the
    other statements at 8 blanks that follow one at 8 (all inside method bodies)."""
    assert ANCHOR in lines and lines[lines.index(ANCHOR) - 1] == "    ):", "rich's progress_bar.py changed shape"
    first = lines.index(ANCHOR) + 1
    others = [row for row in range(first + 1, len(lines) + 1)
              if lines[row - 1].startswith(INDENT) and lines[row - 1][8:9].strip()
              and lines[row - 2].startswith(INDENT) and lines[row - 2][8:9].strip()]
    return [first, *others]


def _lsp_range(rows_cols: list[int]) -> dict:
    return {"start": {"line": rows_cols[0], "character": rows_cols[1]},
            "end": {"line": rows_cols[2], "character": rows_cols[3]}}


def _raw_completion(socket: Path, uri: str, offset: int) -> str:
    """What the daemon itself completes at ``offset`` of its copy of the document, asked as
    specd-lsp asks by default."""
    settings = Settings()
    options = {"max_tokens": settings.max_tokens, "single_line": settings.single_line, "temperature": 0.0}
    with Client.connect_unix(socket, timeout=10) as client:
        return client.complete(uri=uri, cursor={"offset": offset}, options=options)["text"]


def test_accepted_lines_keep_the_fresh_lines_indentation_in_neovim(session):
    nvim, socket = session
    nvim.wait("local s = require('specd').status(); return s and s.state == 'ready'", READY_S,
              "specd ready (specd-lsp spawning the daemon with the demo pair)")
    original = nvim.lua(BUFFER)
    uri = nvim.lua("return vim.uri_from_bufnr(0)")
    for row in _fresh_rows(original)[:ATTEMPTS]:
        nvim.lua("vim.api.nvim_buf_set_lines(0, 0, -1, false, ...)", original)
        placed = nvim.lua(FRESH_LINE, row)
        # Normal mode: the cursor stays on the line's last blank, one short of the line's end.
        assert placed == {"cursor": [row, 7], "mode": "n"}
        invoked = nvim.lua(INVOKED, ANSWER_S)
        assert invoked.get("err") is None and invoked["encoding"] == "utf-8", invoked
        assert invoked["position"] == {"line": row - 1, "character": 7}
        nvim.lua(AUTOMATIC)
        item = nvim.wait(CURRENT, ANSWER_S, "the automatic request's item")
        if "\n" in item["text"].strip():
            break
    else:
        pytest.fail(f"no multi-line suggestion on the first {ATTEMPTS} fresh lines; the last: {item!r}")

    # Every item replaces the blank after the cursor, its text starting with exactly that blank
    # (one that starts with a line break leaves the line's blanks alone).
    assert isinstance(invoked["items"], list), invoked
    for shown in [*invoked["items"], {"insertText": item["text"], "range": _lsp_range(item["range"])}]:
        text, start, end = shown["insertText"], shown["range"]["start"], shown["range"]["end"]
        assert start == {"line": row - 1, "character": 7}, shown
        if text.startswith("\n"):
            assert end == start, shown
        else:
            assert end == {"line": row - 1, "character": 8} and text[0] == " " and text[1] not in " \t", shown

    # The daemon's own answer there (asked before the accept, whose prefetch would supersede it).
    offset = sum(len(line) + 1 for line in original[:row - 1]) + 7
    raw = _raw_completion(socket, uri, offset).split("\n")

    assert nvim.lua("return vim.lsp.inline_completion.get()") is True
    suggested = item["text"].split("\n")
    after = nvim.wait("local b = vim.api.nvim_buf_get_lines(0, 0, -1, false);"
                      " return b[...]:find('%S') and b", ANSWER_S, "the accept", row)
    accepted = after[row - 1:row - 1 + len(suggested)]
    # The fresh line as accepted: the cursor's 8 blanks, then the suggestion, nothing behind its
    # last line, the statement after it untouched.
    assert accepted[0] == INDENT + suggested[0].lstrip() and accepted[-1] == accepted[-1].rstrip()
    assert after[row - 1 + len(suggested)] == original[row - 1]
    assert after[:row - 1] == original[:row - 1] and after[row - 1 + len(suggested):] == original[row - 1:]
    # Every later line where the daemon put it relative to the first: the block keeps its shape
    # (the demo pair starts with the one blank after the cursor, so the lines stay at its 8).
    first_at = 7 + _indent(raw[0])  # the column the daemon's first line would start at
    assert len(raw) >= len(accepted), (accepted, raw)
    for number, line in enumerate(accepted[1:], start=1):
        if not line.strip():
            continue
        last = number == len(accepted) - 1  # post-processing may have cut the last line short
        assert raw[number].lstrip().startswith(line.lstrip()) if last else line.lstrip() == raw[number].lstrip(), \
            (number, accepted, raw)
        assert _indent(line) - 8 == _indent(raw[number]) - first_at, (number, accepted, raw)


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" \t"))
