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
import copy
import re
from array import array
from itertools import accumulate
from typing import Iterable, Literal, Sequence

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


LINES_PER_BLOCK = 256  # line starts are kept in blocks of about this many (see TextIndex)
BUILD_PIECE_CHARS = 64 * 1024  # an index built at once scans this many characters at a time


def starts_array(starts: Iterable[int] = (), size: int = 0) -> array:
    """Line starts as machine integers: 4 bytes each for texts under 4 Gi code points (a Python
    int in a list costs ~36), 8 beyond."""
    return array("I" if size <= 0xFFFFFFFF else "q", starts)


class TextIndex:
    """Line starts of one text, for position <-> offset conversion.

    Built once per text, lazily. ``replace`` makes the index of an edited text from this one
    without scanning or copying the whole text: the starts live in blocks of ~``LINES_PER_BLOCK``
    lines, each with an offset added to all its starts, and an edited index keeps its text as one
    piece per block. An edit rescans the lines it touched, rebuilds the block(s) holding them
    (and their pieces of text) and moves every later block by changing one number. A burst of
    400 ranged edits on a 1 MiB file is then 400 small steps, in any order, and the whole text is
    joined once, when ``text`` is first read after them (each edit copying the whole text made the
    burst cost many times more: docs/reliability.md). Indexes are immutable: ``replace`` shares
    unchanged blocks and pieces with the index it came from. Blocks are arrays of machine
    integers, so an index costs about 4 bytes per line, never a Python object per line."""

    __slots__ = ("_text", "_pieces", "_length", "_blocks", "_shifts", "_first_lines", "_heads", "_count", "_flat")

    def __init__(self, text: str):
        self._text: str | None = text
        self._pieces: list[str] | None = None  # the text, one piece per block, until joined
        self._length = len(text)
        self._blocks: list[array] | None = None  # line starts, each block minus its shift
        self._shifts: list[int] = []  # added to every start in the block
        self._first_lines: list[int] = []  # line number of each block's first start
        self._heads: list[int] = []  # each block's first start
        self._count = 0
        self._flat: list[int] | None = None  # ``line_starts``, built only when asked for

    @property
    def text(self) -> str:
        """The whole text (joined from its pieces on first use after edits, then kept)."""
        if self._text is None:
            self._text, self._pieces = "".join(self._pieces), None
        return self._text

    @property
    def length(self) -> int:
        """``len(self.text)``, without joining the text."""
        return self._length

    def slice(self, start: int, end: int) -> str:
        """``self.text[start:end]`` (0 <= start <= end), without joining the text."""
        if self._text is not None:
            return self._text[start:end]
        pieces, heads = self._pieces, self._heads
        first = max(0, bisect.bisect_right(heads, start) - 1)
        out = []
        for number in range(first, len(pieces)):
            head = heads[number]
            if head >= end:
                break
            out.append(pieces[number][max(0, start - head):end - head])
        return "".join(out)

    def _build(self) -> None:
        if self._blocks is None:
            text, at = self.text, 0
            starts = starts_array((0,), self._length)
            while at < self._length:  # in pieces: the ints of one piece alive at a time
                found, at = scan_line_starts(text, at, BUILD_PIECE_CHARS)
                starts.extend(found)
            self.set_line_starts(starts)

    def set_line_starts(self, flat: Sequence[int]) -> None:
        """Take line starts computed elsewhere (``scan_line_starts``, in steps) for this text;
        an array made by ``starts_array(..., len(text))`` is cut into blocks with no conversion."""
        size = self._length
        typecode = starts_array((), size).typecode
        if isinstance(flat, array) and flat.typecode == typecode:
            blocks = [flat[at:at + LINES_PER_BLOCK] for at in range(0, len(flat), LINES_PER_BLOCK)]
        else:  # converting each start to another machine type goes through an int object each
            blocks = [starts_array(flat[at:at + LINES_PER_BLOCK], size) for at in range(0, len(flat), LINES_PER_BLOCK)]
        self._set(blocks, [0] * len(blocks))

    def _set(self, blocks: list[array], shifts: list[int]) -> None:
        self._blocks, self._shifts = blocks, shifts
        first_lines, heads, count = [], [], 0
        for block, shift in zip(blocks, shifts):
            first_lines.append(count)
            heads.append(block[0] + shift)
            count += len(block)
        self._first_lines, self._heads, self._count = first_lines, heads, count

    @property
    def line_starts(self) -> list[int]:
        """Every line's start offset, as a list (built in full on first use and kept: 36 bytes a
        line; prefer ``line_start``)."""
        if self._flat is None:
            self._build()
            self._flat = [start + shift for block, shift in zip(self._blocks, self._shifts) for start in block]
        return self._flat

    @property
    def built(self) -> bool:
        """Whether the line starts are computed (an index is built on first use otherwise)."""
        return self._blocks is not None

    @property
    def line_count(self) -> int:
        self._build()
        return self._count

    def nbytes(self) -> int:
        """Bytes the built index holds beyond its text (0 while unbuilt): its blocks' integers."""
        if self._blocks is None:
            return 0
        return sum(len(block) * block.itemsize for block in self._blocks)

    def line_start(self, line: int) -> int:
        """Start offset of ``line`` (0 <= line < line_count)."""
        self._build()
        number = bisect.bisect_right(self._first_lines, line) - 1
        return self._blocks[number][line - self._first_lines[number]] + self._shifts[number]

    def line_of(self, offset: int) -> int:
        """The line holding ``offset``: the last line starting at or before it."""
        self._build()
        number = max(0, bisect.bisect_right(self._heads, offset) - 1)
        block = self._blocks[number]
        return self._first_lines[number] + max(0, bisect.bisect_right(block, offset - self._shifts[number]) - 1)

    def _block_pieces(self) -> list[str]:
        """The text cut at each block's first start (pieces an edited index keeps)."""
        if self._pieces is not None:
            return self._pieces
        return self.cut_blocks(0, len(self._heads))

    @property
    def block_count(self) -> int:
        """Blocks of line starts (0 while unbuilt): ``cut_blocks`` takes them in ranges."""
        return len(self._blocks) if self._blocks is not None else 0

    @property
    def in_pieces(self) -> bool:
        """Whether the text is held as one piece per block (edited, not joined since)."""
        return self._pieces is not None

    def cut_blocks(self, first: int, last: int) -> list[str]:
        """The text of blocks ``first`` to ``last`` (excluded), one piece each (built index)."""
        if self._pieces is not None:
            return self._pieces[first:last]
        text, heads = self._text, self._heads
        ends = heads[first + 1:last + 1] + ([self._length] if last >= len(heads) else [])
        return [text[head:end] for head, end in zip(heads[first:last], ends)]

    def with_pieces(self, pieces: list[str]) -> TextIndex:
        """This index, its text held as ``pieces`` (every block's ``cut_blocks``), not joined: a
        large text cut in steps before an edit, which then copies none of it."""
        out = copy.copy(self)
        out._text, out._pieces = None, pieces
        return out

    def replace(self, start: int, end: int, new_text: str) -> TextIndex:
        """The index of ``text[:start] + new_text + text[end:]``, from this one."""
        if self._blocks is None:  # never needed here: let the new one build lazily too
            text = self.text
            return type(self)(text[:start] + new_text + text[end:])
        # Rescan from the start of the line holding start-1 (a "\r" just before the edit may pair
        # with a "\n" the edit inserts) to the first line start after end+1 (a "\r" the edit leaves
        # at its end may pair with a following "\n"); the edit cannot move either.
        first = self.line_of(start - 1) if start > 0 else 0
        after = self.line_of(end + 1) + 1  # the first line starting after end + 1
        delta = len(new_text) - (end - start)
        # Rebuild the blocks from the one holding `first` to the one holding `after` (or the
        # last), with their text; later blocks keep their starts and text and move by delta.
        low = bisect.bisect_right(self._first_lines, first) - 1
        high = bisect.bisect_right(self._first_lines, min(after, self._count - 1)) - 1
        pieces = self._block_pieces()
        region_at = self._heads[low]  # the rebuilt text, from region_at in the edited text
        old_region = "".join(pieces[low:high + 1])
        region = old_region[:start - region_at] + new_text + old_region[end - region_at:]
        scan_from = self.line_start(first) - region_at
        if after < self._count:
            scan_to = self.line_start(after) + delta - region_at
            rescanned = [m.end() + region_at for m in LINE_BREAK.finditer(region, scan_from, scan_to)
                         if m.end() < scan_to]
        else:
            rescanned = [m.end() + region_at for m in LINE_BREAK.finditer(region, scan_from)]
        base = self._first_lines[low]
        chunk = [s + self._shifts[b] for b in range(low, high + 1) for s in self._blocks[b]]
        kept_after = [s + delta for s in chunk[after - base:]] if after - base < len(chunk) else []
        chunk = chunk[:first - base + 1] + rescanned + kept_after
        size = self._length + delta
        rebuilt = [starts_array(chunk[at:at + LINES_PER_BLOCK], size) for at in range(0, len(chunk), LINES_PER_BLOCK)]
        cuts = [block[0] - region_at for block in rebuilt] + [len(region)]
        rebuilt_pieces = [region[cuts[n]:cuts[n + 1]] for n in range(len(rebuilt))]
        # Kept blocks hold starts below the old text's length, which their type already holds.
        out = type(self)("")
        out._text, out._length = None, size
        out._pieces = pieces[:low] + rebuilt_pieces + pieces[high + 1:]
        out._blocks = self._blocks[:low] + rebuilt + self._blocks[high + 1:]
        out._shifts = self._shifts[:low] + [0] * len(rebuilt) + [shift + delta for shift in self._shifts[high + 1:]]
        # Each block's first line and first start: those before the edit stay, the rebuilt ones
        # are counted, the later ones move by the lines and characters the edit added.
        first_lines, heads = self._first_lines[:low], self._heads[:low]
        line = base
        for block in rebuilt:
            first_lines.append(line)
            heads.append(block[0])
            line += len(block)
        old_end = self._first_lines[high + 1] if high + 1 < len(self._blocks) else self._count
        lines_added = line - old_end
        first_lines += [first + lines_added for first in self._first_lines[high + 1:]]
        heads += [head + delta for head in self._heads[high + 1:]]
        out._first_lines, out._heads, out._count = first_lines, heads, self._count + lines_added
        return out

    def line_end(self, line: int) -> int:
        """Offset of the end of ``line``'s content (before its line break)."""
        if line + 1 >= self.line_count:
            return self._length
        end = self.line_start(line + 1)
        if self.slice(end - 1, end) == "\n":
            end -= 1
            if end > self.line_start(line) and self.slice(end - 1, end) == "\r":
                end -= 1
        else:  # a lone \r
            end -= 1
        return end

    def line_text(self, line: int) -> str:
        return self.slice(self.line_start(line), self.line_end(line))

    def offset(self, line: int, character: int, encoding: str = DEFAULT_ENCODING) -> int:
        """Code-point offset of an LSP position, clamped into the document."""
        if line < 0:
            return 0
        if line >= self.line_count:
            return self._length
        content = self.line_text(line)
        return self.line_start(line) + chars_for_units(content, max(character, 0), encoding)

    def position(self, offset: int, encoding: str = DEFAULT_ENCODING) -> tuple[int, int]:
        """(line, character in ``encoding`` units) of a code-point offset."""
        offset = max(0, min(offset, self._length))
        line = self.line_of(offset)
        start = self.line_start(line)
        # An offset between \r and \n belongs to the end of the line's content.
        column_text = self.slice(start, min(offset, self.line_end(line)))
        return line, units(column_text, encoding)


def scan_line_starts(text: str, begin: int, chunk: int) -> tuple[list[int], int]:
    """Line starts after ``begin`` in about ``chunk`` characters of ``text``, and where to go on.

    Ends just after a "\n" (or at the end), so a "\r\n" is never cut in two: callers can build
    an index of a huge text in short steps, yielding between them."""
    stop = text.find("\n", begin + chunk) + 1 if begin + chunk < len(text) else len(text)
    if stop <= 0:
        stop = len(text)
    return line_starts_between(text, begin, stop), stop


def line_starts_between(text: str, begin: int, stop: int) -> list[int]:
    """The line starts after ``begin`` up to ``stop`` (``stop`` included, when a line starts
    there). Without "\r" the lines' lengths are summed at C speed (split, len, accumulate):
    a match object per line made the regex scan several times slower on code (docs/reliability.md)."""
    if text.find("\r", begin, stop) >= 0:
        return [match.end() for match in LINE_BREAK.finditer(text, begin, stop)]
    lines = text[begin:stop].split("\n")
    lines.pop()  # what follows the last "\n" starts no further line here
    return list(accumulate(map((1).__add__, map(len, lines)), initial=begin))[1:]


def offset_at(text: str, line: int, character: int, encoding: str = DEFAULT_ENCODING) -> int:
    return TextIndex(text).offset(line, character, encoding)


def position_at(text: str, offset: int, encoding: str = DEFAULT_ENCODING) -> tuple[int, int]:
    return TextIndex(text).position(offset, encoding)
