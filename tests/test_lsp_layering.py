"""The design's dependency rule for the LSP front end: lsp/ reaches the daemon only through
specd.client and specd.protocol, and never imports specd.engine or specd.daemon (nor torch).
Of specd it may import what docs/architecture.md lists; outside it, pygls and its kin."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

LSP = Path(__file__).resolve().parent.parent / "lsp"
FORBIDDEN = ("specd.engine", "specd.daemon", "torch", "transformers")
# What of specd the LSP front end may import (``specd`` itself: its version).
SPECD_ALLOWED = ("specd.client", "specd.protocol", "specd.config", "specd.logs", "specd.suggestion_rules",
                 "specd.options_table")
# Outside the standard library: pygls, the LSP types and their converter.
THIRD_PARTY_ALLOWED = {"pygls", "lsprotocol", "cattrs"}


def _imported(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.append(node.module)
    return names


def test_no_forbidden_imports_in_the_source():
    for path in sorted(LSP.rglob("*.py")):
        for name in _imported(path):
            assert not name.startswith(FORBIDDEN), f"{path.name} imports {name}"


def test_only_the_listed_imports_in_the_source():
    for path in sorted(LSP.rglob("*.py")):
        for name in _imported(path):
            top = name.partition(".")[0]
            if top == "specd":
                assert name == "specd" or name.startswith(SPECD_ALLOWED), f"{path.name} imports {name}"
            elif top != "specd_lsp":
                assert top in sys.stdlib_module_names or top in THIRD_PARTY_ALLOWED, f"{path.name} imports {name}"


def test_starting_the_server_module_loads_neither_engine_nor_torch():
    code = ("import sys, specd_lsp.server; "
            "print(sorted(m for m in sys.modules if m.startswith(('specd.engine', 'specd.daemon', 'torch'))))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert done.stdout.strip() == "[]"
