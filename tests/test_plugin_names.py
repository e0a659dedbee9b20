"""The editor plugins name specd-lsp's custom methods as specd does (``specd.protocol.methods``):
each plugin defines each name once, and a name changed on one side fails here rather than
silently in an editor."""

from __future__ import annotations

import re
from pathlib import Path

from specd.protocol.methods import (
    LSP_ACCEPTED_COMMAND,
    LSP_FOCUS_NOTIFICATION,
    LSP_STATUS_METHOD,
    LSP_SUGGESTION_GREW_METHOD,
)

PLUGINS = Path(__file__).resolve().parent.parent / "editor-plugins"


def test_the_vscode_extension_names_them_as_specd_does():
    text = (PLUGINS / "vscode" / "src" / "protocol.ts").read_text(encoding="utf-8")
    names = dict(re.findall(r"^export const (\w+) = '([^']*)';", text, re.MULTILINE))
    assert names == {
        "STATUS_METHOD": LSP_STATUS_METHOD,
        "ACCEPTED_COMMAND": LSP_ACCEPTED_COMMAND,
        "GREW_METHOD": LSP_SUGGESTION_GREW_METHOD,
        "FOCUS_METHOD": LSP_FOCUS_NOTIFICATION,
    }


def test_the_neovim_plugin_names_them_as_specd_does():
    modules = PLUGINS / "neovim" / "lua" / "specd"
    names = {path.stem: re.findall(r"^M\.METHOD = '([^']*)'", path.read_text(encoding="utf-8"), re.MULTILINE)
             for path in modules.glob("*.lua")}
    assert {module: found for module, found in names.items() if found} == {
        "status": [LSP_STATUS_METHOD],
        "grew": [LSP_SUGGESTION_GREW_METHOD],
        "focus": [LSP_FOCUS_NOTIFICATION],
    }
