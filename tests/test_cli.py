"""The specd command line: help everywhere, version, doctor, complete (local, JSON, errors)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

from specd import __version__
from specd.cli import build_parser, main

COMMANDS = ["serve", "complete", "status", "stop", "bench", "install-service", "doctor", "train-demo"]


def run(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "specd", *args], capture_output=True, text=True, timeout=300, **kw)


def test_version_and_help():
    assert run("--version").stdout.strip() == f"specd {__version__}"
    top = run("--help")
    assert top.returncode == 0
    for command in COMMANDS:
        assert command in top.stdout


@pytest.mark.parametrize("command", COMMANDS)
def test_every_subcommand_has_help(command, capsys):
    with pytest.raises(SystemExit) as info:
        main([command, "--help"])
    assert info.value.code == 0
    assert len(capsys.readouterr().out) > 100


def test_no_command_prints_help_and_exits_2(capsys):
    assert main([]) == 2
    assert "usage" in capsys.readouterr().out


def test_doctor_loads_the_configured_pair(llama_pair):
    target, draft = llama_pair
    proc = run("doctor", "--model", str(target), "--draft-model", str(draft))
    assert proc.returncode == 0, proc.stderr
    assert "model.target" in proc.stdout and "(command line)" in proc.stdout
    assert "torch" in proc.stdout and "OK" in proc.stdout
    # a float32 pair on a CPU: the lean path, each weight matrix in both layouts, and what it costs
    assert "target forward: lean (static KV cache, weights also held transposed (+" in proc.stdout
    assert "engine.transposed_weights" in proc.stdout
    # the draft model's agreement with the target, measured at load, and where its chains stop
    assert re.search(r"draft agrees with the target on \d+% of 256 positions of code", proc.stdout), proc.stdout
    assert "chains stop below confidence" in proc.stdout and "(engine.draft_confidence = auto;" in proc.stdout


def test_doctor_says_what_the_llama_cpp_path_does(llama_pair):
    target, draft = llama_pair
    env = {**os.environ, "SPECD_ENGINE_FORWARD_BACKEND": "llamacpp"}
    proc = run("doctor", "--model", str(target), "--draft-model", str(draft), env=env)
    assert proc.returncode == 0, proc.stderr
    for role in ("target", "draft"):
        line = next(line for line in proc.stdout.splitlines() if line.strip().startswith(f"{role} forward:"))
        assert line.strip().startswith(f"{role} forward: llamacpp (llama.cpp on "), line
        assert "prefill on torch's lean forward (K/V handed over, keys interleaved; checked at load)" in line


def test_doctor_reports_a_missing_model(tmp_path):
    proc = run("doctor", "--model", str(tmp_path / "nope"))
    assert proc.returncode == 1
    assert "does not exist" in proc.stdout


def test_complete_json_is_checkable_against_plain_transformers(llama_pair, tmp_path):
    target, draft = llama_pair
    source = tmp_path / "mod.py"
    source.write_text("def add(a, b):\n    return a + b\n\n\ndef mul(a, b):\n    \n", encoding="utf-8")
    proc = run("complete", str(source), "--line", "6", "--col", "4", "--model", str(target),
               "--draft-model", str(draft), "--max-tokens", "12", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["via"] == "local"
    assert {"text", "prompt_ids", "token_ids", "stop_reason", "target_forwards", "sources"} <= set(out)
    # Anyone can check losslessness with plain transformers from these ids (and, where token
    # healing cut the indentation before the cursor, the same constraint on the first tokens).
    from transformers import AutoTokenizer

    from specd.engine.speculation.healing import HealingVocabulary

    model = AutoModelForCausalLM.from_pretrained(target)
    ids = torch.tensor([out["prompt_ids"]])
    assert out["healed"] == "    "  # the cursor's indentation: re-typed by the first tokens
    vocabulary = HealingVocabulary(AutoTokenizer.from_pretrained(target), model.config.vocab_size)
    reference = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                               eos_token_id=None, pad_token_id=0,
                               prefix_allowed_tokens_fn=vocabulary.prefix_allowed_fn(out["healed"], ids.shape[1]),
                               )[0, ids.shape[1]:].tolist()
    assert out["token_ids"] == reference[: len(out["token_ids"])]


def test_complete_rejects_out_of_range_positions(llama_pair, tmp_path):
    target, _ = llama_pair
    source = tmp_path / "mod.py"
    source.write_text("x = 1\n", encoding="utf-8")
    proc = run("complete", str(source), "--line", "9", "--col", "0", "--model", str(target), "--local")
    assert proc.returncode == 2 and "out of range" in proc.stderr
    proc = run("complete", str(source), "--line", "1", "--col", "99", "--model", str(target), "--local")
    assert proc.returncode == 2 and "--col 99" in proc.stderr
    proc = run("complete", str(tmp_path / "missing.py"), "--line", "1", "--col", "0", "--local")
    assert proc.returncode == 2 and "no such file" in proc.stderr


def test_parser_knows_the_complete_flags():
    args = build_parser().parse_args(["complete", "f.py", "--line", "1", "--col", "0", "--no-draft",
                                      "--no-lookup", "--max-tokens", "5", "--json"])
    assert args.no_draft and args.no_lookup and args.max_tokens == 5 and args.json


@pytest.mark.parametrize("args", [("status",), ("status", "--json"), ("--help",), ("doctor", "--no-load")])
def test_a_closed_stdout_is_no_traceback(args):
    """`specd status | head`: the reader goes away; specd stops quietly (exit 141, as `yes | head`)."""
    read_end, write_end = os.pipe()
    os.close(read_end)  # every write to stdout now fails with EPIPE, as after `head` exits
    try:
        proc = subprocess.run([sys.executable, "-m", "specd", *args], stdout=write_end, stderr=subprocess.PIPE,
                              text=True, timeout=120)
    finally:
        os.close(write_end)
    assert "Traceback" not in proc.stderr and "BrokenPipeError" not in proc.stderr, proc.stderr
    # argparse itself ignores a failed write of its help (exit 0); everything else stops with 141.
    assert proc.returncode == (0 if args == ("--help",) else 141), proc.stderr
