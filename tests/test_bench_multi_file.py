"""The bench's multi_file workload: a function to write whose near-twin lives in a workspace file
that is not open, and the methods specd (workspace index on) and specd_no_workspace (off)."""

from __future__ import annotations

import json
import shutil

import pytest

from bench_helpers import SHORT_PROMPTS, bench_cli
from specd.bench.workloads import SourceFile, build_workloads, load_corpus, multi_file_workload


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory):
    from conftest import SAMPLE_SOURCE

    root = tmp_path_factory.mktemp("multi-file-corpus")
    shutil.copy(SAMPLE_SOURCE, root / "sample_module.py")
    return root


def test_each_body_is_missing_from_its_document_and_present_in_a_twin_not_open(corpus_dir):
    files = load_corpus(corpus_dir)
    items = multi_file_workload(files, 4, seed=0)
    assert len(items) == 4 and items == multi_file_workload(files, 4, seed=0)
    assert items != multi_file_workload(files, 4, seed=1)
    source = files[0].text
    workspace = dict(items[0].workspace)
    assert all(item.workspace == items[0].workspace for item in items)  # one workspace for the workload
    assert len(workspace) == 4 and all(name.startswith("variants/") for name in workspace)
    for item in items:
        assert item.doc.startswith("multi_file/") and item.doc not in workspace
        # The body was deleted: the document is shorter than the source by what follows the cursor.
        deleted = source[item.offset:len(source) - (len(item.text) - item.offset - 1)]
        body_lines = [line for line in deleted.splitlines() if line.strip()]
        assert len(body_lines) >= 2
        assert item.text[item.offset] == "\n" and item.text[:item.offset] == source[:item.offset]
        # ... and a twin in the workspace holds it, under another name.
        twins = [text for text in workspace.values() if deleted.strip() in text]
        assert len(twins) == 1 and "_variant(" in twins[0]


def test_functions_too_short_or_unparsable_give_no_items():
    assert multi_file_workload([SourceFile("a.py", "def f():\n    return 1\n")], 5, 0) == []
    assert multi_file_workload([SourceFile("b.py", "def (:\n")], 5, 0) == []
    assert build_workloads(["multi_file"], [], 3, 0) == {"multi_file": []}


def test_bench_reports_specd_and_specd_no_workspace_side_by_side(llama_pair, corpus_dir, tmp_path, monkeypatch):
    for var, value in SHORT_PROMPTS.items():
        monkeypatch.setenv(var, value)
    code, stdout, _ = bench_cli("--workloads", "multi_file", "--methods", "specd,specd_no_workspace", "--limit", "3",
                                "--max-tokens", "12", "--seed", "0", "--json", pair=llama_pair, corpus=corpus_dir)
    assert code == 0
    report = json.loads(stdout)
    workload = report["workloads"]["multi_file"]
    assert workload["completions"] == 3
    methods = workload["methods"]
    assert list(methods) == ["hf_greedy", "specd", "specd_no_workspace"]
    assert report["identical"] is True  # the workspace changes the drafts, never the output
    on, off = methods["specd"], methods["specd_no_workspace"]
    assert "lookup:workspace" not in off["acceptance"]  # with the index off, that source does not exist
    for summary in (on, off):
        assert summary["median_ms"] > 0 and summary["mean_tokens_per_forward"] > 0
        assert set(summary["speedup_vs"]) == {"hf_greedy"}


def test_specd_drafts_from_the_twin_when_it_holds_what_the_target_writes(llama_pair, corpus_dir):
    """A random tiny target does not write what the source's twin holds; so here each twin holds
    the target's own continuation (as the daemon test does), and the two methods differ only in
    whether the workspace index is on."""
    import dataclasses

    import torch

    from engine_helpers import make_engine
    from specd.bench.peers import make_method
    from specd.bench.report import summarize_workload
    from specd.bench.run import measure
    from specd.engine import CompletionRequest

    target, draft = llama_pair
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        engine = make_engine(target, draft, prefix_tokens=192, suffix_tokens=64)
        items = multi_file_workload(load_corpus(corpus_dir), 3, seed=0)
        twins = []
        for number, item in enumerate(items):
            reference = engine.complete(CompletionRequest(text=item.text, offset=item.offset, max_tokens=12,
                                                          stop_at_block_end=False, use_lookup=False,
                                                          use_draft_model=False))
            twins.append((f"variants/v{number}.py", item.text[item.offset - 200:item.offset] + reference.text))
        items = [dataclasses.replace(item, workspace=tuple(twins)) for item in items]
        methods = [make_method(name, engine, 12) for name in ("hf_greedy", "specd", "specd_no_workspace")]
        runs, lengths, labels, *_ = measure(engine, methods, {"multi_file": items})["multi_file"]
        summary = summarize_workload(runs, lengths, labels)["methods"]
    finally:
        torch.set_num_threads(threads)
    on, off = summary["specd"], summary["specd_no_workspace"]
    assert on["identical"] and off["identical"]
    assert on["acceptance"]["lookup:workspace"]["accepted"] > 0
    assert "lookup:workspace" not in off["acceptance"]
    assert on["target_forwards"] < off["target_forwards"]  # fewer forwards for the same tokens
