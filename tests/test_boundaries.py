"""Suggestion boundaries: each rule on text, token by token through StopRules, the settings
(config, request, socket options), and on an engine: the returned text is a prefix of what the
target alone writes, and README command 1's demo completion prints no line twice."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from engine_helpers import make_engine, reference_tokens
from specd.daemon.params import completion_options
from specd.engine import CompletionRequest
from specd.engine.front.boundaries import (NO_BOUNDARIES, BoundaryRules, Surroundings, apply, boundary, rules_for,
                                           surroundings)
from specd.engine.front.stops import StopRules
from specd.engine.options import EngineOptions
from specd.protocol.errors import RpcError
from specd.suggestion_rules import BLOCK_OPENERS, BRACKETS, loops
from specd_lsp.completion import context_at, postprocess

ROOT = Path(__file__).resolve().parent.parent

BODY = Surroundings(line_prefix="        ", previous_line="    def pop(self):")


def cut(text: str, around: Surroundings, rule: str) -> str:
    return apply(text, around, BoundaryRules().only(rule))[0]


# -- the cursor's surroundings -----------------------------------------------------------------

def test_surroundings_read_the_lines_around_the_cursor():
    text = "def f():\n\n    x = foo(1)\n    \n\n    return x\n"
    offset = text.index("    \n") + 4
    assert surroundings(text, offset) == Surroundings("    ", "", "    x = foo(1)", "return x")
    inside = text.index("1)")
    assert surroundings(text, inside) == Surroundings("    x = foo(", "1)", "def f():", "return x")
    crlf = text.replace("\n", "\r\n")
    assert surroundings(crlf, crlf.index("    \r\n") + 4) == Surroundings("    ", "", "    x = foo(1)", "return x")
    assert surroundings("", 0) == Surroundings()


# -- one test per rule -------------------------------------------------------------------------

def test_repeated_line_stops_at_the_same_line_twice_in_a_row():
    text = "return self.items.pop()\n        return self.items.pop()\n        return self"
    assert cut(text, BODY, "repeated_line") == "return self.items.pop()"


def test_repeated_line_stops_at_a_line_repeating_one_of_the_last_few():
    text = "c = 0\n        >>> c = 1\n        >>> c = 0\n        >>> c = 1\n        >>> d = 2\n"
    assert cut(text, BODY, "repeated_line") == "c = 0\n        >>> c = 1\n        >>> c = 0"
    # The cursor's line counts with its prefix: ``x = `` + ``1`` then ``x = 1`` again.
    assert cut("1\n    x = 1\n", Surroundings(line_prefix="    x = "), "repeated_line") == "1"


def test_repeated_line_lets_closers_and_far_repeats_be():
    closers = "foo(a,\n            b)\n        }\n    }\n}"
    assert cut(closers, BODY, "repeated_line") == closers
    far = "a = 1\n        b = 2\n        c = 3\n        d = 4\n        e = 5\n        a = 1"
    assert cut(far, BODY, "repeated_line") == far  # more than REPEAT_WINDOW lines apart


def test_repeated_line_drops_a_line_that_loops_within_itself():
    looping = "        DB_CORE" + "_DEBUG_ON" * 8
    assert cut("console.write(x)\n" + looping + "\n        y = 1", BODY, "repeated_line") == "console.write(x)"
    assert cut(looping.strip(), BODY, "repeated_line") == ""  # the cursor's own line loops: nothing to show
    # Judged while the line is written: more text cannot undo a loop.
    assert boundary("x = 1\n" + looping, BODY, BoundaryRules().only("repeated_line")) == (5, "repeated_line")


@pytest.mark.parametrize("data", [
    "[None, None, None, None, None]", "bytes([0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00])",
    '"=" * 40 + "========================================"', 'b"\\x00\\x00\\x00\\x00\\x00\\x00\\x00\\x00\\x00\\x00"',
    "self.a.b.c.d.e.f.g.h.i.j.k.l.m.n.o.p.q.r.s.t.u.v.w.x.y.z",
])
def test_repeated_line_lets_data_written_out_be(data):
    assert not loops(data)
    assert cut(data + "\n        return x", BODY, "repeated_line") == data + "\n        return x"


def test_suffix_line_stops_at_the_suffixs_next_line():
    around = Surroundings(line_prefix="        ", previous_line="    def pop(self):", next_line="return item")
    text = "item = self.items.pop()\n\n        return item\n"
    assert cut(text, around, "suffix_line") == "item = self.items.pop()"
    assert cut("return item\n        x = 1", around, "suffix_line") == ""  # the cursor's line re-types it
    mid = Surroundings(line_prefix="    x = foo(", line_suffix=")", next_line="x")
    assert cut("x\n    y", mid, "suffix_line") == "x\n    y"  # the cursor's line goes on after the cursor


def test_block_end_stops_at_a_less_indented_line_and_at_the_end_of_an_opened_block():
    text = "total = 0\n        for v in values:\n            total += v\n        return total\n\n    def other():"
    assert cut(text, BODY, "block_end") == "total = 0\n        for v in values:\n            total += v\n        return total"
    opened = Surroundings(line_prefix="    if x")
    assert cut(":\n        y = 1\n    z = 2\n", opened, "block_end") == ":\n        y = 1"
    braces = Surroundings(line_prefix="    if (x) ")
    assert cut("{\n        y();\n    }\n    z();", braces, "block_end") == "{\n        y();\n    }"
    # CRLF: a blank line is no dedent.
    crlf = "a = 1\r\n\r\n        b = 2\r\n    c"
    assert cut(crlf, BODY, "block_end") == "a = 1\r\n\r\n        b = 2"


def test_current_line_where_no_block_is_expected():
    typed = Surroundings(line_prefix="    x = compute(", previous_line="    y = 0")
    assert cut("a, b)\n    z = 1\n", typed, "current_line") == "a, b)"
    inside = Surroundings(line_prefix="    x = foo(", line_suffix=")", previous_line="def f():")
    assert cut("a, b\n    c", inside, "current_line") == "a, b"
    after_statement = Surroundings(line_prefix="    x = 1", previous_line="    y = 0")
    assert cut("\n    z = 2\n    w = 3", after_statement, "current_line") == "\n    z = 2"


@pytest.mark.parametrize("around, text", [
    (Surroundings(line_prefix="    if x", previous_line="def f():"), ":\n        y = 1\n        z = 2"),  # opens a block
    (Surroundings(line_prefix="    x = call(", previous_line="def f():"), "\n        a,\n        b)"),
    (Surroundings(line_prefix="    ", previous_line="    y = 0"), "z = 1\n    w = 2"),  # empty line in a body
    (Surroundings(line_prefix="", previous_line="def f():"), "    z = 1\n    w = 2"),  # after a line ending in :
    (Surroundings(line_prefix="    ret", previous_line="def f():"), "urn 1\n    x"),
    (Surroundings(line_prefix="    if (x) {", previous_line=""), "\n        y();\n    }"),
])
def test_current_line_keeps_several_lines_where_a_block_is_expected(around, text):
    assert cut(text, around, "current_line") == text


def test_the_earliest_rule_cuts_and_no_rule_cuts_with_all_off():
    text = "return self._get_format(self._name)\n        return self._get_format(self._name)\n        return self._get_format"
    assert apply(text, BODY, BoundaryRules()) == ("return self._get_format(self._name)", "repeated_line")
    assert apply(text, BODY, BoundaryRules.none()) == (text, None)


def test_a_boundary_seen_token_by_token_is_the_one_of_the_whole_text():
    """Rules judge only complete lines (or lines with content, for indentation), so the cut
    found while the text grows is the one found on the finished text."""
    texts = ["a = 1\n        a = 1\n        b", "x = 1\n    y = 2\n  z", "if a:\n            b\n        c\n",
             "item = pop()\n\n        return item\n", "a = 1\n        b = c" + "_on_debug" * 8 + "\n        d"]
    around = Surroundings(line_prefix="        ", previous_line="    def f():", next_line="return item")
    for text in texts:
        whole = apply(text, around, BoundaryRules())
        for end in range(len(text) + 1):
            found = boundary(text[:end], around, BoundaryRules())
            if found is not None:
                assert (text[:found[0]], found[1]) == whole, (text, end)
                break


# -- one copy, the engine's and specd-lsp's ------------------------------------------------------

@pytest.mark.parametrize("document, raw, kept", [
    # Tab-indented Python, a line indented with 8 spaces: one tab's width, so it leaves the method.
    ("class Stack:\n\tdef pop(self):\n\t\t|", "item = self.items.pop()\n        return item\n\tdef push(self):",
     "item = self.items.pop()"),
    # Space-indented, a tab-indented line: 8 columns, deeper than the cursor's 4, so it stays.
    ("def f():\n    |", "a = 1\n\tb = 2\nc = 3", "a = 1\n\tb = 2"),
    # Tab-indented Go: the bracket closing the block the cursor's line opened is kept.
    ("func f() {\n\tif ok {|", "\n\t\treturn 1\n\t}\n\treturn 0", "\n\t\treturn 1\n\t}"),
])
def test_tab_indented_code_is_cut_in_the_same_place_by_the_engine_and_specd_lsp(document, raw, kept):
    """A tab is TAB_WIDTH columns in both: the engine's block end and specd-lsp's post-processing
    are one rule (specd.suggestion_rules)."""
    offset = document.index("|")
    text = document.replace("|", "", 1)
    assert apply(raw, surroundings(text, offset), BoundaryRules().only("block_end"))[0] == kept
    assert postprocess(raw, context_at(text, offset)).insert_text == kept


SHARED = ROOT / "specd" / "suggestion_rules.py"
# What the suggestion rules define, which no other module of the tree may define again.
DEFINED_ONCE = {"TAB_WIDTH", "REPEAT_WINDOW", "BRACKETS", "BLOCK_OPENERS", "CLOSERS", "indent_width", "opens_block",
                "block_end", "suffix_line", "repeated_line", "current_line", "expects_block", "Surroundings",
                "BoundaryRules"}


def _definitions(tree: ast.Module) -> set[str]:
    """The rules' names ``tree`` defines (functions and classes anywhere, constants at module
    level), and its literals of the block openers or the bracket pairs."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names = {node.name}
        elif isinstance(node, (ast.Assign, ast.AnnAssign)) and node in tree.body:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names = {target.id for target in targets if isinstance(target, ast.Name)}
        elif isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            values = [elt.value for elt in node.elts if isinstance(elt, ast.Constant)]
            names = {"a literal of BLOCK_OPENERS"} if len(values) == len(node.elts) and set(values) == set(
                BLOCK_OPENERS) else set()
        elif isinstance(node, ast.Dict):
            pairs = {(key.value, value.value) for key, value in zip(node.keys, node.values)
                     if isinstance(key, ast.Constant) and isinstance(value, ast.Constant)}
            names = {"a literal of BRACKETS"} if pairs and pairs in (set(BRACKETS.items()),
                                                                     {(b, a) for a, b in BRACKETS.items()}) else set()
        else:
            continue
        found |= {name for name in names if name in DEFINED_ONCE or name.startswith("a literal")}
    return found


def _sources() -> list[Path]:
    """The tree's source outside tests: the packages and the Python scripts."""
    scripts = [path for path in (ROOT / "scripts").iterdir()
               if path.is_file() and path.read_text(encoding="utf-8", errors="replace").startswith("#!/usr/bin/env python")]
    return [*(ROOT / "specd").rglob("*.py"), *(ROOT / "lsp").rglob("*.py"), *scripts]


def test_the_suggestion_rules_are_defined_once_in_the_tree():
    assert _definitions(ast.parse(SHARED.read_text(encoding="utf-8"))) >= {"BLOCK_OPENERS", "block_end", "TAB_WIDTH"}
    again = {str(path.relative_to(ROOT)): sorted(found) for path in _sources() if path != SHARED
             if (found := _definitions(ast.parse(path.read_text(encoding="utf-8"))))}
    assert again == {}, "defined again outside specd/suggestion_rules.py (import it from there)"


def test_a_second_copy_would_be_found():
    copy = 'BLOCK_OPENERS = ("{", ":")\ndef block_end(text): ...\nif line.endswith((":", "{", "(", "[")): ...\n' \
           'OPENERS = {"(": ")", "[": "]", "{": "}"}\nCLOSE = {")": "(", "]": "[", "}": "{"}\n'
    assert _definitions(ast.parse(copy)) == {"BLOCK_OPENERS", "block_end", "a literal of BLOCK_OPENERS",
                                             "a literal of BRACKETS"}


# -- StopRules, token by token --------------------------------------------------------------

@pytest.fixture(scope="module")
def tokenizer(llama_pair):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(llama_pair[0])


def stop_on(tokenizer, text: str, around: Surroundings, rules: BoundaryRules = BoundaryRules()):
    stops = StopRules(tokenizer, set(), False, around.indent, rules=rules, around=around)
    tokens = tokenizer.encode(text, add_special_tokens=False)
    for count, token in enumerate(tokens, start=1):
        reason = stops(token)
        if reason:
            return reason, stops.text(), count, len(tokens)
    return stops.finish("eos"), stops.text(), len(tokens), len(tokens)


def test_stop_rules_stop_generation_at_the_boundary(tokenizer):
    text = "return self.items.pop()\n        return self.items.pop()\n        return self.items.pop()\n"
    reason, shown, used, total = stop_on(tokenizer, text, BODY)
    assert (reason, shown) == ("repeated_line", "return self.items.pop()")
    assert used < total  # generation stopped at the second copy's line break, not at the end


def test_stop_rules_stop_a_loop_within_a_line_as_it_is_written(tokenizer):
    text = "console.write(x)\n        DB_CORE" + "_DEBUG_ON" * 30 + "\n"
    reason, shown, used, total = stop_on(tokenizer, text, BODY)
    assert (reason, shown) == ("repeated_line", "console.write(x)")
    assert used < total / 2  # stopped a few copies in, not at the line's end


def test_stop_rules_judge_the_last_line_when_generation_ends(tokenizer):
    around = Surroundings(line_prefix="        ", previous_line="    def pop(self):", next_line="return item")
    reason, shown, _, _ = stop_on(tokenizer, "item = self.items.pop()\n        return item", around)
    assert (reason, shown) == ("suffix_line", "item = self.items.pop()")


def test_stop_rules_without_boundaries_keep_the_old_block_end(tokenizer):
    stops = StopRules(tokenizer, set(), False, "        ")
    for token in tokenizer.encode("a = 1\n        a = 1\n    b", add_special_tokens=False):
        if stops(token):
            break
    assert stops.text() == "a = 1\n        a = 1"


# -- settings -----------------------------------------------------------------------------------

def test_request_settings_win_over_the_engines():
    options = EngineOptions(stop_at_repeated_line=False, multiline="always")
    assert rules_for(CompletionRequest(), options) == BoundaryRules(False, True, True, "always")
    asked = CompletionRequest(stop_at_repeated_line=True, stop_at_block_end=False, multiline="blocks")
    assert rules_for(asked, options) == BoundaryRules(True, True, False, "blocks")
    assert rules_for(CompletionRequest(**NO_BOUNDARIES), EngineOptions()) == BoundaryRules.none()


def test_socket_options_and_config_keys():
    parsed = completion_options({"stop_at_repeated_line": False, "stop_at_suffix_line": True, "multiline": "always"})
    assert parsed == {"stop_at_repeated_line": False, "stop_at_suffix_line": True, "multiline": "always"}
    for bad in ({"multiline": "sometimes"}, {"stop_at_suffix_line": "yes"}):
        with pytest.raises(RpcError):
            completion_options(bad)
    from specd.config import SCHEMA

    engine = SCHEMA["engine"]
    assert {engine[k].default for k in ("stop_at_block_end", "stop_at_repeated_line", "stop_at_suffix_line")} == {True}
    assert engine["multiline"].default == "blocks" and engine["multiline"].choices == ("blocks", "always")


# -- on an engine -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def engine(llama_pair):
    return make_engine(*llama_pair, prefix_tokens=384, suffix_tokens=128)


def _decoded(engine, result, tokens):
    stops = StopRules(engine.pair.tokenizer, set(), False, None, healed=result.healed)
    for token in tokens:
        stops(token)
    return stops.text()


@pytest.mark.parametrize("marker", ["    def sell", "        for item in items:\n        ", "    def with_quantity(self"])
def test_the_returned_text_is_a_prefix_of_what_the_target_alone_writes(engine, sample_source, marker):
    offset = sample_source.index(marker) + len(marker)
    for rules in ({}, {"multiline": "always", "stop_at_block_end": False}):
        result = engine.complete(CompletionRequest(text=sample_source, offset=offset, max_tokens=32, **rules))
        allowed = engine.healing_constraint(result.healed, len(result.prompt_ids))
        reference = reference_tokens(engine.pair.target, result.prompt_ids, 32, allowed)
        assert result.token_ids == reference[:len(result.token_ids)], result.stop_reason
        assert _decoded(engine, result, reference).startswith(result.text)
        whole = engine.complete(CompletionRequest(text=sample_source, offset=offset, max_tokens=32, **NO_BOUNDARIES))
        assert whole.text.startswith(result.text)
        expected, rule = apply(whole.text, surroundings(sample_source, offset), rules_for(
            CompletionRequest(**rules), engine.options))
        if whole.stop_reason in ("eos", "max_tokens"):
            assert result.text == expected and (rule is None or result.stop_reason == rule)


def test_readme_command_one_prints_no_line_twice():
    """README command 1: the demo pair in ``Stack.pop``'s body, 40 tokens."""
    from pathlib import Path

    from specd.engine.engine import Engine

    text = (Path(__file__).parent.parent / "examples" / "stack.py").read_text()
    offset = len("".join(text.splitlines(keepends=True)[:8])) + 8
    engine = Engine(EngineOptions(target="demo", device="cpu", time_budget_ms=600_000, forward_backend="torch"))
    engine.ensure_loaded()
    result = engine.complete(CompletionRequest(text=text, offset=offset, max_tokens=40))
    lines = [line.strip() for line in result.text.splitlines() if line.strip()]
    assert lines and len(lines) == len(set(lines)), result.text
    whole = engine.complete(CompletionRequest(text=text, offset=offset, max_tokens=40, **NO_BOUNDARIES))
    assert whole.text.startswith(result.text) and len(result.token_ids) <= len(whole.token_ids)


def test_a_suggestion_ending_on_a_line_break_keeps_it():
    after_statement = Surroundings(line_prefix="x = ")
    assert apply("1 + 2\n", after_statement, BoundaryRules()) == ("1 + 2\n", None)
    assert apply("1 + 2\ny = 3", after_statement, BoundaryRules()) == ("1 + 2", "current_line")


def test_the_remote_engine_applies_the_same_boundaries_to_streamed_text():
    from specd.engine.remote.engine import TextStops

    stops = TextStops(["<|endoftext|>"], False, BODY.indent, rules=BoundaryRules(), around=BODY)
    reasons = [stops.feed(delta) for delta in ("return self", ".items.pop()\n", "        return self.items",
                                               ".pop()\n", "        x")]
    assert reasons[:3] == [None, None, None] and reasons[3] == "repeated_line"
    assert stops.text() == "return self.items.pop()"
