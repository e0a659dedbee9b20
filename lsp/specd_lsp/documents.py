"""The editor's open documents as specd-lsp holds them, and their edits as the daemon takes them.

specd-lsp keeps its own copy of each document, a mirror of the editor's across the process
boundary (not pygls's workspace, whose line splitting differs from LSP's and the daemon's),
because it needs the text around the cursor for post-processing and the type-through cache; the
document model itself (text, version, position index) is ``specd.protocol.documents``, the
daemon's too. Each LSP content change is applied here first; the same change goes to
the daemon as a code-point ``{start, end, text}`` edit computed on the same text, so both
copies agree whatever the negotiated position encoding.
"""

from __future__ import annotations

from typing import Any

from specd.protocol.documents import Document as TextDocument
from specd_lsp.positions import DEFAULT_ENCODING


class Document(TextDocument):
    """An open document (the shared model) that takes LSP content changes."""

    def apply(self, change: Any, encoding: str = DEFAULT_ENCODING) -> dict[str, Any]:
        """Apply one LSP content change; return it as the daemon's edit (code-point offsets).

        ``change`` has ``text`` and, for a ranged change, ``range`` (lsprotocol objects or
        plain maps). A change without a range replaces the whole text.
        """
        new_text = _get(change, "text")
        rng = _get(change, "range")
        if rng is None:
            self.text = new_text
            return {"text": new_text}
        start = self.offset(_get(_get(rng, "start"), "line"), _get(_get(rng, "start"), "character"), encoding)
        end = self.offset(_get(_get(rng, "end"), "line"), _get(_get(rng, "end"), "character"), encoding)
        if end < start:  # a reversed range: treat as its normal form rather than lose the edit
            start, end = end, start
        # The line index is carried to the new text (only the touched lines rescanned), so a
        # didChange with 1,000 content changes ("replace all") is one pass, not 1,000 scans.
        self.replace(start, end, new_text)
        return {"start": start, "end": end, "text": new_text}


def _get(obj: Any, name: str) -> Any:
    return obj.get(name) if isinstance(obj, dict) else getattr(obj, name, None)


class DocumentStore:
    def __init__(self) -> None:
        self.docs: dict[str, Document] = {}

    def __contains__(self, uri: str) -> bool:
        return uri in self.docs

    def __iter__(self):
        return iter(list(self.docs.values()))

    def __len__(self) -> int:
        return len(self.docs)

    def get(self, uri: str) -> Document | None:
        return self.docs.get(uri)

    def open(self, uri: str, text: str, version: int, language: str | None = None) -> Document:
        doc = self.docs[uri] = Document(uri, text, version, language)
        return doc

    def close(self, uri: str) -> Document | None:
        return self.docs.pop(uri, None)
