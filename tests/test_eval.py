"""``specd eval``: cases cut from real files, scoring of what the editor would show, the CLI."""

from __future__ import annotations

import contextlib
import io
import json

import pytest

from specd.bench.evaluate import KINDS, Case, build_cases, score
from specd.bench.workloads import load_corpus
from specd.cli import main
from specd_lsp.completion import Suggestion


@pytest.fixture(scope="module")
def files():
    return load_corpus(None)  # the held-out stdlib modules


def test_every_kind_is_cut_from_the_file_it_names(files):
    cases = build_cases(files, 4, seed=1)
    assert {c.kind for c in cases} == set(KINDS)
    by_name = {f.name: f.text for f in files}
    twins = [c for c in cases if c.kind == "multi_file"]
    assert twins and all(c.expected.split("\n")[0].strip() in dict(c.workspace)[c.workspace[i][0]]
                         for i, c in enumerate(twins))
    for case in cases:
        original = by_name[case.name.split(":")[0]]
        extra = 1 if case.kind in ("body_first", "multi_file") else 0  # the emptied body keeps its line open
        assert case.text[:case.offset] + case.expected + case.text[case.offset + extra:] == original, case
        assert case.expected.strip()
    mid = [c for c in cases if c.kind == "mid_line"]
    assert all(c.text[c.offset - 1] == "(" and c.text[c.offset] == ")" for c in mid)
    fresh = [c for c in cases if c.kind == "fresh_line"]
    assert all(c.text[:c.offset].split("\n")[-1].strip() == "" for c in fresh)  # only the indentation
    assert build_cases(files, 4, seed=1) == cases  # deterministic


def _case(text: str, cursor_marker: str = "|", expected: str = "") -> Case:
    offset = text.index(cursor_marker)
    return Case("fresh_line", "t.py:1", text.replace(cursor_marker, "", 1), offset, expected)


def test_scores():
    case = _case("def f(x):\n    |\n    return x\n", expected="y = x + 1")
    good = score(case, "y = x + 1", Suggestion("y = x + 1"))
    assert good["exact"] and good["parses"] and good["edit_similarity"] == 1.0
    assert not good["stray_whitespace"] and not good["retyped_suffix"] and not good["empty"]

    doubled = score(case, "    y = x + 1", Suggestion("    y = x + 1"))
    assert doubled["stray_whitespace"]

    cut = score(case, "y = x + 1\n    z = (x", Suggestion("y = x + 1\n    z = (x"))
    assert cut["parses"]  # judged on its whole lines: the token limit cut the last one

    broken = score(case, "y = = 1", Suggestion("y = = 1"))
    assert not broken["parses"] and 0 < broken["edit_similarity"] < 1

    nothing = score(case, "", None)
    assert nothing["empty"] and not nothing["exact"] and not nothing["parses"]

    call = Case("mid_line", "t.py:1", "print(len())\n", 10, "x")
    retyped = score(call, "x))", Suggestion("x))"))
    assert retyped["retyped_suffix"]
    assert not score(call, "x", Suggestion("x"))["retyped_suffix"]

    body = Case("fresh_line", "t.py:2", "def f():\n    \n    return x\n", 13, "y = 1")
    looping = score(body, "", Suggestion("y = 1\n    y = 1"))
    assert looping["repeated_line"] and not looping["retyped_next_line"]
    assert score(body, "", Suggestion("y = 1\n    return x"))["retyped_next_line"]
    assert not any(score(body, "", Suggestion("y = 1"))[m] for m in ("repeated_line", "retyped_next_line"))


def test_eval_cli_on_a_tiny_pair(tiny_pairs, sample_source, tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "inventory.py").write_text(sample_source)
    target, draft = tiny_pairs["llama"]
    out, err = io.StringIO(), io.StringIO()
    plot = tmp_path / "eval.png"
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["eval", "--model", str(target), "--draft-model", str(draft), "--device", "cpu",
                     "--corpus", str(corpus), "--limit", "2", "--max-tokens", "8", "--threads", "1",
                     "--variants", "healing,no_healing,psm,spm,context,no_context,plain_window,window_128",
                     "--json", "--plot",
                     str(plot)])
    assert code == 0, err.getvalue()
    data = json.loads(out.getvalue())
    # The tiny pair's Qwen tokens have no suffix-first layout: spm is left out, said in the log.
    assert list(data["variants"]) == ["healing", "no_healing", "psm", "context", "no_context", "plain_window",
                                      "window_128"]
    assert "variant spm left out" in err.getvalue()
    assert data["kinds"] == list(KINDS)
    for variant in data["variants"].values():
        assert variant["all"]["cases"] == data["cases"] == len(data["completions"]["healing"])
        assert set(variant["by_kind"]) == set(KINDS)
        assert 0 <= variant["all"]["edit_similarity"] <= 1 and variant["all"]["tokens_per_forward"] > 0
    assert plot.stat().st_size > 10_000
    # The narrow window a cold document answers from: a shorter prompt than the full one.
    windows = data["variants"]["window_128"]["all"]["prompt_tokens"]
    assert 0 < windows <= 128 + 8 and windows < data["variants"]["healing"]["all"]["prompt_tokens"]
    # Boundaries: the engine with them returns the boundary-cut text of the uncut completion.
    boundaries = data["boundaries"]
    assert boundaries["checked"] == data["cases"] and boundaries["mismatched"] == 0
    assert boundaries["tokens_with"] <= boundaries["tokens_without"]
    assert set(boundaries["by_kind"]) == set(KINDS)
    assert boundaries["all"]["all"]["repeated_line"] == 0 == boundaries["all"]["all"]["retyped_next_line"]
    # Every variant but the plain window (no boundaries there, as llama.vim sends it) cuts repeats.
    assert all(variant["all"]["repeated_line"] == 0 for name, variant in data["variants"].items()
               if name != "plain_window")

    code = main(["eval", "--kinds", "fresh_line,nowhere"])
    assert code == 2
