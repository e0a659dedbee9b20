"""The real model end to end: SmolLM2-135M-Instruct (tests/real_model.py) through every
interface a user reaches it by. The GGUF file on llama.cpp's forward and tokenizer; its weights
dequantized onto torch's lean forward; the default model the README's first command serves,
through a spawned daemon; the socket; the bench and the eval. One load per path and module.

Lossless here means each path's own greedy: llama.cpp's decoding of the file one token at a
time, and transformers' ``generate()`` on the dequantized weights.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from bench_helpers import bench_cli, module_bench_env
from conftest import GGUF_ON_LLAMACPP, SHARED_DAEMON_CONFIG
from daemon_helpers import REPO, DaemonProcess
from engine_helpers import assert_lossless
from real_model import as_default_model, smollm2
from specd.bench.near_ties import flip_margins, summarize
from specd.engine import CompletionRequest
from specd.engine.engine import Engine
from specd.engine.options import EngineOptions
from specd.llamacpp.runtime import LlamaSlot

pytestmark = pytest.mark.slow

MAX_TOKENS = 24
STACK = (REPO / "examples" / "stack.py").read_text(encoding="utf-8")
STACK_POP = STACK.index("    def pop(self):\n") + len("    def pop(self):\n") + 8  # README command 1's cursor
# Held-out code of a real project: the standard library's textwrap, cursors deep enough for a
# prompt of 1,500+ tokens.
HELD_OUT = Path(textwrap.__file__).read_text(encoding="utf-8")
DEEP_CURSORS = ("        # If we're allowed to break long words", "        lines = []\n", "    def _split(self, text):")


def deep_offsets() -> list[int]:
    return [HELD_OUT.index(marker) + len(marker.rstrip("\n")) for marker in DEEP_CURSORS]


@pytest.fixture(scope="module")
def gguf() -> Path:
    return smollm2()


@pytest.fixture(scope="module")
def llamacpp_engine(gguf) -> Engine:
    engine = Engine(EngineOptions(target=str(gguf), forward_backend="llamacpp", time_budget_ms=600_000))
    engine.ensure_loaded()
    return engine


@pytest.fixture(scope="module")
def torch_engine(gguf) -> Engine:
    # A prefix window of 2,048 tokens: prompts of 1,500+ tokens at the deep cursors.
    engine = Engine(EngineOptions(target=str(gguf), forward_backend="torch", device="cpu", time_budget_ms=600_000,
                                  prefix_tokens=2048))
    engine.ensure_loaded()
    return engine


def test_the_file_runs_on_llama_cpps_forward_and_tokenizer(llamacpp_engine):
    stats = llamacpp_engine.stats()
    assert stats["models"]["dtype"] == "gguf Q4_1" and stats["models"]["forward"] == {"target": "llamacpp"}
    assert llamacpp_engine.prompts.template.name == "plain-files"  # no FIM tokens, StarCoder's file tokens


def test_llama_cpp_output_is_its_own_greedy_of_the_file(llamacpp_engine, gguf):
    """Every completion is what llama.cpp alone decodes from the same prompt, one token a forward,
    up to near-ties: llama.cpp's Q4_1 kernels round a forward of several rows differently from a
    one-row step (specd's first step runs the prompt's last token with the first draft), so
    where the one-row decode's two tokens are within ``NEAR_TIE`` logits either may win. Every
    flip must be such a near-tie (``specd.bench.near_ties``); a 135M model at 4 bits has many
    (docs/llamacpp.md)."""
    slot = LlamaSlot(gguf, n_ctx=4096)
    prompts, outputs, references = [], [], []
    for offset in [STACK_POP, *deep_offsets()]:
        text = STACK if offset == STACK_POP else HELD_OUT
        result = llamacpp_engine.complete(CompletionRequest(uri="file:///held-out.py", text=text, offset=offset,
                                                            max_tokens=MAX_TOKENS, token_healing=False))
        reference = slot.generate(result.prompt_ids, MAX_TOKENS, set(llamacpp_engine.stop_ids)).tokens
        assert result.token_ids, (offset, result.stop_reason)
        prompts.append(result.prompt_ids)
        outputs.append(result.token_ids)
        references.append(reference)
    mismatched = [i for i, (ours, theirs) in enumerate(zip(outputs, references)) if ours != theirs[:len(ours)]]
    flips = summarize(flip_margins(slot, prompts, outputs, references, mismatched))
    assert flips["defects"] == 0, flips
    assert len(mismatched) < len(outputs), flips  # and the rest identical


def test_the_torch_path_on_dequantized_weights_is_transformers_greedy(torch_engine):
    """The GGUF's weights dequantized onto the lean forward: every output is transformers'
    ``generate()`` on the same weights, with prompts of 1,500+ tokens."""
    stats = torch_engine.stats()
    assert stats["models"]["forward"]["target"] == "lean"
    longest = 0
    for offset in deep_offsets():
        result = torch_engine.complete(CompletionRequest(uri="file:///held-out.py", text=HELD_OUT, offset=offset,
                                                         max_tokens=MAX_TOKENS))
        assert_lossless(torch_engine, result, MAX_TOKENS)
        longest = max(longest, len(result.prompt_ids))
    assert longest >= 1500


def test_the_dequantized_tokenizer_is_llama_cpps(torch_engine, llamacpp_engine):
    for text in (HELD_OUT[:4000], STACK, "x = 12345 + foo_bar  # ünï 🙂\r\n\tdef f():\n"):
        assert torch_engine.prompts.encode(text) == llamacpp_engine.prompts.encode(text)


def test_the_readme_command_completes_stack_pop_through_the_daemon(tmp_path):
    """README command 1 as a new user runs it (no model configured, so the default; the daemon
    started on demand): a completion of ``Stack.pop`` that parses in place."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECD_")}
    as_default_model(Path(env["XDG_CACHE_HOME"]))
    command = [sys.executable, "-m", "specd", "complete", str(REPO / "examples" / "stack.py"), "--line", "9",
               "--col", "8", "--max-tokens", "40", "--json"]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
        assert done.returncode == 0, done.stderr
        result = json.loads(done.stdout)
        status = subprocess.run([sys.executable, "-m", "specd", "status", "--json"], capture_output=True,
                                text=True, timeout=60, env=env)
    finally:
        subprocess.run([sys.executable, "-m", "specd", "stop"], capture_output=True, timeout=60, env=env)
    assert result["via"] == "daemon" and "SmolLM2-135M-Instruct" in json.loads(status.stdout)["models"]["target"]
    text = result["text"]
    assert text.strip() and "self" in text, text
    ast.parse(STACK[:STACK_POP] + text + "\n")


def test_the_daemon_serves_the_default_model_over_the_socket(tmp_path):
    config = {**SHARED_DAEMON_CONFIG, "engine.forward_backend": "llamacpp", "engine.max_tokens": 24}
    daemon = DaemonProcess(tmp_path, engine="real", config=config)
    as_default_model(Path(daemon.env["XDG_CACHE_HOME"]))
    daemon.start(timeout=300)
    try:
        with daemon.client() as client:
            uri = "file:///stack.py"
            client.open_document(uri, STACK, version=1)
            result = client.complete(uri=uri, cursor={"line": 8, "character": 8})
            status = client.status()
        assert result["text"].strip() and result["target_forwards"] >= 1
        assert status["dtype"] == "gguf Q4_1" and status["models"]["forward"]["target"] == "llamacpp"
    finally:
        daemon.stop()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("real-corpus")
    (root / "textwrap_copy.py").write_text(HELD_OUT, encoding="utf-8")
    return root


def test_bench_on_the_file_reports_llama_cpp_and_specd(gguf, corpus, tmp_path):
    with module_bench_env(tmp_path, GGUF_ON_LLAMACPP):
        code, stdout, stderr = bench_cli("--model", str(gguf), "--workloads", "line,edit_replay", "--limit", "1",
                                         "--max-tokens", "12", "--methods", "llamacpp,specd", "--no-forward-costs",
                                         "--json", corpus=corpus)
    assert code == 0, stderr
    report = json.loads(stdout)
    assert report["reference"] == "llamacpp"
    for workload in ("line", "edit_replay"):
        methods = report["workloads"][workload]["methods"]
        specd = methods["specd"]
        # A flip against llama.cpp's greedy may only be a near-tie of its batch-width rounding.
        assert specd["identical"] or specd["near_ties"]["defects"] == 0, (workload, specd)
        assert specd["matched_nonempty"] > 0


def test_eval_scores_the_real_models_suggestions(gguf, corpus, capsys, monkeypatch):
    from specd.cli import main

    for var, value in GGUF_ON_LLAMACPP.items():
        monkeypatch.setenv(var, value)
    code = main(["eval", "--model", str(gguf), "--corpus", str(corpus), "--kinds", "fresh_line,line_end",
                 "--limit", "2", "--variants", "healing,plain_window", "--max-tokens", "16", "--json"])
    out = capsys.readouterr().out
    assert code == 0
    report = json.loads(out)
    assert report["cases"] == 4 and list(report["variants"]) == ["healing", "plain_window"]
    assert report["variants"]["healing"]["all"]["cases"] == 4
    # The plain window is the prefix alone: no file header (its three tokens at least), no cut token.
    for ours, plain in zip(report["completions"]["healing"], report["completions"]["plain_window"]):
        assert ours["prompt_tokens"] >= plain["prompt_tokens"] + 2, (ours, plain)
