"""Post-processing of the daemon's raw completions into what the editor should show.

Pure functions on strings, no LSP and no daemon, so each rule is testable on its own:

- stop at a control character (models trained on bytes emit them; nobody types them into code)
  and drop a trailing U+FFFD (a multi-byte character cut by the token limit);
- on a line that holds only indentation before the cursor (a fresh line the editor indented),
  the editor's indentation wins: the line's whole indentation, the blanks after the cursor
  included, is where the completion's first line starts, and the lines after shift with it;
  blanks after the cursor on such a line are replaced, not pushed behind the suggestion;
- stop at the end of the block (by indentation; ``specd.suggestion_rules``' rule, the engine's,
  judged from the line as the editor's indentation leaves it) and, in single-line mode, at the
  line end;
- keep brackets balanced: a closer that matches nothing opened before it cuts the completion;
- trim the overlap with the text after the cursor (the model often re-types it): the rest of the
  cursor's line, and from the first line that equals the next line after the cursor's
  (``specd.suggestion_rules``' suffix-line rule);
- drop completions that are empty or only repeat the text after the cursor;
- when the rest of the line is only closing brackets, quotes and punctuation (``)``, ``")``,
  ``]);``), the suggestion replaces the rest of the line and carries those closers itself,
  so accepting it leaves exactly one of each.

A streamed completion whose first line is still being written may be shown before that line
ends (``partial_line``): cut back to its last whole word part, and held back while the line could
still become one these rules would cut the whole suggestion at.

Brackets and quotes are tracked by a small language-agnostic scanner (``#`` and ``//`` start
line comments, strings end at their line's end); it is a heuristic, tuned to fail safe by
cutting a suggestion short rather than leaving it unbalanced.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace

from specd.suggestion_rules import BRACKETS, Surroundings, block_end, loops, suffix_line, surroundings

OPENER_OF = {closer: opener for opener, closer in BRACKETS.items()}
QUOTES = "\"'`"
# What the rest of a line may hold for a suggestion to replace it (auto-paired closers and the
# punctuation that usually follows them).
LINE_SUFFIX_CLOSERS = re.compile(r"[\s)\]}\"'`;,:]*")
PUNCTUATION = ";,:"
PREFIX_WINDOW = 4000  # characters before the cursor the bracket scanner looks at
SUFFIX_WINDOW = 2000  # characters after the cursor kept for overlap checks
MIN_PARTIAL_OVERLAP = 3  # a shorter tail matching the start of the suffix may be a coincidence
LINE_BREAK = re.compile(r"\r\n|\r|\n")
CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")
REPLACEMENT = "\ufffd"


@dataclass(frozen=True)
class CursorContext:
    """The text around the cursor: a window before it and a window after it."""

    prefix: str
    suffix: str
    prefix_is_whole: bool = True  # False when the prefix is a window cut out of a longer text

    @property
    def scan_start(self) -> str:
        """The prefix from its first whole line: a window's cut-off first line (maybe inside a
        string) would mislead the bracket scanner. Empty when no line starts in the window."""
        if self.prefix_is_whole:
            return self.prefix
        match = LINE_BREAK.search(self.prefix)
        return self.prefix[match.end():] if match else ""

    @property
    def line_prefix(self) -> str:
        return self.prefix[max(self.prefix.rfind("\n"), self.prefix.rfind("\r")) + 1:]

    @property
    def line_suffix(self) -> str:
        match = LINE_BREAK.search(self.suffix)
        return self.suffix[:match.start()] if match else self.suffix

    @property
    def around(self) -> Surroundings:
        """The cursor's surroundings as the suggestion rules read them."""
        return surroundings(self.prefix + self.suffix, len(self.prefix))


def context_at(text: str, offset: int, before: int = PREFIX_WINDOW, after: int = SUFFIX_WINDOW) -> CursorContext:
    start = max(0, offset - before)
    return CursorContext(text[start:offset], text[offset:offset + after], prefix_is_whole=start == 0)


@dataclass(frozen=True)
class Suggestion:
    """What to show: ``insert_text`` replaces ``replace_chars`` code points after the cursor."""

    insert_text: str
    replace_chars: int = 0
    completion: str = ""  # the completion proper, before any closers were carried into it


# -- brackets --------------------------------------------------------------------------------


@dataclass
class BracketState:
    stack: list[str] = field(default_factory=list)  # open brackets, innermost last
    quote: str | None = None  # the quote of the string we are in, if any
    comment: bool = False


def scan_prefix(text: str) -> BracketState:
    """Bracket state at the end of ``text``; closers that match nothing are ignored."""
    state = BracketState()
    index = 0
    while index < len(text):
        ch = text[index]
        if ch in "\r\n":
            state.quote, state.comment = None, False
        elif state.comment:
            pass
        elif state.quote is not None:
            if ch == "\\":
                index += 1
            elif ch == state.quote:
                state.quote = None
        elif ch in QUOTES:
            state.quote = ch
        elif ch == "#" or text.startswith("//", index):
            state.comment = True
        elif ch in BRACKETS:
            state.stack.append(ch)
        elif ch in OPENER_OF and state.stack and state.stack[-1] == OPENER_OF[ch]:
            state.stack.pop()
        index += 1
    return state


@dataclass(frozen=True)
class Balanced:
    text: str  # the completion, cut before its first closer that matches nothing
    consumed: list[tuple[int, str]]  # (index, char) of closers/quotes that close what the prefix opened


def balance(completion: str, before: BracketState) -> Balanced:
    """Cut ``completion`` at its first unbalanced closer; note which closers close the prefix's."""
    stack = list(before.stack)
    outer = len(stack)  # entries below this index were opened before the cursor
    quote, quote_from_prefix = before.quote, before.quote is not None
    comment = before.comment
    consumed: list[tuple[int, str]] = []
    index = 0
    while index < len(completion):
        ch = completion[index]
        if ch in "\r\n":
            quote, comment, quote_from_prefix = None, False, False
        elif comment:
            pass
        elif quote is not None:
            if ch == "\\":
                index += 1
            elif ch == quote:
                if quote_from_prefix:
                    consumed.append((index, ch))
                quote, quote_from_prefix = None, False
        elif ch in QUOTES:
            quote = ch
        elif ch == "#" or completion.startswith("//", index):
            comment = True
        elif ch in BRACKETS:
            stack.append(ch)
        elif ch in OPENER_OF:
            if not stack or stack[-1] != OPENER_OF[ch]:
                return Balanced(completion[:index], consumed)
            stack.pop()
            if len(stack) < outer:
                outer = len(stack)
                consumed.append((index, ch))
        index += 1
    return Balanced(completion, consumed)


# -- blocks and lines ------------------------------------------------------------------------


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" \t"))


def keep_editor_indent(completion: str, line_prefix: str, after: str = "") -> str:
    """On a fresh indented line, start the completion's first line at the editor's indentation.

    The cursor stands on a line that holds only indentation: at its end (autoindent put it
    there) or inside it (Neovim's normal mode keeps the cursor on the last blank of such a line,
    one column short of its end). ``after`` is the line's whitespace after the cursor, which the
    suggestion replaces ("" at the end). The line's indentation is ``line_prefix + after``: the
    completion's own leading whitespace, as long as ``after``, re-types the part after the
    cursor; more would indent the line twice, less would leave it short. So the first line
    starts with ``after`` and the later lines move by the same amount (left as far as their own
    indentation allows), so the block keeps its shape.
    """
    if not line_prefix or line_prefix.strip(" \t") or after.strip(" \t"):
        return completion
    lines = completion.split("\n")
    own = _indent(lines[0])
    shift = own - len(after)  # > 0: the completion indents deeper than the editor; < 0: shallower
    if shift == 0 and lines[0].startswith(after) or not lines[0].strip():
        return completion
    if shift >= 0:
        later = [line[min(shift, _indent(line)):] for line in lines[1:]]
    else:
        later = [after[own:] + line if line.strip() else line for line in lines[1:]]
    return "\n".join([after + lines[0][own:], *later])


def cut_at_block_end(completion: str, around: Surroundings) -> str:
    """Keep the completion inside the block the cursor is in (the shared rule, by indentation).

    The rule measures from the cursor's line as it will stand: on a line of blanks (or an empty
    one) the completion's first line brings its own indentation (``keep_editor_indent`` has made
    it the editor's), so that indentation is read as the line prefix's.
    """
    lead = ""
    if not around.line_prefix.strip(" \t"):
        first = completion.partition("\n")[0]
        if first.strip():
            lead = first[: _indent(first)]
    at = block_end(completion[len(lead):], replace(around, line_prefix=around.line_prefix + lead), finished=True)
    return completion if at is None else completion[: len(lead) + at]


def first_line(text: str) -> str:
    match = LINE_BREAK.search(text)
    return text[:match.start()] if match else text


def trim_suffix_overlap(completion: str, ctx: CursorContext, around: Surroundings) -> str:
    """Remove what re-types the text after the cursor: the rest of the cursor's line at the
    completion's end, else everything from the first line that equals the suffix's next line."""
    rest = ctx.line_suffix.rstrip()
    if rest:
        for size in range(len(rest), 0, -1):
            if size < len(rest) and size < MIN_PARTIAL_OVERLAP:
                break
            if completion.endswith(rest[:size]):
                return completion[:-size]
    at = suffix_line(completion, around, finished=True)  # whole lines: from the suffix's next line on
    return completion if at is None else completion[:at]


# -- the pipeline ----------------------------------------------------------------------------


def _blank_rest_of_indentation(ctx: CursorContext) -> str:
    """The rest of the cursor's line when the whole line is blanks and the cursor has some
    before it (a line the editor indented, the cursor inside its indentation); else ""."""
    prefix, rest = ctx.line_prefix, ctx.line_suffix
    if prefix and not prefix.strip(" \t") and rest and not rest.strip(" \t"):
        return rest
    return ""



def postprocess(
    raw: str,
    ctx: CursorContext,
    *,
    single_line: bool = False,
    replace_line_suffix: bool = True,
) -> Suggestion | None:
    """Turn a raw completion into a Suggestion, or None when nothing is worth showing."""
    text = raw.replace("\r\n", "\n")
    if (control := CONTROL.search(text)) is not None:
        text = text[:control.start()]
    text = text.rstrip(REPLACEMENT)
    blank_rest = _blank_rest_of_indentation(ctx) if replace_line_suffix else ""
    text = keep_editor_indent(text, ctx.line_prefix, blank_rest)
    if not text.startswith(blank_rest) or not first_line(text).strip():
        blank_rest = ""  # (a completion that starts with a line break leaves the line as it is)
    if single_line:
        text = first_line(text)
    around = ctx.around
    text = cut_at_block_end(text, around)
    balanced = balance(text, scan_prefix(ctx.scan_start))
    text = balanced.text.rstrip()
    consumed = [(index, ch) for index, ch in balanced.consumed if index < len(text)]
    line_suffix = ctx.line_suffix
    if not text.strip():
        return None

    if replace_line_suffix and line_suffix.strip() and LINE_SUFFIX_CLOSERS.fullmatch(line_suffix):
        # The rest of the line is closers the editor auto-inserted: replace it, keeping one of each.
        rest = line_suffix.strip()
        for _, ch in consumed:
            if rest.startswith(ch):
                rest = rest[1:].lstrip()
            else:
                break
        tail = text[consumed[-1][0] + 1:] if consumed else ""
        if tail and not tail.strip(PUNCTUATION) and rest.startswith(tail):
            rest = rest[len(tail):]  # the model typed the trailing ";" itself
        if (text + rest).strip() == line_suffix.strip():
            return None  # it only re-types the closers already there
        return Suggestion(text + rest, len(line_suffix), text)

    text = trim_suffix_overlap(text, ctx, around).rstrip()
    if line_suffix.strip():
        # Mid-line: a closer that closes a bracket the rest of the line closes would double it.
        for index, ch in consumed:
            if index < len(text) and ch in line_suffix:
                text = text[:index].rstrip()
                break
    if not text.strip():
        return None
    if ctx.suffix.lstrip().startswith(text.strip()):
        return None  # it only repeats what follows the cursor
    # On a line of indentation the suggestion replaces the blanks after the cursor (its first
    # line re-types them), so they are not pushed behind its last line.
    return Suggestion(text, len(blank_rest), text)


# -- a line still being written ----------------------------------------------------------------


def _may_become(content: str, line: str) -> bool:
    """Whether a line that starts with ``content`` (stripped on the left) may still end up
    equal to ``line`` (stripped) once it is complete."""
    return bool(line) and line.startswith(content.rstrip())


def whole_word_parts(text: str) -> str:
    """``text`` cut back to before the word part it ends inside, which the next token may go on
    with: a part is a run of letters and digits, ended by any other character (``_`` and ``.``
    included) or by a capital after a small letter (``getConsole|Screen``). So a long
    identifier (snake_case, camelCase) shows part by part as it is written, and never a piece
    of a part (``ret`` of ``return``)."""
    end = len(text)
    while end and text[end - 1].isalnum():
        end -= 1
        if end and text[end].isupper() and text[end - 1].islower():
            break  # the capital starts the part just cut
    return text[:end]


def partial_line(written: str, ctx: CursorContext, *, single_line: bool = False) -> str:
    """What may be shown of a streamed completion that has no complete line with text yet:
    ``written``, the text so far (it ends where a daemon's step ended, so at a token boundary),
    cut back to its last whole word part (``whole_word_parts``), or "" when nothing may be
    shown yet.

    Nothing is shown while the line being written could still complete into a line the rules
    cut the whole suggestion at, so a partial is never withdrawn when its line ends: the
    suffix's next line (``suffix_line``), a line repeating the ones before it in the suggestion
    (``repeated_line``: the cursor's line, when the suggestion starts with a line break, or a line
    looping within itself), or the
    text after the cursor it would only re-type. ``block_end`` and ``current_line`` never cut a
    suggestion's first line with text, and a line indented out of the block is known, and cut
    the same way, as soon as it has text."""
    shown = whole_word_parts(written)
    lines = written.split("\n")
    number, line = len(lines) - 1, lines[-1].rstrip("\r")
    if not shown.strip() or any(earlier.strip() for earlier in lines[:-1]):
        return ""  # no whole word part yet, or a complete line with text (settled: not a partial)
    if loops(line):
        return ""  # a line looping within itself: the engine drops it (``repeated_line``)
    around = ctx.around
    content = (around.line_prefix + line if number == 0 else line).lstrip()
    # what a complete line must not equal (stripped); the cursor's own line counts against the
    # suffix's next line only when nothing follows the cursor on it, as in suffix_line
    avoid = [around.next_line] if number > 0 or not around.line_suffix.strip() else []
    if number > 0:
        avoid.append((around.line_prefix + lines[0]).strip())
    if any(_may_become(content, other) for other in avoid):
        return ""
    after = ctx.suffix.lstrip()
    if after and after.startswith(written.strip()):
        return ""  # it may only re-type what follows the cursor
    if postprocess(shown, ctx, single_line=single_line) is None:
        return ""
    return shown
