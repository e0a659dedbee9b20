"""A fresh indented line (Enter inside a method body, the editor's autoindent before the cursor):
accepting the suggestion must not indent the line twice."""

from __future__ import annotations

from specd_lsp.completion import context_at, keep_editor_indent, postprocess

METHOD = "class Stack:\n    def pop(self):\n        "


def test_the_editors_indentation_wins_on_a_fresh_line():
    # The demo pair, healing the cursor's 8 spaces, answered with 16: the line would get 16.
    suggestion = postprocess("        return self.items.pop()", context_at(METHOD, len(METHOD)))
    assert suggestion is not None and suggestion.insert_text == "return self.items.pop()"


def test_later_lines_keep_their_shape():
    # Later lines carry absolute indentation: the model put the block at 16, its body at 20.
    raw = "        if self.items:\n                    return self.items.pop()\n                return None"
    suggestion = postprocess(raw, context_at(METHOD, len(METHOD)))
    # (the block rule then stops after the `if` block the first line opened)
    assert suggestion.insert_text == "if self.items:\n            return self.items.pop()"
    # As inserted after the editor's 8 spaces: the block as the model shaped it, at the editor's indent.
    assert (METHOD + suggestion.insert_text).endswith("\n        if self.items:\n            return self.items.pop()")


def test_only_on_a_line_of_indentation():
    assert keep_editor_indent("    x = 1", "") == "    x = 1"  # column 0: the model's indentation is all there is
    assert keep_editor_indent("  # note", "x = 1") == "  # note"  # after code: spaces are the model's text
    assert keep_editor_indent("return x", "        ") == "return x"
    assert keep_editor_indent("\tpass", "\t") == "pass"
    assert keep_editor_indent("    a\n  b\nc", "    ") == "a\nb\nc"  # later lines move left as far as they can


# A cursor inside the indentation: Neovim's normal mode keeps the cursor on the last blank of a
# line of blanks, so a request comes from column 7 of a fresh line of 8, one blank after it.
BODY = "class Bar:\n    def __init__(self, total):\n        \n        self.total = total\n"
FRESH = BODY.index("        \n")  # the fresh line's start


def _accepted(text: str, offset: int, suggestion) -> str:
    return text[:offset] + suggestion.insert_text + text[offset + suggestion.replace_chars:]


def test_a_cursor_inside_the_indentation_gets_the_lines_the_lines_end_gets():
    # The model re-types the blank after the cursor and indents its later lines at 8, as the body does.
    inside = postprocess(" self.count = 0\n        self.done = 0", context_at(BODY, FRESH + 7))
    at_end = postprocess("self.count = 0\n        self.done = 0", context_at(BODY, FRESH + 8))
    assert inside.replace_chars == 1 and inside.insert_text.startswith(" self")  # it replaces the blank
    assert _accepted(BODY, FRESH + 7, inside) == _accepted(BODY, FRESH + 8, at_end)
    assert _accepted(BODY, FRESH + 7, inside).split("\n")[2:5] == [
        "        self.count = 0", "        self.done = 0", "        self.total = total"]


def test_inside_the_indentation_the_editors_indentation_wins_both_ways():
    # Deeper than the line's indentation: the extra goes, the later lines move left with it.
    deeper = postprocess("   x = 1\n          y = 2", context_at(BODY, FRESH + 7))
    assert _accepted(BODY, FRESH + 7, deeper).split("\n")[2:4] == ["        x = 1", "        y = 2"]
    # Shallower (from column 4, four blanks after the cursor): the first line still starts at 8,
    # and the later lines move right with it, so the block keeps its shape.
    shallower = postprocess("if total:\n        y = 2", context_at(BODY, FRESH + 4))
    assert shallower.replace_chars == 4
    assert _accepted(BODY, FRESH + 4, shallower).split("\n")[2:4] == ["        if total:", "            y = 2"]
    # Nothing is left behind the suggestion's last line.
    assert _accepted(BODY, FRESH + 7, deeper).split("\n")[3] == "        y = 2"


def test_blanks_after_the_cursor_are_replaced_only_on_a_line_of_blanks():
    code_after = "def f():\n    x = 1\n"  # the cursor inside the indentation of a line with code
    kept = postprocess("  y = 2\n", context_at(code_after, code_after.index("x") - 2))
    assert kept is not None and kept.replace_chars == 0
    # A completion that starts with a line break leaves the line's blanks as they are.
    broken = postprocess("\n        x = 1", context_at(BODY, FRESH + 7))
    assert broken is not None and broken.replace_chars == 0
    # With a selected completion-list item the range is the item's: nothing after the cursor goes.
    selected = postprocess(" x = 1", context_at(BODY, FRESH + 7), replace_line_suffix=False)
    assert selected.replace_chars == 0 and selected.insert_text == "x = 1"


def test_keep_editor_indent_counts_the_blanks_after_the_cursor():
    assert keep_editor_indent(" a\n        b", "       ", " ") == " a\n        b"  # re-types the blank: kept
    assert keep_editor_indent("a\n       b", "       ", " ") == " a\n        b"  # short by one: moved right
    assert keep_editor_indent("   a\n          b\n\n c", "       ", " ") == " a\n        b\n\nc"
    assert keep_editor_indent("a", "       ", " x") == "a"  # code after the cursor: not a line of blanks
