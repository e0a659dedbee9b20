"""The design's dependency rule for the LSP front end: lsp/ reaches the daemon only through
specd.client and specd.protocol, and never imports specd.engine or specd.daemon (nor torch)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

LSP = Path(__file__).resolve().parent.parent / "lsp"
FORBIDDEN = ("specd.engine", "specd.daemon", "torch", "transformers")


def test_no_forbidden_imports_in_the_source():
    for path in sorted(LSP.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for name in names:
                assert not name.startswith(FORBIDDEN), f"{path.name} imports {name}"


def test_starting_the_server_module_loads_neither_engine_nor_torch():
    code = ("import sys, specd_lsp.server; "
            "print(sorted(m for m in sys.modules if m.startswith(('specd.engine', 'specd.daemon', 'torch'))))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert done.stdout.strip() == "[]"
