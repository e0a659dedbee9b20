"""specd bench's forward costs: ms of a forward per path (hf, lean), width and context, and of a
prefill, for target and draft; in the JSON and the table; --forward-costs-only and
--no-forward-costs; all through the real CLI on tiny pairs (one a GPT-2 the lean path refuses)."""

from __future__ import annotations

import json
import shutil

import pytest

from bench_helpers import SHORT_PROMPTS, bench_cli
from specd.bench.costs import TARGET_WIDTHS, capped, window_cap
from specd.bench.report import format_table
from specd.cli import main
from tiny import make_tiny_pair

WIDTHS = [str(w) for w in TARGET_WIDTHS]


@pytest.fixture(scope="module")
def llama_costs(llama_pair):
    """One --forward-costs-only --json run on the tiny Llama pair, shared by the checks below."""
    code, stdout, stderr = bench_cli("--forward-costs-only", "--json", pair=llama_pair)
    assert code == 0, stderr
    return json.loads(stdout), stderr  # stdout is the JSON object and nothing else


def _assert_figures(role: dict, contexts: list[str], widths: list[str], paths: set[str]) -> None:
    assert set(role["paths"]) == paths
    for figures in role["paths"].values():
        assert list(figures["forward_ms"]) == contexts
        for row in figures["forward_ms"].values():
            assert list(row) == widths and all(ms > 0 for ms in row.values())
        assert figures["prefill_ms"] > 0 and figures["prefill_ms_per_1k"] > 0


def test_contexts_stay_inside_the_window():
    assert window_cap(2048, 4096) == 2016 and window_cap(None, 4096) == 4064
    assert window_cap(None, None) is None
    assert capped((512, 2048), 2016) == [512, 2016]  # measured at the cap, not dropped
    assert capped((512, 2048), 300) == [300]
    assert capped((512, 2048), None) == [512, 2048]


def test_forward_costs_of_both_paths_for_a_llama_pair(llama_costs):
    report, stderr = llama_costs
    assert "forward costs of the target" in stderr  # the progress line
    assert "--forward-costs-only" in report["command"] and "workloads" not in report
    assert report["device"] == "cpu" and report["threads"] == 1
    costs = report["forward_costs"]
    assert costs["repeats"] == 5 and costs["cap"] == 4096 - 32  # the tiny models' 4096 positions

    target = costs["target"]
    assert target["engine_path"] == "lean" and target["unavailable"] == {}
    assert target["widths"] == list(TARGET_WIDTHS) and target["contexts"] == [512, 2048]
    assert target["prefill_tokens"] == 1024
    _assert_figures(target, ["512", "2048"], WIDTHS, {"hf", "lean", "llamacpp"})  # llama-cpp-python installed
    ratios = target["lean_over_hf"]
    assert list(ratios["forward_ms"]) == ["512", "2048"]
    for context, row in ratios["forward_ms"].items():
        for width, ratio in row.items():
            lean, hf = (target["paths"][p]["forward_ms"][context][width] for p in ("lean", "hf"))
            assert ratio == pytest.approx(lean / hf, rel=1e-2, abs=1e-3)
    assert ratios["prefill_ms_per_1k"] > 0
    # On a CPU the lean path computes logits as verification reads them: one row's verify figures.
    one_row = target["paths"]["lean"]["verify_one_row_ms"]
    assert list(one_row) == ["512", "2048"] and all(list(row) == WIDTHS for row in one_row.values())
    assert all(ms > 0 for row in one_row.values() for ms in row.values())
    assert "verify_one_row_ms" not in target["paths"]["hf"]  # transformers' forward: every row at once

    draft = costs["draft"]
    assert draft["engine_path"] == "lean" and draft["widths"] == [1] and draft["contexts"] == [512]
    _assert_figures(draft, ["512"], ["1"], {"hf", "lean", "llamacpp"})
    assert draft["lean_over_hf"]["forward_ms"]["512"]["1"] > 0
    assert all("verify_one_row_ms" not in figures for figures in draft["paths"].values())  # draft steps verify nothing


@pytest.fixture(scope="module")
def gpt2_upcast_pair(tmp_path_factory):
    """A tiny GPT-2 pair with reorder_and_upcast_attn, an option the lean path does not implement."""
    pair = make_tiny_pair(tmp_path_factory.mktemp("gpt2-upcast"), "gpt2")
    for path in pair:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
        (path / "config.json").write_text(json.dumps(config | {"reorder_and_upcast_attn": True}), encoding="utf-8")
    return pair


def test_a_model_without_a_lean_path_has_only_the_hf_path(gpt2_upcast_pair):
    code, stdout, stderr = bench_cli("--forward-costs-only", "--json", pair=gpt2_upcast_pair)
    assert code == 0, stderr
    costs = json.loads(stdout)["forward_costs"]
    for role, contexts, widths in (("target", ["512", "2048"], WIDTHS), ("draft", ["512"], ["1"])):
        figures = costs[role]
        assert figures["engine_path"] == "hf"
        _assert_figures(figures, contexts, widths, {"hf"})
        assert "reorder_and_upcast_attn" in figures["unavailable"]["lean"]
        assert "f16 table" in figures["unavailable"]["llamacpp"]  # specd keeps GPT-2s off llama.cpp: lossless
        assert figures["lean_over_hf"] is None


def test_forward_costs_only_prints_the_table(llama_pair):
    code, stdout, stderr = bench_cli("--forward-costs-only", pair=llama_pair)
    assert code == 0, stderr
    assert stdout.startswith("specd bench --forward-costs-only: target ")
    assert "forward costs:" in stdout and "prefill ms/1k" in stdout
    for cell in ("w=1", "w=16", "1-step", "lean/hf"):
        assert cell in stdout, cell
    rows = [line.split() for line in stdout.splitlines()
            if line.split()[:1] in (["hf"], ["lean"], ["llamacpp"], ["lean/hf"])]
    # target: hf, lean, llamacpp and lean/hf at 512 and 2048 tokens; draft: the same at 512
    assert [row[:2] for row in rows] == [["hf", "512"], ["hf", "2048"], ["lean", "512"], ["lean", "2048"],
                                         ["llamacpp", "512"], ["llamacpp", "2048"],
                                         ["lean/hf", "512"], ["lean/hf", "2048"],
                                         ["hf", "512"], ["lean", "512"], ["llamacpp", "512"], ["lean/hf", "512"]]
    assert len(rows[0]) == 2 + len(TARGET_WIDTHS) + 1 and len(rows[1]) == 2 + len(TARGET_WIDTHS)  # prefill once


@pytest.fixture
def corpus_dir(tmp_path, monkeypatch):
    from conftest import SAMPLE_SOURCE

    shutil.copy(SAMPLE_SOURCE, tmp_path / "sample_module.py")
    for var, value in SHORT_PROMPTS.items():
        monkeypatch.setenv(var, value)
    return tmp_path


def test_a_bench_measures_forward_costs_unless_told_not_to(llama_pair, corpus_dir):
    quick = ["--corpus", str(corpus_dir), "--workloads", "cold", "--methods", "specd", "--limit", "1",
             "--max-tokens", "4", "--json"]
    code, stdout, stderr = bench_cli(*quick, pair=llama_pair)
    assert code == 0, stderr
    report = json.loads(stdout)
    assert set(report["forward_costs"]["target"]["paths"]) == {"hf", "lean", "llamacpp"}
    assert "forward costs of the target" in stderr
    table = format_table(report)
    assert "forward costs:" in table and "lean/hf" in table

    code, stdout, stderr = bench_cli(*quick, "--no-forward-costs", pair=llama_pair)
    assert code == 0, stderr
    report = json.loads(stdout)
    assert report["forward_costs"] is None and "--no-forward-costs" in report["command"]
    assert "forward costs of the target" not in stderr and "forward costs:" not in format_table(report)
    assert report["workloads"]["cold"]["completions"] == 1


def test_only_and_skip_contradict(capsys):
    assert main(["bench", "--forward-costs-only", "--no-forward-costs"]) == 2
    assert "--forward-costs-only" in capsys.readouterr().err


def test_an_engine_replaying_graphs_has_its_lean_path_measured_also_without(llama_pair):
    """Where the engine's lean path replays CUDA graphs (here the static-shape forward run
    eagerly, as on a CPU only tests can), the lean forward without them is measured beside it."""
    import torch
    from transformers import AutoModelForCausalLM

    from specd.bench.costs import candidate_paths, format_forward_costs, measure_role
    from specd.engine.forward.lean import LeanForward

    model = AutoModelForCausalLM.from_pretrained(llama_pair[0], dtype=torch.float32).eval()
    lean = LeanForward(model)
    lean.use_graphs("eager")
    paths, unavailable = candidate_paths(model, lean)
    assert list(paths) == ["hf", "lean", "lean_eager"] and unavailable == {}
    assert paths["lean"] is lean and paths["lean_eager"].graphs is None
    role = measure_role(model, lean, list(range(1, 200)), [64], [1, 2], 64, repeats=2, synchronize=lambda: None)
    assert set(role["paths"]) == {"hf", "lean", "lean_eager"}
    assert "verify_one_row_ms" not in role["paths"]["lean"]  # replays compute every row, as on a GPU
    assert "verify_one_row_ms" in role["paths"]["lean_eager"]
    table = format_forward_costs({"repeats": 2, "target": role, "draft": None})
    assert any(line.split()[:2] == ["lean_eager", "64"] for line in table.splitlines())
