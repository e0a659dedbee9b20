"""The cancel-then-ask race as VS Code's client runs it: tests/node/cancel_race.mjs.

A Node client on vscode-languageserver-protocol (the version under the extension's
vscode-languageclient) drives a fresh ``specd-lsp`` each round against the session's tiny-model
daemon: initialize as VS Code 1.99 with the extension's default settings, open a file with a
blank 8-space line inserted, ask for an inline completion there with a CancellationTokenSource
cancelled right after the send, ask again and await it. No round's second answer may be empty.
tests/test_lsp_cancel.py runs the same race from pygls in one long-lived session; this one adds
vscode-jsonrpc's timing and a specd-lsp (and its link to the daemon) started afresh each round.

The Node dependencies are tests/node/package-lock.json's, installed by ``npm ci`` on first use
(about 2 s; node_modules is not committed).
"""

from __future__ import annotations

import json
import os
import re
import subprocess

import pytest

from daemon_helpers import REPO
from tools import BIN, find_tool

NODE_DIR = REPO / "tests" / "node"
SCRIPT = NODE_DIR / "cancel_race.mjs"
SOURCE = REPO / "tests" / "data" / "sample_module.py"
BLANK_LINE = 26  # before `if quantity < 0:` in Item.with_quantity: a method body, 8 spaces deep
NPM_CI_TIMEOUT_S = 300
ROUND_TIMEOUT_S = 20  # per round, generously: a round takes about 1 s here
DEFAULT_ROUNDS = 16  # about 20 s on 2 busy cores; the slow test runs the 100
MIN_NODE = (18, 3)  # util.parseArgs


def _locked_version(package: str) -> str:
    lock = json.loads((NODE_DIR / "package-lock.json").read_text())
    return lock["packages"][f"node_modules/{package}"]["version"]


def _installed_version(package: str) -> str | None:
    manifest = NODE_DIR / "node_modules" / package / "package.json"
    return json.loads(manifest.read_text()).get("version") if manifest.exists() else None


@pytest.fixture(scope="module")
def node() -> str:
    """node, with tests/node's locked dependencies installed."""
    node = find_tool("node")
    version = subprocess.run([node, "--version"], capture_output=True, text=True, check=True).stdout
    found = tuple(int(part) for part in re.findall(r"\d+", version)[:2])
    assert found >= MIN_NODE, f"Node.js {version.strip()} is too old; the script needs {MIN_NODE}"
    package = "vscode-languageserver-protocol"
    if _installed_version(package) != _locked_version(package):
        done = subprocess.run([find_tool("npm"), "ci", "--no-audit", "--no-fund"], cwd=NODE_DIR, capture_output=True,
                              text=True, timeout=NPM_CI_TIMEOUT_S, stdin=subprocess.DEVNULL)
        assert done.returncode == 0, f"npm ci in {NODE_DIR} failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}"
    return node


def _client_env(daemon) -> dict[str, str]:
    """The editor's environment: no SPECD_* of ours, the daemon's XDG dirs (so specd-lsp finds
    its socket as a user's finds the default one), and its models as the extension passes
    ``specd.model.*`` (only a daemon specd-lsp had to start would read them)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECD_")}
    env["PATH"] = os.pathsep.join([str(BIN), env.get("PATH", "")])
    for var in ("XDG_RUNTIME_DIR", "XDG_STATE_HOME", "XDG_CONFIG_HOME", "XDG_CACHE_HOME"):
        env[var] = daemon.env[var]
    for var in ("SPECD_MODEL_TARGET", "SPECD_MODEL_DRAFT", "SPECD_MODEL_DEVICE"):
        env[var] = daemon.env[var]
    return env


def run_race(node: str, daemon, rounds: int) -> tuple[dict, list[dict]]:
    """(the summary, each round's line) of ``rounds`` rounds, after an unraced control round."""
    args = [node, str(SCRIPT), "--server", find_tool("specd-lsp"), "--file", str(SOURCE),
            "--line", str(BLANK_LINE), "--rounds", str(rounds), "--control"]
    done = subprocess.run(args, cwd=REPO, env=_client_env(daemon), capture_output=True, text=True,
                          timeout=ROUND_TIMEOUT_S * (rounds + 1), stdin=subprocess.DEVNULL)
    assert done.returncode == 0, f"cancel_race.mjs exited with {done.returncode}:\n{done.stderr[-4000:]}\n{done.stdout[-2000:]}"
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    summary = lines[-1]
    assert summary["rounds"] == rounds, summary
    return summary, [line for line in lines if "round" in line]


def check_no_empty_answers(node: str, daemon, rounds: int) -> None:
    summary, results = run_race(node, daemon, rounds)
    print(f"cancel-then-ask from vscode-languageserver-protocol: {summary['empty']} empty answers in "
          f"{rounds} rounds, each a fresh specd-lsp (round p50 {summary['roundMsP50']} ms)")
    empty = [result for result in results if not result["items"]]
    assert summary["empty"] == 0, f"{summary['empty']} of {rounds} second answers were empty: {empty[:3]}"
    # The race was run: each first request was cancelled, not answered before the cancel landed.
    assert sum(result["firstCancelled"] is True for result in results) >= rounds // 2, results


def test_no_empty_answer_after_a_cancel_from_vscode_jsonrpc(node, daemon):
    check_no_empty_answers(node, daemon, DEFAULT_ROUNDS)


@pytest.mark.slow
def test_no_empty_answer_in_100_rounds(node, daemon):
    check_no_empty_answers(node, daemon, 100)
