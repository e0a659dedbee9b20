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
