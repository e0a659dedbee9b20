"""What a completion request is, and what a raw completion shows where, in code points.

A ``CompletionQuery`` is the editor's request (document, cursor, trigger, the selected
completion-list item); a raw completion from the daemon becomes a ``Placement`` (what to insert
over which range of the editor's text) by post-processing, and a shown one a ``Proposal``
(remembered for its accept command). No LSP types: the handlers convert.
"""

from __future__ import annotations

from dataclasses import dataclass

from specd_lsp.completion import CursorContext, postprocess

AUTOMATIC = "automatic"
INVOKED = "invoked"


@dataclass(frozen=True)
class Selected:
    """The editor's selected completion-list item: it replaces [start, end) with ``text``."""

    start: int
    end: int
    text: str


@dataclass(frozen=True)
class CompletionQuery:
    uri: str
    offset: int  # code points into the document's text
    trigger: str = AUTOMATIC
    selected: Selected | None = None


@dataclass(frozen=True)
class Placement:
    """What a raw completion shows: ``insert_text`` over [start, end) of the editor's text."""

    start: int
    end: int
    insert_text: str

    @property
    def shown(self) -> tuple[int, str]:
        """What tells two items apart in the editor (the same start is implied)."""
        return self.end, self.insert_text


@dataclass(frozen=True)
class Proposal:
    """One item: ``insert_text`` replaces [start, end) of ``text`` (the snapshot it was made for)."""

    id: str
    uri: str
    text: str
    start: int
    end: int
    insert_text: str
    cached: bool = False

    def applied(self) -> tuple[str, int]:
        """The text with this proposal inserted, and the cursor after it."""
        text = self.text[:self.start] + self.insert_text + self.text[self.end:]
        return text, self.start + len(self.insert_text)


def place(query: CompletionQuery, ctx: CursorContext, offset: int, raw: str, single_line: bool) -> Placement | None:
    """What ``raw`` shows at ``offset`` (``ctx``: the text around it); None when nothing. With a
    selected item, the item's range and text come first."""
    suggestion = postprocess(raw, ctx, single_line=single_line, replace_line_suffix=query.selected is None)
    if suggestion is None:
        return None
    if query.selected is not None:
        sel = query.selected
        return Placement(sel.start, sel.end, sel.text + suggestion.insert_text)
    return Placement(offset, offset + suggestion.replace_chars, suggestion.insert_text)
