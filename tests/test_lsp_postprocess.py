"""Post-processing rules, one case per rule (``|`` marks the cursor)."""

from __future__ import annotations

import pytest

from specd_lsp.completion import Suggestion, context_at, postprocess


def run(document: str, raw: str, **kwargs) -> Suggestion | None:
    cursor = document.index("|")
    return postprocess(raw, context_at(document.replace("|", "", 1), cursor), **kwargs)


@pytest.mark.parametrize("document, raw", [
    ("x = |\n", ""),
    ("x = |\n", "  \n\n"),
    ("def f():\n    |return x\n", "return x"),  # only repeats the text after the cursor
    ("print(|)\n", ")"),  # nothing but the closer already there
    ("x = foo(|)\n", ")))"),  # closers that match nothing are cut, leaving nothing
])
def test_empty_and_repeating_completions_are_dropped(document, raw):
    assert run(document, raw) is None


@pytest.mark.parametrize("document, raw, insert, replaced", [
    ('print(|)\n', '"hello")', '"hello")', 1),  # the model typed the closer: one of each remains
    ('print(|)\n', '"hello"', '"hello")', 1),  # it did not: the suggestion carries it
    ('print("|")\n', 'hello")', 'hello")', 2),  # inside a string: the quote closes it
    ('print("|")\n', 'hello', 'hello")', 2),
    ('foo(|);\n', 'x);', 'x);', 2),  # trailing punctuation typed by the model is not doubled
    ('foo(|);\n', 'bar(1)', 'bar(1));', 2),  # a closer of its own bracket is not the line's
    ('x = [1, 2|]\n', ', 3]]', ', 3]', 1),  # the extra "]" matches nothing: cut
])
def test_closers_after_the_cursor_are_replaced_and_kept_once(document, raw, insert, replaced):
    suggestion = run(document, raw)
    assert suggestion is not None
    assert (suggestion.insert_text, suggestion.replace_chars) == (insert, replaced)
    cursor = document.index("|")
    text = document.replace("|", "", 1)
    accepted = text[:cursor] + suggestion.insert_text + text[cursor + suggestion.replace_chars:]
    assert accepted.count("(") == accepted.count(")") and accepted.count("[") == accepted.count("]")


@pytest.mark.parametrize("document, raw, insert", [
    ("x = foo(|, b)\n", "a, b)", "a"),  # re-typed the whole rest of the line
    ("x = foo(|, b)\n", "a, b", "a"),  # a partial overlap of 3+ characters
    ("x = foo(|, b)\n", "a)", "a"),  # would close the bracket the rest of the line closes
    ("if (a) {|\n}\n", "\n  b();\n}\nfoo();", "\n  b();"),  # block end, then the "}" line already there
])
def test_overlap_with_the_suffix_is_trimmed(document, raw, insert):
    suggestion = run(document, raw)
    assert suggestion is not None and suggestion.insert_text == insert and suggestion.replace_chars == 0


@pytest.mark.parametrize("document, raw, insert", [
    ("def f():|\n", "\n    return 1\n\ndef g():\n    pass", "\n    return 1"),
    ("def f():\n    |\n", "y = 1\n    return y\nprint(f())", "y = 1\n    return y"),
    ("class A:\n    def f(self):|\n", "\n        pass\n    def g(self):", "\n        pass"),
    # A tab is 8 columns (the engine's rule): 8 spaces under two tabs leave the method.
    ("class A:\n\tdef f(self):\n\t\t|\n", "x = 1\n        return x\n\tdef g(self):", "x = 1"),
])
def test_completions_stop_at_the_end_of_the_block(document, raw, insert):
    assert run(document, raw).insert_text == insert


def test_single_line_mode_cuts_at_the_line_end():
    assert run("x = |\n", "1\ny = 2").insert_text == "1\ny = 2"  # same block: kept
    assert run("x = |\n", "1\ny = 2", single_line=True).insert_text == "1"
    assert run("def f():\n    |\n", "a = 1\n    b = 2", single_line=True).insert_text == "a = 1"


def test_brackets_in_strings_and_comments_do_not_count():
    assert run('s = "(" + |\n', '")"').insert_text == '")"'
    assert run("x = 1  # (\ny = f(|)\n", "a)").insert_text == "a)"


def test_selected_completion_keeps_the_range_empty():
    suggestion = run("print(|)\n", '"hello"', replace_line_suffix=False)
    assert suggestion.insert_text == '"hello"' and suggestion.replace_chars == 0


def test_non_ascii_text_passes_through():
    assert run("s = '你好 😀|'\n", " 🎉'").insert_text == " 🎉'"


def test_control_characters_cut_and_a_cut_multibyte_character_is_dropped():
    assert run("x = |\n", "abc\x0fdef").insert_text == "abc"
    assert run("x = |\n", "abc\x1b[0m").insert_text == "abc"
    assert run("x = |\n", "\x00abc") is None
    assert run("x = |\n", "abc\tdef\n").insert_text == "abc\tdef"  # tabs and line breaks are text
    assert run("x = |\n", "'caf\ufffd").insert_text == "'caf"


def test_a_window_starting_inside_a_long_string_does_not_mislead_the_scanner():
    document = "x = '" + "é" * 10_000 + "'|\n"
    assert run(document, "[ab']").insert_text == "[ab']"
