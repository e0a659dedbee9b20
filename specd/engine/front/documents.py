"""The engine's own copy of each open document: its text and version, where its last edit ended
(what idle time prefills for) and where its last anchored prompt's prefix ended.

The daemon keeps the editor's documents with their position indexes (``specd.protocol``); the
engine keeps this copy because its worker thread builds prompts while the daemon's loop applies
edits, and a prompt must see one whole text, never one half-applied. Thread-safe: every method
takes the store's lock for as long as it touches the maps.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from specd.engine.front.corpus import common_affixes


def edit_end(old: str, new: str) -> int:
    """Offset in ``new`` just after the text an edit changed."""
    return len(new) - common_affixes(old, new)[1]


@dataclass
class Document:
    text: str
    version: int = 0
    updated: float = field(default_factory=time.monotonic)


class Documents:
    """Open documents by URI. ``track_edits``: remember where each edit ended, most recent last,
    for ``pop_edited`` (the local engine's idle prefill; the remote engine has none)."""

    def __init__(self, track_edits: bool = True):
        self.track_edits = track_edits
        self._lock = threading.Lock()
        self._docs: dict[str, Document] = {}
        self._edited: OrderedDict[str, int] = OrderedDict()  # uri -> where its last edit ended
        self._anchors: dict[str, int] = {}  # uri -> where its last anchored prompt's prefix ended

    def __len__(self) -> int:
        with self._lock:
            return len(self._docs)

    def open(self, uri: str, text: str) -> None:
        with self._lock:
            self._docs[uri] = Document(text)

    def update(self, uri: str, text: str, cursor: int | None = None) -> None:
        """The document's new text; ``cursor``, where the edit left the cursor, when the caller
        knows it (the daemon does, from a ranged change). Without it the edit's end is inferred
        from the two texts, which is ambiguous where the edit repeats the text around it (typing
        a space after a space, Enter before an empty line): idle prefill then warms the cache
        for a cursor a few characters off."""
        with self._lock:
            doc = self._docs.get(uri)
            if doc is None:
                self._docs[uri] = Document(text)
            elif doc.text != text:
                if self.track_edits:
                    known = cursor is not None and 0 <= cursor <= len(text)
                    self._edited[uri] = cursor if known else edit_end(doc.text, text)
                    self._edited.move_to_end(uri)
                doc.text, doc.version, doc.updated = text, doc.version + 1, time.monotonic()

    def close(self, uri: str) -> None:
        with self._lock:
            self._docs.pop(uri, None)
            self._edited.pop(uri, None)
            self._anchors.pop(uri, None)

    def text(self, uri: str) -> str | None:
        with self._lock:
            doc = self._docs.get(uri)
            return doc.text if doc else None

    def texts(self) -> dict[str, str]:
        """uri -> text of every open document, a snapshot."""
        with self._lock:
            return {uri: doc.text for uri, doc in self._docs.items()}

    # -- where the user is typing ---------------------------------------------------------

    def pop_edited(self) -> tuple[str, int, str | None] | None:
        """The most recently edited document: (uri, where its edit ended, its text or None when
        it closed meanwhile), taken off the queue; None when no edit is waiting."""
        with self._lock:
            if not self._edited:
                return None
            uri, offset = self._edited.popitem(last=True)
            doc = self._docs.get(uri)
            return uri, offset, doc.text if doc else None

    def focus(self, uri: str, offset: int) -> bool:
        """The cursor came to rest at ``offset`` of an open document (opened, or jumped to): idle
        prefill warms its cache for a completion there next, as after an edit ending there.
        False where the document is not open here or edits are not tracked."""
        with self._lock:
            doc = self._docs.get(uri)
            if not self.track_edits or doc is None or not 0 <= offset <= len(doc.text):
                return False
            self._edited[uri] = offset
            self._edited.move_to_end(uri)
            return True

    def edited_ago(self, uri: str) -> float | None:
        """Seconds since the document's text last changed (None: not open, or never edited)."""
        with self._lock:
            doc = self._docs.get(uri)
            return None if doc is None or doc.version == 0 else time.monotonic() - doc.updated

    def resume_edited(self, uri: str, offset: int) -> None:
        """Put an edit back for the next slice of idle work, unless a newer edit came meanwhile."""
        with self._lock:
            self._edited.setdefault(uri, offset)

    def edits_waiting(self) -> bool:
        with self._lock:
            return bool(self._edited)

    # -- anchors of the anchored layout ---------------------------------------------------

    def anchor(self, uri: str) -> int | None:
        with self._lock:
            return self._anchors.get(uri)

    def set_anchor(self, uri: str, anchor: int) -> None:
        with self._lock:
            self._anchors[uri] = anchor
