"""specd bench: workloads cut from source, and the whole bench through the real CLI on a tiny pair
(JSON schema, every method token-identical to HF greedy, KV reuse visible, PNG plot); the
prefix-cache HF peer, decode times, empty references and the forced FIM layout."""

from __future__ import annotations

import contextlib
import json

import pytest

from specd.bench.peers import ABLATIONS, ALL_METHODS, PEERS, Run
from specd.bench.report import format_table, goals, percentile, quality, summarize_workload
from specd.bench.workloads import (
    REPLAY_STEPS,
    WORKLOADS,
    SourceFile,
    build_workloads,
    function_body_lines,
    load_corpus,
    typing_stops,
    workload_size,
)
from bench_helpers import SHORT_PROMPTS, bench_cli, module_bench_env
from specd.cli import main

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


# -- workloads (no models) -----------------------------------------------------------------

def test_corpus_reads_python_files_only(corpus_dir):
    files = load_corpus(corpus_dir)
    assert [f.name for f in files] == ["sample_module.py"]


def test_workloads_are_deterministic_by_seed(corpus_dir):
    files = load_corpus(corpus_dir)
    first = build_workloads(WORKLOADS, files, 6, seed=1)
    assert first == build_workloads(WORKLOADS, files, 6, seed=1)
    assert first != build_workloads(WORKLOADS, files, 6, seed=2)
    assert {name: len(items) for name, items in first.items()} == {name: workload_size(name, 6) for name in WORKLOADS}


def test_edit_replay_asks_at_least_24_requests_over_4_functions_by_default(corpus_dir):
    files = load_corpus(corpus_dir)
    assert workload_size("line", 12) == 12 and workload_size("edit_replay", 12) == 24
    assert workload_size("edit_replay", 2) == 24 and workload_size("edit_replay", 20) == 40
    items = build_workloads(["edit_replay"], files, 12, seed=0)["edit_replay"]
    assert len(items) == 24
    per_doc: dict[str, int] = {}
    for item in items:
        per_doc[item.doc] = per_doc.get(item.doc, 0) + 1
    assert len(per_doc) >= 4 and max(per_doc.values()) <= REPLAY_STEPS


def test_line_cursor_sits_after_indentation_inside_a_function(corpus_dir):
    files = load_corpus(corpus_dir)
    for item in build_workloads(["line"], files, 8, seed=0)["line"]:
        line_start = item.text.rfind("\n", 0, item.offset) + 1
        indent = item.text[line_start:item.offset]
        assert indent and not indent.strip()  # function bodies are indented
        assert item.text[item.offset] == "\n"  # the rest of the block was deleted


def test_edit_replay_grows_one_document_word_by_word(corpus_dir):
    files = load_corpus(corpus_dir)
    items = build_workloads(["edit_replay"], files, 12, seed=0)["edit_replay"]
    by_doc: dict[str, list] = {}
    for item in items:
        by_doc.setdefault(item.doc, []).append(item)
    assert len(by_doc) >= 2
    for steps in by_doc.values():
        for before, after in zip(steps, steps[1:]):
            typed_before = before.text[: before.offset]
            assert after.text[: after.offset].startswith(typed_before) and after.offset > before.offset
            assert before.text[before.offset:] == after.text[after.offset:]  # the text after the cursor stays


def test_typing_stops_follow_indentation_and_words():
    typed = "    total = a + b\n    return total\n"
    stops = typing_stops(typed)
    assert [typed[:s] for s in stops[:4]] == ["    ", "    total", "    total =", "    total = a"]
    assert typed[: stops[-1]].endswith("return total")


def test_nested_functions_and_bad_source():
    text = "def outer():\n    x = 1\n    def inner():\n        return x\n    return inner\n"
    lines = function_body_lines(SourceFile("f.py", text))
    assert [text[line.cursor:line.line_end] for line in lines] == ["x = 1", "def inner():", "return x", "return inner"]
    inner = lines[2]
    assert text[inner.body_end:].startswith("    return inner")  # innermost function's end
    assert function_body_lines(SourceFile("bad.py", "def (:\n")) == []


def test_every_completion_knows_the_deleted_text(corpus_dir):
    """The reference for quality metrics: the text that followed the cursor before deletion."""
    source = load_corpus(corpus_dir)[0].text
    workloads = build_workloads(WORKLOADS, load_corpus(corpus_dir), 4, seed=1)
    for name, items in workloads.items():
        for item in items:
            assert item.expected, (name, item.label)
            # putting the deleted text back gives the original file, up to the kept newline
            restored = item.text[:item.offset] + item.expected
            assert source.startswith(restored) or source.startswith(restored.rstrip("\n")), (name, item.label)


def test_quality_scores_the_cursor_line():
    q = quality(["return x + 1\n    pass", "  y = 2", "zzz"], ["return x + 1\n", "y = 3\n", "\nnext"])
    assert q["scored"] == 2  # an empty expected line is not scored
    assert q["next_line_exact"] == 0.5
    assert 0.5 < q["edit_similarity"] < 1.0
    assert q["stray_whitespace"] == 0.5  # "  y = 2" where "y = 3" was deleted


def test_percentile_interpolates():
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 50) == 3.0
    assert percentile([10.0, 20.0], 95) == pytest.approx(19.5)
    assert percentile([], 95) == 0.0


# -- the whole bench, through the CLI --------------------------------------------------------

@pytest.fixture(scope="module")
def bench_run(llama_pair, corpus_dir, tmp_path_factory):
    """One bench run on the tiny llama pair, shared by the checks below."""
    target, draft = llama_pair
    out = tmp_path_factory.mktemp("bench-out")
    plot = out / "bench.png"
    with module_bench_env(out):  # short prompts: seconds, on the code path real models take
        code, stdout, _ = bench_cli("--limit", "3", "--max-tokens", "10", "--seed", "3", "--json",
                                    "--plot", str(plot), pair=(target, draft), corpus=corpus_dir)
    return code, stdout, plot


def test_bench_json_schema(bench_run):
    code, stdout, _ = bench_run
    assert code == 0
    report = json.loads(stdout)  # stdout is the JSON object and nothing else
    for key in ("command", "models", "device", "dtype", "torch", "transformers", "settings", "goals"):
        assert key in report
    assert report["command"].startswith("specd bench ") and "--threads 1" in report["command"]
    assert report["threads"] == 1
    # the specd engine's forward paths, with what the lean one measured (engine.numpy_products)
    assert report["forward"]["target"]["path"] == "lean" and "static KV cache" in report["forward"]["target"]["detail"]
    assert set(report["workloads"]) == set(WORKLOADS)
    assert report["settings"]["edit_replay_requests"] == 24
    # the draft model's agreement measured at load, and the chain cut-off chosen from it
    agreement = report["draft_agreement"]
    assert agreement["positions"] == 256 and 0 <= agreement["first"] <= 1
    assert report["settings"]["draft_confidence"] == agreement["confidence"]
    assistant = report["hf_settings"]["hf_assisted"]
    assert {"num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold"} <= set(assistant)
    for name, workload in report["workloads"].items():
        assert {"scored", "next_line_exact", "edit_similarity"} <= set(workload["quality"])
        completions = workload_size(name, 3)
        assert workload["completions"] == completions
        assert workload["empty_references"] == len(workload["empty_reference_at"])
        assert list(workload["methods"]) == list(ALL_METHODS)
        for method, s in workload["methods"].items():
            for key in ("median_ms", "p95_ms", "mean_tokens_per_forward", "first_token_median_ms", "decode_median_ms"):
                assert isinstance(s[key], float) and s[key] >= 0, (name, method, key)
            assert s["median_ms"] > 0 and s["p95_ms"] >= s["median_ms"]
            # decode time = whole call - first token, per completion, so its median is no larger
            assert s["decode_median_ms"] <= s["median_ms"]
            assert isinstance(s["identical"], bool)
            assert len(s["ms"]) == completions
            assert s["mean_tokens_per_forward"] > 0
            assert set(s["speedup_vs"]) == set(s["decode_speedup_vs"]) == set(PEERS) - {method}
            if method == "specd":  # paired against each ablation, with a goal per ablation
                assert set(s["vs_ablations"]) == set(ABLATIONS)
                assert all(r > 0 for r in s["vs_ablations"].values())
                goals = {g["goal"] for g in report["goals"] if g["workload"] == name}
                assert {f"specd vs {a} (paired)" for a in ABLATIONS} <= goals
            for peer, ratio in s["speedup_vs"].items():
                peer_median = workload["methods"][peer]["median_ms"]
                assert ratio == pytest.approx(peer_median / s["median_ms"], rel=1e-2, abs=1e-3)
            for peer, ratio in s["decode_speedup_vs"].items():
                peer_decode = workload["methods"][peer]["decode_median_ms"]
                assert ratio == pytest.approx(peer_decode / s["decode_median_ms"], rel=1e-2, abs=1e-3)


def test_bench_every_method_is_token_identical_to_hf_greedy(bench_run):
    report = json.loads(bench_run[1])
    assert report["identical"] is True
    for workload in report["workloads"].values():
        for method, s in workload["methods"].items():
            assert s["identical"] is True and s["mismatches"] == 0, method
            # Identity proven on the completions where the reference wrote something.
            expected = workload["completions"] - workload["empty_references"]
            assert s["matched_nonempty"] == expected, method
    assert report["identical_evidence"] > 0


def test_bench_kv_reuse_shows_in_edit_replay(bench_run):
    methods = json.loads(bench_run[1])["workloads"]["edit_replay"]["methods"]
    assert methods["specd"]["prefill_tokens"]["reused"] > 0
    assert methods["specd_no_reuse"]["prefill_tokens"]["reused"] == 0
    assert methods["hf_greedy"]["prefill_tokens"]["reused"] == 0
    assert methods["hf_prefix_cache"]["prefill_tokens"]["reused"] > 0
    # Keystrokes after a document's first request reuse more than the workload as a whole.
    warm, overall = methods["specd"]["prefill_reused_fraction_warm"], methods["specd"]["prefill_reused_fraction"]
    assert warm > overall and warm > 0.5
    assert methods["specd_no_reuse"]["prefill_reused_fraction_warm"] == 0
    # Acceptance is reported per draft source, and only for the sources a method may use (which
    # ones the engine's planner chooses on a random tiny pair is the engine's business).
    assert any(methods[m]["acceptance"] for m in ("specd", "specd_no_draft", "specd_no_lookup"))
    assert methods["specd_no_draft"]["acceptance"].get("draft") is None
    assert methods["specd_no_tree"]["acceptance"].get("tree") is None  # chains only
    assert not any(source.startswith("lookup") for source in methods["specd_no_lookup"]["acceptance"])


def test_bench_plot_is_a_png(bench_run):
    plot = bench_run[2]
    assert plot.read_bytes()[:8] == PNG_MAGIC
    assert plot.stat().st_size > 10_000


def test_bench_table_prints_ratios(bench_run):
    table = format_table(json.loads(bench_run[1]))
    assert "vs hf_greedy" in table and "edit_replay" in table and "identical" in table
    assert "specd_no_reuse" in table and "vs hf_prefix_cache" in table
    for column in ("1st tok ms", "decode ms", "prompt reused", "decode vs hf_greedy"):
        assert column in table
    assert "specd vs its ablations, paired" in table and "specd vs specd_no_tree (paired)" in table
    assert "draft model at load: agrees with the target on" in table


def test_bench_rejects_unknown_names(capsys):
    assert main(["bench", "--workloads", "line,nope"]) == 2
    assert "unknown workload nope" in capsys.readouterr().err
    assert main(["bench", "--methods", "hf_greedy,fast"]) == 2
    assert "unknown method fast" in capsys.readouterr().err


# -- the prefix-cache HF peer, empty references, the FIM layout flag -------------------------

@contextlib.contextmanager
def _one_document_replay(llama_pair, corpus_dir):
    """(engine, its first edit_replay document's requests), on one torch thread."""
    import torch

    from engine_helpers import make_engine

    target, draft = llama_pair
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        engine = make_engine(target, draft, prefix_tokens=192, suffix_tokens=64)
        items = build_workloads(["edit_replay"], load_corpus(corpus_dir), 3, seed=0)["edit_replay"]
        yield engine, [item for item in items if item.doc == items[0].doc][:3]
    finally:
        torch.set_num_threads(threads)


def test_hf_prefix_cache_reuses_a_documents_prefix_and_matches_hf_greedy(llama_pair, corpus_dir):
    from specd.bench.peers import make_method
    from specd.bench.run import _prompt_ids

    with _one_document_replay(llama_pair, corpus_dir) as (engine, steps):
        doc = steps[0].doc
        steps.append(steps[-1])  # the same request again: all but the last prompt token reused
        greedy, cached = make_method("hf_greedy", engine, 8), make_method("hf_prefix_cache", engine, 8)
        runs = []
        for item in steps:
            prompt = _prompt_ids(engine, item)
            expected, got = greedy.run(item, prompt), cached.run(item, prompt)
            assert got.tokens == expected.tokens
            assert got.prefill_computed + got.prefill_reused == len(prompt)
            assert got.decode_ms == pytest.approx(got.ms - got.first_token_ms)
            runs.append((prompt, got))
        assert any(got.tokens for _, got in runs)  # not an empty-vs-empty comparison
        assert runs[0][1].prefill_reused == 0  # first request of the document: cold
        assert all(got.prefill_reused > 0 for _, got in runs[1:])  # then the common prefix is reused
        prompt, again = runs[-1]
        assert again.prefill_reused == len(prompt) - 1
        cached.close_document(doc)  # drops the cache: cold again
        after = cached.run(steps[0], _prompt_ids(engine, steps[0]))
        assert after.prefill_reused == 0 and after.tokens == runs[0][1].tokens


def test_idle_time_after_an_edit_warms_both_caches_and_changes_no_output(llama_pair, corpus_dir):
    """``--idle-ms``: a specd method hears each edit and runs the daemon's idle prefill before the
    request, untimed. The request then finds the target's cache at the cursor and the draft's
    cache filled too; outputs stay hf_greedy's."""
    from specd.bench.peers import make_method
    from specd.bench.run import _prompt_ids

    with _one_document_replay(llama_pair, corpus_dir) as (engine, steps):
        greedy = make_method("hf_greedy", engine, 8)
        for idle_ms in (0, 10_000):
            specd = make_method("specd", engine, 8, idle_ms=idle_ms)
            assert specd.idle_ms == idle_ms
            runs = []
            for item in steps:
                prompt = _prompt_ids(engine, item)
                run = specd.run(item, prompt)
                assert run.tokens == greedy.run(item, prompt).tokens
                runs.append(run)
            state = engine.caches.get(specd._uri(steps[0].doc))
            if idle_ms:
                assert all(run.prefill_computed <= 1 for run in runs[1:])  # idle prefill ran up to the cursor
                assert len(state.draft.ids) > 0.9 * len(state.target.ids)
            else:
                assert sum(run.prefill_computed for run in runs[1:]) > 2  # the typed words, at request time
            specd.close_document(steps[0].doc)


def _runs(outputs: list[list[int]], ms: float) -> list[Run]:
    return [Run(tokens, ms, max(1, len(tokens)), ms / 4, 100, 0) for tokens in outputs]


def test_against_llamacpp_a_flip_at_a_near_tie_leaves_a_goal_met_and_a_defect_does_not():
    """On a quantized file llama.cpp's kernels round a wide verify otherwise than a step: an
    output that parts from its greedy at a near-tie still counts, one that parts elsewhere
    (a defect) fails every goal of its workload, whatever the speed."""
    labels = ["cold/a.py@3", "cold/b.py@9"]
    summary = summarize_workload({"llamacpp": _runs([[1, 2, 3], [5, 6, 7]], 100.0),
                                  "specd": _runs([[1, 2, 3], [5, 6, 8]], 50.0)}, [50, 50], labels, "llamacpp")
    specd = summary["methods"]["specd"]
    assert not specd["identical"] and specd["matched_nonempty"] == 1

    def met(flips: dict | None) -> bool:
        if flips is None:
            specd.pop("near_ties", None)
        else:
            specd["near_ties"] = flips
        [goal] = [g for g in goals({"cold": summary}) if g["goal"] == "specd speedup vs llamacpp"]
        assert goal["measured"] == pytest.approx(2.0)
        return goal["met"]

    assert met({"flips": 1, "near_ties": 1, "defects": 0})
    assert not met({"flips": 1, "near_ties": 0, "defects": 1})
    assert not met(None)  # flips nobody measured prove nothing


def test_ablation_engines_share_the_forward_paths_their_options_leave_alike(llama_pair):
    """specd_no_tree's engine runs on specd's own forward paths (one copy of the transposed
    weights, one measured choice of routes); an engine whose options change the paths builds
    its own."""
    from dataclasses import replace

    from engine_helpers import make_engine
    from specd.bench.peers import sibling

    engine = make_engine(*llama_pair, prefix_tokens=192, suffix_tokens=64)
    no_tree = sibling(engine, token_tree=False)
    assert no_tree is not engine and no_tree.paths is engine.paths
    assert no_tree.planning is not engine.planning  # its own calibration and planner memory
    other = sibling(engine, numpy_products="off" if engine.options.numpy_products != "off" else "on")
    assert other.paths["target"][0] is not engine.paths["target"][0]
    assert engine.share_paths(replace(engine.options, forward_backend="llamacpp")) is None


def test_empty_references_are_counted_and_prove_nothing():
    labels = ["edit_replay/a.py@3:3", "edit_replay/a.py@3:3"]
    mixed = summarize_workload({"hf_greedy": _runs([[], [5, 6, 7]], 100.0), "specd": _runs([[], [5, 6, 7]], 20.0)},
                               [50, 50], labels)
    assert mixed["empty_references"] == 1 and mixed["empty_reference_at"] == [0]
    specd = mixed["methods"]["specd"]
    assert specd["identical"] and specd["matched_nonempty"] == 1
    assert specd["decode_median_ms"] == pytest.approx(15.0)
    assert specd["decode_speedup_vs"]["hf_greedy"] == pytest.approx(5.0)

    # Every reference empty: identical, but vacuously so; speed goals are not met on that.
    vacuous = summarize_workload({"hf_greedy": _runs([[], []], 100.0), "specd": _runs([[], []], 10.0)},
                                 [50, 50], labels)
    assert vacuous["empty_references"] == 2 and vacuous["methods"]["specd"]["matched_nonempty"] == 0
    checked = goals({"edit_replay": vacuous})
    assert checked and all(not g["met"] and g["evidence"] == 0 for g in checked)
    proven = goals({"edit_replay": mixed})
    assert any(g["met"] for g in proven) and all(g["evidence"] == 1 for g in proven)

    report = {"models": {"target": "t", "target_params": 1e6, "draft": "d", "draft_params": 1e5},
              "settings": {"max_tokens": 8, "seed": 0, "corpus": "c"}, "device": "cpu", "dtype": "float32",
              "torch": "x", "transformers": "y", "threads": 1, "fim_layout": "psm",
              "workloads": {"edit_replay": vacuous}, "goals": checked, "identical": True,
              "identical_evidence": 0, "empty_references": 2, "command": "specd bench", "wall_s": 1.0}
    table = format_table(report)
    assert "vacuous" in table and "2 of 2 hf_greedy outputs are empty" in table
    assert "'identical' proves nothing" in table


@pytest.mark.parametrize("layout", ["psm", "anchored"])
def test_bench_fim_layout_flag_is_applied_and_recorded(layout, llama_pair, corpus_dir, monkeypatch):
    for var, value in SHORT_PROMPTS.items():
        monkeypatch.setenv(var, value)
    code, stdout, _ = bench_cli("--workloads", "edit_replay", "--methods", "hf_prefix_cache,specd", "--fim-layout",
                                layout, "--limit", "1", "--max-tokens", "6", "--json", pair=llama_pair,
                                corpus=corpus_dir)
    assert code == 0
    report = json.loads(stdout)
    assert report["fim_layout"] == layout and report["settings"]["fim_layout"] == layout
    assert f"--fim-layout {layout}" in report["command"]
    workload = report["workloads"]["edit_replay"]
    assert workload["completions"] == 24 and workload["documents"] >= 4
    # Same prompts for all (specd checks it built the ids the HF peers got), same outputs.
    assert report["identical"] is True and report["identical_evidence"] > 0
    assert workload["methods"]["hf_prefix_cache"]["prefill_tokens"]["reused"] > 0


def test_bench_rejects_an_unknown_fim_layout(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--fim-layout", "sideways"])
    assert exit_info.value.code == 2
    assert "--fim-layout" in capsys.readouterr().err


def test_bench_refuses_a_layout_the_model_family_lacks(llama_pair, corpus_dir, capsys):
    target, draft = llama_pair  # Qwen-style FIM tokens: no suffix-first layout
    code = main(["bench", "--model", str(target), "--draft-model", str(draft), "--device", "cpu",
                 "--corpus", str(corpus_dir), "--fim-layout", "spm", "--limit", "1", "--json"])
    assert code == 2
    assert "suffix-first" in capsys.readouterr().err
