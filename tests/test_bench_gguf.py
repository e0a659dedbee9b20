"""specd bench on a GGUF target: the reference for "identical" is llama.cpp's own greedy of the
same file (``llamacpp``), the default methods are those that run on a GGUF file, an HF method is
refused in one line, and the forward costs measure llama.cpp's path alone. The pair is a tiny
random-weight target and a near draft, exported to Q8_0 in the test (as tests/test_gguf_models.py)."""

from __future__ import annotations

import json

import pytest

from bench_helpers import bench_cli, module_bench_env
from conftest import GGUF_ON_LLAMACPP
from engine_helpers import make_near_draft
from tiny import make_tiny_pair
from specd.bench.reference import GGUF_DEFAULT_METHODS, GGUF_REFERENCE, TORCH_REFERENCE, baseline
from specd.bench.report import format_table
from specd.bench.workloads import WORKLOADS
from specd.llamacpp.export import export_gguf


@pytest.fixture(scope="module")
def q8_pair(tmp_path_factory):
    """(target.gguf, draft.gguf), both Q8_0."""
    root = tmp_path_factory.mktemp("bench-gguf")
    target, _ = make_tiny_pair(root / "llama", "llama")
    near = make_near_draft(target, root / "llama" / "near-draft")
    return tuple(export_gguf(source, root / f"{role}.q8_0.gguf", dtype="q8_0").path
                 for role, source in (("target", target), ("draft", near)))


@pytest.fixture(scope="module")
def gguf_report(q8_pair, corpus_dir, tmp_path_factory):
    """One bench run on the Q8_0 pair with the default methods and forward costs."""
    out = tmp_path_factory.mktemp("bench-gguf-out")
    with module_bench_env(out, GGUF_ON_LLAMACPP):
        code, stdout, stderr = bench_cli("--limit", "1", "--max-tokens", "8", "--json", pair=q8_pair, corpus=corpus_dir)
    assert code == 0, stderr
    return json.loads(stdout)


def test_the_baseline_follows_the_kind_of_target():
    assert baseline("", "").reference == TORCH_REFERENCE  # the embedded demo pair
    assert baseline("~/models/coder", None).reference == TORCH_REFERENCE
    for target, draft in (("t.gguf", "d.gguf"), ("ollama:qwen2.5-coder", None)):
        chosen = baseline(target, draft)
        assert chosen.gguf and chosen.reference == GGUF_REFERENCE
        assert chosen.methods(None, target)[0] == GGUF_REFERENCE
    assert baseline("t.gguf", None).methods(["specd"], "t.gguf") == [GGUF_REFERENCE, "specd"]


def test_on_a_gguf_target_every_output_is_llama_cpps_greedy_of_the_same_file(gguf_report, q8_pair):
    report = gguf_report
    assert report["reference"] == GGUF_REFERENCE and "llama.cpp" in report["reference_is"]
    assert report["dtype"] == "gguf Q8_0" and report["models"]["gguf"]["target"]["file"] == str(q8_pair[0])
    assert report["hf_settings"] is None and report["skipped_methods"] == {}
    assert set(report["workloads"]) == set(WORKLOADS)
    for name, workload in report["workloads"].items():
        methods = workload["methods"]
        assert list(methods) == list(GGUF_DEFAULT_METHODS), name  # no HF peer, no second llama.cpp engine
        for method, s in methods.items():
            assert s["identical"] is True and s["mismatches"] == 0, (name, method)
            assert s["matched_nonempty"] == workload["completions"] - workload["empty_references"]
            if method != GGUF_REFERENCE:  # ratios against llamacpp, as on a transformers target
                assert s["speedup_vs"][GGUF_REFERENCE] > 0
    assert report["identical"] is True and report["identical_evidence"] > 0
    edit = report["workloads"]["edit_replay"]["methods"]
    assert edit["specd"]["prefill_tokens"]["reused"] > 0 and edit["specd_no_reuse"]["prefill_tokens"]["reused"] == 0
    table = format_table(report)
    assert "reference, llamacpp (llama.cpp's own greedy" in table and "decode vs llamacpp" in table
    assert "hf_greedy" not in table


def test_forward_costs_on_a_gguf_target_are_llama_cpps_path(gguf_report):
    costs = gguf_report["forward_costs"]
    for role in ("target", "draft"):
        assert costs[role]["engine_path"] == "llamacpp"
        assert list(costs[role]["paths"]) == ["llamacpp"]
        assert set(costs[role]["unavailable"]) == {"hf", "lean"}
    assert costs["cap"] < costs["window"] and all(ms > 0 for ms in costs["target"]["paths"]["llamacpp"]["forward_ms"]["512"].values())


def test_an_hf_method_on_a_gguf_target_is_one_line(q8_pair, capsys, monkeypatch):
    for var, value in GGUF_ON_LLAMACPP.items():
        monkeypatch.setenv(var, value)
    code, stdout, stderr = bench_cli("--methods", "specd,hf_assisted", "--limit", "1", pair=q8_pair)
    assert code == 2 and not stdout
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    assert "hf_assisted needs torch weights" in lines[0] and "is a GGUF file" in lines[0]
    assert "llamacpp" in lines[0] and "Traceback" not in stderr
