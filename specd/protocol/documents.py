"""One open document: its text, its version and the position index over that text.

The one document model of specd-lsp and the daemon: each keeps its open documents as these
(specd-lsp's ``DocumentStore``, the daemon's ``BufferStore``) and adds only what its side needs
(the LSP's content changes, the daemon's owners). Invariant: ``index.text is text``; the index
is rebuilt lazily when ``text`` is set directly, and carried from edit to edit (only the touched
lines rescanned) when the text changes through ``replace`` or ``set_index``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from specd.protocol.positions import DEFAULT_ENCODING, TextIndex


@dataclass
class Document:
    uri: str
    text: str
    version: int
    language: str | None = None
    _index: TextIndex | None = field(default=None, repr=False, compare=False)

    # The index kind built over the text: the clamping one here, a refusing one in the daemon.
    index_type: ClassVar[type[TextIndex]] = TextIndex

    @property
    def index(self) -> TextIndex:
        if self._index is None or self._index.text is not self.text:
            self._index = self.index_type(self.text)
        return self._index

    def set_index(self, index: TextIndex) -> None:
        """Make ``index.text`` the document's text, with its line index already built."""
        self.text, self._index = index.text, index

    def replace(self, start: int, end: int, new_text: str) -> None:
        """Replace code points ``[start, end)`` with ``new_text``."""
        self.set_index(self.index.replace(start, end, new_text))

    def offset(self, line: int, character: int, encoding: str = DEFAULT_ENCODING) -> int:
        return self.index.offset(line, character, encoding)

    def position(self, offset: int, encoding: str = DEFAULT_ENCODING) -> tuple[int, int]:
        return self.index.position(offset, encoding)
