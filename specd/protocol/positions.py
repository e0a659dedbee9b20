"""Positions <-> code-point offsets in the three encodings, shared by the daemon and specd-lsp.

``character`` counts in a unit chosen per session or request: UTF-16 code units (LSP's
default), UTF-8 bytes (Neovim's columns) or UTF-32 code points. Python strings index code
points, so everything converts at the edge. Lines follow the LSP rule: a line ends at
``\\r\\n``, ``\\r`` or ``\\n`` and at nothing else, unlike ``str.splitlines`` which also breaks at
form feeds and U+2028.

``TextIndex`` clamps, never raises: a character past the end of its line means the end of the
line (the LSP rule), a line past the end means the end of the document, a position inside a
surrogate pair or a multi-byte character rounds down to its start. Callers that must refuse
out-of-range input (the daemon's socket API) check before converting.
"""

from __future__ import annotations

import bisect
import re
from typing import Literal

Encoding = Literal["utf-8", "utf-16", "utf-32"]
ENCODINGS: tuple[Encoding, ...] = ("utf-8", "utf-16", "utf-32")
DEFAULT_ENCODING: Encoding = "utf-16"  # LSP's default when none is negotiated

LINE_BREAK = re.compile(r"\r\n|\r|\n")


def units(text: str, encoding: str) -> int:
    """Length of ``text`` in the encoding's units."""
    if encoding == "utf-32":
        return len(text)
    if text.isascii():
        return len(text)
    if encoding == "utf-16":
        return len(text) + sum(1 for ch in text if ord(ch) > 0xFFFF)
    return len(text.encode("utf-8", errors="surrogatepass"))


def chars_for_units(line: str, count: int, encoding: str) -> int:
    """How many code points of ``line`` the first ``count`` units cover (rounded down)."""
    if count <= 0:
        return 0
    if encoding == "utf-32" or line.isascii():
        return min(count, len(line))
    used = 0
    for index, ch in enumerate(line):
        width = units(ch, encoding)
        if used + width > count:
            return index
        used += width
    return len(line)


class TextIndex:
    """Line starts of one text, for position <-> offset conversion (build once per version)."""

    __slots__ = ("text", "_starts")

    def __init__(self, text: str):
        self.text = text
        self._starts: list[int] | None = None

    @property
    def line_starts(self) -> list[int]:
        if self._starts is None:
            self._starts = [0] + [match.end() for match in LINE_BREAK.finditer(self.text)]
        return self._starts

    @property
    def line_count(self) -> int:
        return len(self.line_starts)

    def line_end(self, line: int) -> int:
        """Offset of the end of ``line``'s content (before its line break)."""
        starts = self.line_starts
        if line + 1 >= len(starts):
            return len(self.text)
        end = starts[line + 1]
        if self.text[end - 1] == "\n":
            end -= 1
            if end > starts[line] and self.text[end - 1] == "\r":
                end -= 1
        else:  # a lone \r
            end -= 1
        return end

    def line_text(self, line: int) -> str:
        return self.text[self.line_starts[line]:self.line_end(line)]

    def offset(self, line: int, character: int, encoding: str = DEFAULT_ENCODING) -> int:
        """Code-point offset of an LSP position, clamped into the document."""
        starts = self.line_starts
        if line < 0:
            return 0
        if line >= len(starts):
            return len(self.text)
        content = self.line_text(line)
        return starts[line] + chars_for_units(content, max(character, 0), encoding)

    def position(self, offset: int, encoding: str = DEFAULT_ENCODING) -> tuple[int, int]:
        """(line, character in ``encoding`` units) of a code-point offset."""
        offset = max(0, min(offset, len(self.text)))
        line = bisect.bisect_right(self.line_starts, offset) - 1
        start = self.line_starts[line]
        # An offset between \r and \n belongs to the end of the line's content.
        column_text = self.text[start:min(offset, self.line_end(line))]
        return line, units(column_text, encoding)


def offset_at(text: str, line: int, character: int, encoding: str = DEFAULT_ENCODING) -> int:
    return TextIndex(text).offset(line, character, encoding)


def position_at(text: str, offset: int, encoding: str = DEFAULT_ENCODING) -> tuple[int, int]:
    return TextIndex(text).position(offset, encoding)
