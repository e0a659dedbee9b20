"""Position encodings: LSP (line, character) <-> code-point offsets, and the document mirror."""

from __future__ import annotations

import pytest
from hypothesis import given, strategies as st

from specd_lsp.documents import Document
from specd_lsp.positions import TextIndex, negotiate, units

# "x" + emoji (astral: 2 UTF-16 units, 4 bytes) + CJK (BMP: 1 unit, 3 bytes) + "é" (2 bytes)
LINE = "x😀你é="
TEXT = f"a\r\n{LINE}1\rb\n"


@pytest.mark.parametrize("encoding, widths", [
    ("utf-32", [1, 1, 1, 1, 1]),
    ("utf-16", [1, 2, 1, 1, 1]),
    ("utf-8", [1, 4, 3, 2, 1]),
])
def test_every_character_boundary_round_trips(encoding, widths):
    index = TextIndex(TEXT)
    column = 0
    for chars, width in enumerate([0] + widths):
        column += width
        offset = index.offset(1, column, encoding)
        assert offset == 3 + chars
        assert index.position(offset, encoding) == (1, column)


def test_inside_a_character_rounds_down_and_past_the_end_clamps():
    index = TextIndex(TEXT)
    assert index.offset(1, 2, "utf-16") == 4  # inside the surrogate pair -> start of the emoji
    assert index.offset(1, 3, "utf-8") == 4  # inside the emoji's 4 bytes
    assert index.offset(1, 99, "utf-16") == 3 + len(LINE) + 1  # end of line, before \r
    assert index.offset(9, 0) == len(TEXT)
    assert index.offset(-1, 5) == 0


def test_lines_break_only_at_lsp_line_breaks():
    index = TextIndex("a\x0cb\u2028c\r\nd\re\nf")  # form feed and U+2028 are not line breaks
    assert index.line_count == 4
    assert index.line_text(0) == "a\x0cb\u2028c"
    assert index.offset(1, 0) == index.text.index("d")
    # An offset between \r and \n is the end of the line's content.
    assert index.position(index.text.index("\r\n") + 1, "utf-16") == (0, 5)
    assert index.position(index.text.index("e"), "utf-16") == (2, 0)


def test_negotiate_prefers_the_clients_first_known_encoding():
    assert negotiate(["utf-8", "utf-16"]) == "utf-8"
    assert negotiate(["utf-32"]) == "utf-32"
    assert negotiate(["latin-1"]) == "utf-16"
    assert negotiate(None) == "utf-16"


@pytest.mark.parametrize("encoding", ["utf-8", "utf-16", "utf-32"])
def test_ranged_edits_in_each_encoding(encoding):
    doc = Document("file:///t.py", "# 😀 你好\nx = 1\n", 1)
    start = units("# 😀 ", encoding)
    edit = doc.apply({"range": {"start": {"line": 0, "character": start},
                                "end": {"line": 0, "character": start + units("你", encoding)}}, "text": "🎉"},
                     encoding)
    assert doc.text == "# 😀 🎉好\nx = 1\n"
    assert edit == {"start": 4, "end": 5, "text": "🎉"}
    doc.apply({"text": "whole"}, encoding)
    assert doc.text == "whole"


TEXTS = st.text(alphabet=st.sampled_from(list("ab \n\r\t😀你é")), max_size=40)


@given(TEXTS, st.integers(0, 60), st.sampled_from(["utf-8", "utf-16", "utf-32"]))
def test_offset_position_round_trip(text, offset, encoding):
    index = TextIndex(text)
    offset = min(offset, len(text))
    line, character = index.position(offset, encoding)
    back = index.offset(line, character, encoding)
    # Offsets between \r and \n have no position of their own: they map to the line's end.
    if offset > 0 and text[offset - 1:offset + 1] == "\r\n":
        assert back == offset - 1
    else:
        assert back == offset
