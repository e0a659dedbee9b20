"""The first suggestion in a file just opened, in Neovim, on the real model: the daemon answers
from a narrow window while the full prompt waits, and that answer is the ghost text on screen.

The daemon serves the default model (SmolLM2-135M-Instruct Q4_1 on llama.cpp's forward,
tests/real_model.py) with ``engine.first_suggestion_ms`` so small that no cold prompt fits it:
every cold request answers from the narrowest window (``cold_start.MIN_WINDOW`` tokens) whatever
the prefill speed measured on this machine. Neovim with a UI attached and the plugin installed as
the README's native package (tests/nvim_person.py), specd-lsp on the daemon's socket. A held-out
file of 500+ lines (a rich module), the cursor at the end of a statement past line 200 inside a
function body, 1 s, then ``o``: the first ghost text shows, the daemon's ``status`` counts a
narrow answer of that window, and the ghost text is what the daemon completes for the same
text, cursor and window (asked again on a second open document holding the same text, so its
first request is cold too), post-processed as specd-lsp does.

Prompt lookup is off in this daemon (there is no draft model for this one): the replay's
document would find the editor's identical text in another open buffer and draft from it, and
llama.cpp's kernels round a wider verify differently at near-ties (docs/llamacpp.md), which
could flip a token between two answers that are each lossless.
"""

from __future__ import annotations

import shutil
import time

import pytest

from daemon_helpers import DaemonProcess, wait_for
from nvim_driver import Nvim
from nvim_person import SPECD_READY, TO_LINE_END, Person, held_out_files, user_home
from real_model import as_default_model
from specd.engine.cold_start import MIN_WINDOW
from specd.options_table import LSP_OPTIONS
from specd_lsp.completion import context_at, postprocess
from tools import find_tool

pytestmark = pytest.mark.slow

READY_S = 600  # the daemon loading the model, specd-lsp attaching (minutes on a busy machine)
EDIT_S = 30
# The first ghost text: a 64-token prefill and a line's decoding, which a 2-core machine shared
# with other jobs has taken 30+ s for.
ANSWER_S = 180
FORCED_BUDGET_MS = 1  # engine.first_suggestion_ms: no cold prompt prefills within it
WAIT_S = 1.0  # after the jump, before the first key, as the person waits
LSP_MAX_TOKENS = next(option for option in LSP_OPTIONS if option.name == "max_tokens").lsp_value

# specd-lsp attached to the current buffer and linked to the daemon.
# The buffer as specd-lsp sent it (lines and the final newline), the cursor, the document's uri.
BUFFER = """
local cursor = vim.api.nvim_win_get_cursor(0)
return { lines = vim.api.nvim_buf_get_lines(0, 0, -1, true), row = cursor[1], col = cursor[2],
         uri = vim.uri_from_bufnr(0) }
"""


def test_the_first_keystroke_in_a_file_just_opened_shows_a_narrow_windows_answer(tmp_path):
    (source, row, _), = held_out_files(1)
    env = user_home(tmp_path)
    (tmp_path / "config" / "nvim" / "init.lua").write_text("require('specd').setup()\n")
    project = tmp_path / "project"
    project.mkdir()
    shutil.copy(source, project / source.name)
    config = {"engine.forward_backend": "llamacpp", "engine.first_suggestion_ms": FORCED_BUDGET_MS,
              "engine.use_lookup": False, "engine.time_budget_ms": 60_000, "log.level": "info"}
    daemon = DaemonProcess(tmp_path, engine="real", config=config)
    as_default_model(tmp_path / "cache")
    daemon.start(timeout=READY_S)
    nvim = None
    try:
        with daemon.client() as client:
            status = client.status()
            assert status["dtype"] == "gguf Q4_1" and "SmolLM2-135M-Instruct" in status["models"]["target"], status
            nvim = Nvim(find_tool("nvim"), [source.name], project, env)
            nvim.wait(SPECD_READY, READY_S, "specd-lsp attached and linked to the daemon")
            wait_for(lambda: client.status()["documents"]["open"] == 1, EDIT_S, message="the daemon holding the file")
            nvim.lua(TO_LINE_END, row)
            time.sleep(WAIT_S)
            person = Person(nvim, daemon.socket_path)
            ghost = person.ghost_after(nvim.input("o"), f"ghost text on the fresh line below line {row}",
                                       timeout=ANSWER_S)
            about = client.status()["engine"]["first_suggestion"]
            assert about["budget_ms"] == FORCED_BUDGET_MS
            assert about["narrow_answers"] >= 1 and about["last_window_tokens"] == MIN_WINDOW, about

            # The same text, cursor and file name on a second open document: cold, so the same window.
            buffer = nvim.lua(BUFFER)
            text = "\n".join(buffer["lines"]) + "\n"
            assert buffer["row"] == row + 1 and not buffer["lines"][row].strip()
            offset = sum(len(line) + 1 for line in buffer["lines"][:row]) + buffer["col"]
            replay = (project / f"replay-{source.name}").as_uri()
            client.open_document(replay, text, version=1)
            answer = client.complete(uri=replay, cursor={"offset": offset}, path=buffer["uri"],
                                     options={"max_tokens": LSP_MAX_TOKENS, "single_line": False,
                                              "temperature": 0.0}, timeout=ANSWER_S)
    finally:
        if nvim is not None:
            nvim.close()
        daemon.stop()
    assert answer["window_tokens"] == MIN_WINDOW, answer["window_tokens"]
    shown = postprocess(answer["text"], context_at(text, offset))
    assert shown is not None and ghost.strip(), (answer["text"], ghost)
    # Streamed, the ghost text first shows the settled line(s); the screen cuts a long line.
    assert shown.insert_text.startswith(ghost), (shown.insert_text, ghost)
