"""Suggestion rules: where a completion stops being what a person would accept.

The one copy of these rules, pure functions on text, shared by the engine and specd-lsp, so both
cut a suggestion in the same place. The engine's ``StopRules`` reads them token by token (so
generation stops as soon as a boundary is known, and every client gets the same one) and once
more at the end on the finished text; specd-lsp applies the block end and the suffix line to
what it shows. This module imports nothing of specd and nothing outside the standard library:
the engine, the daemon and specd-lsp may all import it.

Each rule finds the first place it ends the completion, as a character offset into the
completion's text (the text after the cursor); the earliest of the enabled rules wins:

- ``repeated_line``: a line that repeats the line before it, or one of the last few
  (``REPEAT_WINDOW``) lines of the suggestion, or a line that loops within itself (a piece of
  text holding a word, written ``LOOP_COPIES`` or more times back to back over at least
  ``LOOP_SPAN`` characters, as ``DEBUG_ON_DEBUG_ON_DEBUG_ON_...``): a model at the end of what it
  knows loops;
- ``suffix_line``: a line that equals the next non-empty line after the cursor's line: the
  suggestion has reached code that is already there;
- ``block_end``: the first line indented less than the cursor's line leaves the enclosing
  block; when the cursor's line opens a block (ends in ``:``, ``{``, ``(``, ``[``) the
  suggestion is that block's body, so a line back at the cursor's indentation ends it too
  (a closing bracket there is kept: it closes the block);
- ``current_line``: several lines only where a person expects a block: after a line ending in
  an opener (the line before the cursor's, or the cursor's line as the suggestion completes
  it), or on an empty line inside a body (only indentation around the cursor, indented);
  elsewhere the suggestion is the current line (cut once a later line has text: a suggestion
  that ends on a line break keeps it).

A rule judges a line once it is complete (a line break follows it, or generation ended), so a
boundary never depends on tokens not yet generated; a loop within a line is judged while the line
is written (more text cannot undo it), so generation stops there instead of looping on to its
token limit. Lines are compared stripped of their
indentation; lines of punctuation alone (``}``, ``)``, ``];``) never count as repeats, since
closers legitimately follow each other. Cuts drop the line break before the boundary and any
blank lines before it, so the suggestion ends on its last kept line's text. Indentation is
measured in columns, a tab advancing to the next multiple of ``TAB_WIDTH``.

Line breaks: ``foreign_break`` finds a break of another style than the document's (a ``\r`` in an
LF document, a lone ``\n`` in a CRLF one); the engine ends a completion there, and token healing
never lets a token run into one.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, replace

TAB_WIDTH = 8
REPEAT_WINDOW = 4  # earlier lines of the suggestion a new line is compared with
# A line loops where one piece of it (3-64 characters) is written at least LOOP_COPIES times back to
# back, those copies together at least LOOP_SPAN characters long and the piece holding a word of
# two letters or more: data a person writes out (``[None, None, None]``, ``0x00, 0x00, ...``,
# ``"=" * 40``) is left alone.
LOOP_COPIES = 4
LOOP_SPAN = 40
_LOOP = re.compile(r"(.{3,64}?)\1{%d,}" % (LOOP_COPIES - 1))
_LETTERS = re.compile(r"[^\W\d]{2}")  # two letters (or underscores) in a row: a word, not a number
BRACKETS = {"(": ")", "[": "]", "{": "}"}  # opener: its closer
BLOCK_OPENERS = (":", *BRACKETS)  # a line ending in one of these opens a block
CLOSERS = "".join(BRACKETS.values())
MULTILINE_MODES = ("blocks", "always")  # blocks: several lines only where a block is expected
RULES = ("repeated_line", "suffix_line", "block_end", "current_line")
WORD = re.compile(r"\w")
_CRLF_FOREIGN = re.compile(r"(?<!\r)\n|\r(?=[^\n])")  # in a CRLF text: a lone \n, or a \r not before \n


def indent_width(whitespace: str) -> int:
    return len(whitespace.expandtabs(TAB_WIDTH))


def _indent_of(line: str) -> str:
    return line[: len(line) - len(line.lstrip(" \t"))]


def foreign_break(text: str, newline: str, start: int = 0) -> int:
    """Index of the first line break at or after ``start`` that is not of the document's style
    (``newline``: "\n" or "\r\n"); -1 when there is none. A CRLF text's final "\r" is not judged:
    its "\n" may come with the next token."""
    if newline == "\n":
        return text.find("\r", start)
    found = _CRLF_FOREIGN.search(text, start)
    return found.start() if found else -1


@dataclass(frozen=True)
class Surroundings:
    """What the rules read of the document around the cursor."""

    line_prefix: str = ""  # the cursor's line before the cursor
    line_suffix: str = ""  # the cursor's line after the cursor
    previous_line: str = ""  # the last non-blank line before the cursor's line
    next_line: str = ""  # the first non-blank line after the cursor's line, stripped

    @property
    def indent(self) -> str:
        return _indent_of(self.line_prefix)


def _line_end(text: str, start: int) -> int:
    """Where the line from ``start`` ends: its line break, or the text's end."""
    ends = [at for at in (text.find("\n", start), text.find("\r", start)) if at >= 0]
    return min(ends) if ends else len(text)


def surroundings(text: str, offset: int) -> Surroundings:
    """The cursor's surroundings in ``text`` (line breaks of any style). Reads only the lines
    it needs, so a long document costs no more than a short one."""
    line_start = max(text.rfind("\n", 0, offset), text.rfind("\r", 0, offset)) + 1
    line_end = _line_end(text, offset)
    previous, end = "", line_start
    while end > 0 and not previous:
        end -= 2 if text[end - 2:end] == "\r\n" else 1  # the break before the line
        start = max(text.rfind("\n", 0, end), text.rfind("\r", 0, end)) + 1
        previous = text[start:end] if text[start:end].strip() else ""
        end = start
    following, start = "", line_end
    while start < len(text) and not following:
        start += 2 if text[start:start + 2] == "\r\n" else 1
        end = _line_end(text, start)
        following, start = text[start:end].strip(), end
    return Surroundings(text[line_start:offset], text[offset:line_end], previous, following)


@dataclass(frozen=True)
class BoundaryRules:
    """Which boundaries apply (``engine.stop_at_*`` and ``engine.multiline``, or a request's own)."""

    repeated_line: bool = True
    suffix_line: bool = True
    block_end: bool = True
    multiline: str = "blocks"  # blocks | always

    @classmethod
    def none(cls) -> "BoundaryRules":
        return cls(False, False, False, "always")

    def only(self, rule: str) -> "BoundaryRules":
        """Every rule off but ``rule`` (one of ``RULES``), which stays as set here."""
        setting = "multiline" if rule == "current_line" else rule
        return replace(BoundaryRules.none(), **{setting: getattr(self, setting)})

    def enabled(self, rule: str) -> bool:
        return self.multiline == "blocks" if rule == "current_line" else getattr(self, rule)


@dataclass(frozen=True)
class Line:
    start: int  # offset of the line's first character in the completion
    end: int  # offset of its line break (or the text's end)
    complete: bool  # a line break follows it

    def text(self, completion: str) -> str:
        return completion[self.start:self.end].rstrip("\r")


def lines_of(completion: str, finished: bool) -> list[Line]:
    """The completion's lines; the last one is complete only when generation ``finished``."""
    out, start = [], 0
    while True:
        brk = completion.find("\n", start)
        if brk < 0:
            out.append(Line(start, len(completion), finished))
            return out
        out.append(Line(start, brk, True))
        start = brk + 1


def _cut_before(completion: str, line: Line) -> int:
    """The offset that ends the completion just before ``line``: its line break and the blank
    lines before it go too."""
    return len(completion[: line.start].rstrip(" \t\r\n"))


def _counts(line: str) -> bool:
    """Whether a line may count as a repeat: it holds a word, not only closers and punctuation."""
    return bool(WORD.search(line))


@functools.lru_cache(maxsize=1024)
def loops(text: str) -> bool:
    """Whether ``text`` (a line) holds a loop: a piece written ``LOOP_COPIES`` times back to back
    over at least ``LOOP_SPAN`` characters, the piece holding two letters in a row. Cached: the
    engine asks again of every line of a completion at each new token, and a finished line's
    answer does not change."""
    if len(text) < LOOP_SPAN:
        return False
    start = 0
    while (found := _LOOP.search(text, start)) is not None:
        if found.end() - found.start() >= LOOP_SPAN and _LETTERS.search(found.group(1)):
            return True
        # Past this run: a start inside it repeats a rotation of the same piece (the same
        # characters) over less of the line, so it fails the same way; one pass per line.
        start = found.end()
    return False


def repeated_line(completion: str, around: Surroundings, finished: bool) -> int | None:
    """Where the first line repeating one of the ``REPEAT_WINDOW`` non-blank lines before it
    (in the suggestion, the cursor's line completed by its first), or looping within itself
    (``loops``, judged while it is written), begins."""
    lines = lines_of(completion, finished)
    seen: list[str] = []
    for number, line in enumerate(lines):
        if loops(line.text(completion)):
            return _cut_before(completion, line)
        if not line.complete:
            break
        content = (around.line_prefix + line.text(completion) if number == 0 else line.text(completion)).strip()
        if not content:
            continue
        if number > 0 and _counts(content) and content in seen[-REPEAT_WINDOW:]:
            return _cut_before(completion, line)
        seen.append(content)
    return None


def suffix_line(completion: str, around: Surroundings, finished: bool) -> int | None:
    """Where the first line that equals the suffix's next non-empty line begins (the cursor's
    own line counts when nothing follows the cursor on it)."""
    if not around.next_line:
        return None
    for number, line in enumerate(lines_of(completion, finished)):
        if not line.complete:
            break
        if number == 0:
            if around.line_suffix.strip():
                continue
            content = around.line_prefix + line.text(completion)
        else:
            content = line.text(completion)
        if content.strip() == around.next_line:
            return _cut_before(completion, line) if number > 0 else 0
    return None


def opens_block(line: str) -> bool:
    return line.rstrip().endswith(BLOCK_OPENERS)


def block_end(completion: str, around: Surroundings, finished: bool) -> int | None:
    """Where the suggestion leaves the cursor's block by indentation (a line's indentation is
    known once it has content, so an incomplete line counts once it has some)."""
    lines = lines_of(completion, finished)
    width = indent_width(around.indent)
    first = lines[0]
    body = first.complete and opens_block(around.line_prefix + first.text(completion))
    for number, line in enumerate(lines[1:], start=1):
        text = line.text(completion)
        stripped = text.lstrip(" \t")
        if not stripped:
            continue
        indent = indent_width(text[: len(text) - len(stripped)])
        if indent < width:
            return _cut_before(completion, line)
        if body and indent == width:
            if stripped[0] in CLOSERS:  # the bracket closing the block the cursor's line opened
                if line.complete and completion[line.end:].strip():
                    return _end_of(completion, line)
                continue
            return _cut_before(completion, line)
    return None


def expects_block(completed_line: str, around: Surroundings, on_cursor_line: bool) -> bool:
    """Whether a person expects several lines here: ``completed_line`` is the suggestion's
    first line with text (on the cursor's line, the line's prefix included)."""
    if opens_block(completed_line):
        return True
    if on_cursor_line and around.line_suffix.strip():
        return False  # inside a line: the rest of it is the suggestion
    cursor_line_blank = not around.line_prefix.strip() and not around.line_suffix.strip()
    if opens_block(around.previous_line if cursor_line_blank or on_cursor_line else around.line_prefix):
        return True
    return cursor_line_blank and indent_width(around.indent) > 0  # an empty line inside a body


def _end_of(completion: str, line: Line) -> int:
    """The offset just after ``line``'s text (before its line break)."""
    return line.end - (1 if completion[line.end - 1: line.end] == "\r" else 0)


def current_line(completion: str, around: Surroundings, finished: bool) -> int | None:
    """Where the suggestion's first line with text ends, unless a block is expected there."""
    for number, line in enumerate(lines_of(completion, finished)):
        text = line.text(completion)
        if not text.strip():
            continue
        if not line.complete or not completion[line.end:].strip():
            return None  # not known yet, or no text after it to cut (a model ending on a line break keeps it)
        completed = around.line_prefix + text if number == 0 else text
        return None if expects_block(completed, around, number == 0) else _end_of(completion, line)
    return None


RULE_FUNCTIONS = {"repeated_line": repeated_line, "suffix_line": suffix_line, "block_end": block_end,
                  "current_line": current_line}


def boundary(completion: str, around: Surroundings, rules: BoundaryRules,
             finished: bool = False) -> tuple[int, str] | None:
    """The earliest boundary of the enabled rules in ``completion``: (offset, rule), or None.
    On a tie the rule listed first in ``RULES`` names it."""
    best: tuple[int, str] | None = None
    for rule in RULES:
        if not rules.enabled(rule):
            continue
        at = RULE_FUNCTIONS[rule](completion, around, finished)
        if at is not None and (best is None or at < best[0]):
            best = (at, rule)
    return best


def apply(completion: str, around: Surroundings, rules: BoundaryRules) -> tuple[str, str | None]:
    """A finished completion cut at its earliest boundary: (text, the rule that cut or None)."""
    found = boundary(completion, around, rules, finished=True)
    return (completion, None) if found is None else (completion[: found[0]], found[1])
