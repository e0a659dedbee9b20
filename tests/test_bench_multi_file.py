"""The bench's multi_file workload: a function to write whose near-twin lives in a workspace file
that is not open, and the methods specd (workspace index on) and specd_no_workspace (off)."""

from __future__ import annotations

import json

import pytest

from bench_helpers import SHORT_PROMPTS, bench_cli
from specd.bench.workloads import SourceFile, build_workloads, load_corpus, multi_file_workload


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


def test_the_twin_reaches_every_methods_prompt_as_repo_context(llama_pair, corpus_dir):
    """The workspace gives what a user gets from it: its files' chunks most like the code at the
    cursor, in the prompt (repo-level FIM), for every method alike, so outputs stay comparable;
    specd_no_workspace differs only in the workspace lookup index."""
    import torch

    from engine_helpers import make_engine
    from specd.bench.peers import make_method
    from specd.bench.report import summarize_workload
    from specd.bench.run import _prompt_ids, measure

    target, draft = llama_pair
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        engine = make_engine(target, draft, prefix_tokens=192, suffix_tokens=64, context_tokens=256)
        items = multi_file_workload(load_corpus(corpus_dir), 3, seed=0)
        for item in items:
            prompt = _prompt_ids(engine, item)
            twin_path, twin = item.workspace[items.index(item)]
            assert prompt.chunks and any(c.path == twin_path for c in prompt.chunks), prompt.chunks
            body_line = item.expected.split("\n", 1)[0].strip()
            chunk = next(c for c in prompt.chunks if c.path == twin_path)
            assert body_line in chunk.text  # the deleted body's first line, from the twin
            assert engine.pair.tokenizer.decode(prompt).count(body_line) >= 1
        methods = [make_method(name, engine, 12) for name in ("hf_greedy", "specd", "specd_no_workspace")]
        runs, lengths, labels, *_ = measure(engine, methods, {"multi_file": items})["multi_file"]
        summary = summarize_workload(runs, lengths, labels)["methods"]
    finally:
        torch.set_num_threads(threads)
    on, off = summary["specd"], summary["specd_no_workspace"]
    assert on["identical"] and off["identical"]
    assert "lookup:workspace" not in off["acceptance"]
