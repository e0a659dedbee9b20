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
import codecs
import re
from typing import Literal

Encoding = Literal["utf-8", "utf-16", "utf-32"]
ENCODINGS: tuple[Encoding, ...] = ("utf-8", "utf-16", "utf-32")
DEFAULT_ENCODING: Encoding = "utf-16"  # LSP's default when none is negotiated

LINE_BREAK = re.compile(r"\r\n|\r|\n")
_SURROGATE = re.compile("[\ud800-\udfff]")


def units(text: str, encoding: str) -> int:
    """Length of ``text`` in the encoding's units (C-speed: huge lines cost milliseconds)."""
    if encoding == "utf-32" or text.isascii():
        return len(text)
    if encoding == "utf-16":
        return len(text.encode("utf-16-le", errors="surrogatepass")) // 2
    return len(text.encode("utf-8", errors="surrogatepass"))


def chars_for_units(line: str, count: int, encoding: str) -> int:
    """How many code points of ``line`` the first ``count`` units cover (rounded down).

    Every code point takes at least one unit, so only the first ``count`` code points can be
    covered: the work is bounded by ``count``, and done by the codecs, not a Python loop."""
    if count <= 0:
        return 0
    if encoding == "utf-32":
        return min(count, len(line))
    head = line[:count]
    if head.isascii():
        return len(head)
    if _SURROGATE.search(head):  # lone surrogates (from lenient decoding) do not round-trip: count them one by one
        return _chars_for_units_slow(head, count, encoding)
    codec = "utf-16-le" if encoding == "utf-16" else "utf-8"
    width = 2 if encoding == "utf-16" else 1  # bytes per unit
    covered = len(_decode_prefix(head.encode(codec, errors="surrogatepass")[: width * count], codec))
    # The decoder holds back a lone surrogate at the very end as if a pair might follow.
    if covered < len(head) and units(head[: covered + 1], encoding) <= count:
        covered += 1
    return covered


def _chars_for_units_slow(line: str, count: int, encoding: str) -> int:
    used = 0
    for index, ch in enumerate(line):
        used += units(ch, encoding)
        if used > count:
            return index
    return len(line)


def _decode_prefix(data: bytes, codec: str) -> str:
    """Decode ``data``, dropping an incomplete character at its end (a cut through one)."""
    decoder = codecs.getincrementaldecoder(codec)(errors="surrogatepass")
    return decoder.decode(data, final=False)


class TextIndex:
    """Line starts of one text, for position <-> offset conversion.

    Built once per text; ``replace`` makes the index of the edited text from this one, rescanning
    only the lines the edit touched (a burst of ranged edits costs per edit what the edit
    touches plus a shift of the later line starts, not a scan of the whole document)."""

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

    def replace(self, start: int, end: int, new_text: str) -> TextIndex:
        """The index of ``text[:start] + new_text + text[end:]``, from this one."""
        text = self.text
        edited = text[:start] + new_text + text[end:]
        out = TextIndex(edited)
        if self._starts is None:
            return out  # never needed here: let the new one build lazily too
        starts = self._starts
        # Rescan from the start of the line holding start-1 (a "\r" just before the edit may pair
        # with a "\n" the edit inserts) to a line start after end+1 (a "\r" the edit leaves at its
        # end may pair with a following "\n"); both ends are line starts the edit cannot move.
        first = bisect.bisect_right(starts, start - 1) - 1 if start > 0 else 0
        after = bisect.bisect_right(starts, end + 1)
        delta = len(new_text) - (end - start)
        scan_from = starts[first]
        if after < len(starts):
            scan_to = starts[after] + delta
            rescanned = [m.end() for m in LINE_BREAK.finditer(edited, scan_from, scan_to) if m.end() < scan_to]
            shifted = [s + delta for s in starts[after:]] if delta else starts[after:]
        else:
            rescanned = [m.end() for m in LINE_BREAK.finditer(edited, scan_from)]
            shifted = []
        out._starts = starts[:first + 1] + rescanned + shifted
        return out

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
