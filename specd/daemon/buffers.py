"""Open documents: text + version, full or ranged edits, and cursor conversion.

Everything here runs on the daemon's event loop; nothing is shared with the worker thread
except immutable ``str`` snapshots. Positions follow LSP: lines are split at ``\\r\\n``, ``\\r``
or ``\\n``, lines and characters count from 0, a character past the end of its line means the
end of the line, and the unit of ``character`` is chosen per request (utf-32 = code points,
utf-16 = LSP's default, utf-8 = bytes as Neovim counts columns).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from specd.daemon.params import check_encoding, check_int, param_error
from specd.protocol.errors import ErrorCode, RpcError
from specd.protocol.positions import LINE_BREAK  # noqa: F401  (re-exported)
from specd.protocol.positions import TextIndex as SharedTextIndex
from specd.protocol.positions import scan_line_starts


def utf8_size(text: str, limit: int) -> int:
    """UTF-8 length of ``text``, computed exactly only when it could be near ``limit``."""
    if len(text) * 4 <= limit:
        return len(text)  # surely under the limit; the exact figure is not needed
    return len(text.encode("utf-8", errors="surrogatepass"))


__all__ = ["BufferStore", "Document", "TextIndex", "apply_edits", "check_encoding", "edit_index", "index_in_steps", "resolve_cursor", "utf8_size"]


class TextIndex(SharedTextIndex):
    """The shared position index (line starts, encodings), refusing out-of-range lines and
    negative characters with ``out_of_range`` instead of clamping them: a socket client that
    sends a bad position gets told. A character past the end of its line still means the end
    of the line, as in LSP."""

    def offset(self, line: int, character: int, encoding: str = "utf-32") -> int:
        """Code-point offset of a (line, character) position."""
        lines = self.line_count
        if line < 0 or line >= lines:
            raise RpcError(ErrorCode.OUT_OF_RANGE, f"line {line} outside the document (0..{lines - 1})")
        if character < 0:
            raise RpcError(ErrorCode.OUT_OF_RANGE, f"character {character} is negative")
        return super().offset(line, character, encoding)

    def position(self, offset: int, encoding: str = "utf-32") -> tuple[int, int]:
        """(line, character) of a code-point offset; characters in code points by default."""
        return super().position(offset, encoding)

    def byte_offset_to_char(self, byte_offset: int) -> int:
        data = self.text.encode("utf-8", errors="surrogatepass")
        if byte_offset < 0 or byte_offset > len(data):
            raise RpcError(ErrorCode.OUT_OF_RANGE, f"byte offset {byte_offset} outside the document (0..{len(data)})")
        return len(data[:byte_offset].decode("utf-8", errors="ignore"))

    def char_offset(self, offset: int) -> int:
        if offset < 0 or offset > len(self.text):
            raise RpcError(ErrorCode.OUT_OF_RANGE, f"offset {offset} outside the document (0..{len(self.text)})")
        return offset


# Texts above this many characters get their line index built in steps (``index_in_steps``),
# the event loop serving others between them; below it, building at once costs one step. (At
# 1 MiB, building at once took 24-36 ms: the first edit of a change stalled the loop that long,
# as the index is otherwise built on first use.)
INDEX_STEP_CHARS = 256 * 1024  # one step: ~6 ms of scanning
STEPWISE_INDEX_CHARS = INDEX_STEP_CHARS


async def index_in_steps(text: str) -> TextIndex:
    """The line index of ``text``, built in short steps when the text is large."""
    index = TextIndex(text)
    if len(text) > STEPWISE_INDEX_CHARS:
        starts, at = [0], 0
        while at < len(text):
            found, at = scan_line_starts(text, at, INDEX_STEP_CHARS)
            starts += found
            await asyncio.sleep(0)
        index.set_line_starts(starts)
    return index


def resolve_cursor(index: TextIndex, cursor: Any, encoding: Any = None) -> int:
    """A cursor in any accepted form -> code-point offset into ``index.text``.

    Accepted: an integer (code-point offset); ``{"offset": n}``; ``{"byte_offset": n}``;
    ``{"line": l, "character": c}`` or ``{"line": l, "col": c}`` with an optional
    ``"encoding"`` (utf-32 default, utf-16, utf-8).
    """
    if isinstance(cursor, int) and not isinstance(cursor, bool):
        return index.char_offset(cursor)
    if not isinstance(cursor, dict):
        raise param_error("cursor must be an integer offset or a map (offset, byte_offset, or line + character)")
    encoding = check_encoding(cursor.get("encoding", encoding))
    if "offset" in cursor:
        return index.char_offset(check_int(cursor["offset"], "cursor.offset"))
    if "byte_offset" in cursor:
        return index.byte_offset_to_char(check_int(cursor["byte_offset"], "cursor.byte_offset"))
    if "line" in cursor:
        character = cursor.get("character", cursor.get("col"))
        if character is None:
            raise param_error("cursor with a line needs a character (or col)")
        return index.offset(check_int(cursor["line"], "cursor.line"), check_int(character, "cursor.character"), encoding)
    raise param_error("cursor needs offset, byte_offset, or line + character")


@dataclass
class Document:
    uri: str
    text: str
    version: int
    language: str | None = None
    owners: set[int] = field(default_factory=set)  # connection ids that opened it
    _index: TextIndex | None = None

    @property
    def index(self) -> TextIndex:
        if self._index is None or self._index.text is not self.text:
            self._index = TextIndex(self.text)
        return self._index


def apply_edits(text: str, edits: list[Any], encoding: str) -> str:
    """Apply edits in order, each to the result of the one before (LSP's contentChanges)."""
    return edit_index(TextIndex(text), edits, encoding).text


def edit_index(index: TextIndex, edits: list[Any], encoding: str, first: int = 0) -> TextIndex:
    """Apply edits in order, each to the result of the one before (LSP's contentChanges).

    One pass: the line index is carried from edit to edit (``TextIndex.replace`` rescans only
    what an edit touched), so 400 ranged edits on a 1 MiB file cost 400 small rescans and
    string splices, not 400 scans of the whole text. ``first`` numbers the edits in messages
    when ``edits`` is a slice of a longer list."""
    text = index.text
    for number, edit in enumerate(edits, first):
        if not isinstance(edit, dict):
            raise param_error(f"edits[{number}] must be a map")
        new_text = edit.get("text")
        if not isinstance(new_text, str):
            raise param_error(f"edits[{number}].text must be a string")
        if "range" in edit:
            rng = edit["range"]
            if not isinstance(rng, dict) or not isinstance(rng.get("start"), dict) or not isinstance(rng.get("end"), dict):
                raise param_error(f"edits[{number}].range must be {{start: {{line, character}}, end: {{line, character}}}}")
            start = resolve_cursor(index, rng["start"], encoding)
            end = resolve_cursor(index, rng["end"], encoding)
        elif "start" in edit or "end" in edit:
            start = check_int(edit.get("start"), f"edits[{number}].start")
            end = check_int(edit.get("end", start), f"edits[{number}].end")
            for value in (start, end):
                if value < 0 or value > len(text):
                    raise RpcError(ErrorCode.OUT_OF_RANGE, f"edits[{number}]: offset {value} outside the document (0..{len(text)})")
        else:  # no range: the whole text
            index = TextIndex(new_text)
            text = new_text
            continue
        if start > end:
            raise RpcError(ErrorCode.OUT_OF_RANGE, f"edits[{number}]: start {start} is after end {end}")
        index = index.replace(start, end, new_text)
        text = index.text
    return index


def last_edit_end(index: TextIndex, edits: list[Any], encoding: str) -> int | None:
    """Offset in ``index.text`` (the text after ``edits``) just after the last edit's new text:
    where the cursor is when a user types. None when the last edit replaced the whole text. The
    text before an edit's start is the same before and after it, so its start resolves against
    the final text."""
    if not edits or not isinstance(edits[-1], dict) or not isinstance(edits[-1].get("text"), str):
        return None
    last = edits[-1]
    if "range" in last:
        start = resolve_cursor(index, last["range"]["start"], encoding)
    elif "start" in last:
        start = last["start"]
    else:
        return None
    end = start + len(last["text"])
    return end if 0 <= end <= len(index.text) else None


class BufferStore:
    """The documents editors have open, bounded in count and size."""

    def __init__(self, max_documents: int, max_document_bytes: int):
        self.max_documents = max_documents
        self.max_document_bytes = max_document_bytes
        self.docs: dict[str, Document] = {}

    def __len__(self) -> int:
        return len(self.docs)

    def total_chars(self) -> int:
        return sum(len(doc.text) for doc in self.docs.values())

    def check_size(self, text: str, what: str) -> None:
        size = utf8_size(text, self.max_document_bytes)
        if size > self.max_document_bytes:
            raise RpcError(
                ErrorCode.DOCUMENT_TOO_LARGE,
                f"{what} is {size} bytes, over the limit of {self.max_document_bytes} (daemon.max_document_bytes)",
                {"bytes": size, "limit": self.max_document_bytes},
            )

    def get(self, uri: str) -> Document:
        doc = self.docs.get(uri)
        if doc is None:
            raise RpcError(ErrorCode.UNKNOWN_DOCUMENT, f"document {uri!r} is not open")
        return doc

    def open(self, uri: str, text: str, version: int, owner: int, language: str | None = None) -> Document:
        """Open (or reopen, replacing text and version) a document."""
        self.check_size(text, uri)
        doc = self.docs.get(uri)
        if doc is None:
            if len(self.docs) >= self.max_documents:
                raise RpcError(
                    ErrorCode.TOO_MANY_DOCUMENTS,
                    f"{len(self.docs)} documents are open, the limit (daemon.max_documents); close one first",
                    {"limit": self.max_documents},
                )
            doc = self.docs[uri] = Document(uri, text, version, language)
        else:
            doc.text, doc.version = text, version
            doc.language = language or doc.language
        doc.owners.add(owner)
        return doc

    def change(self, uri: str, version: int | None, edits: list[Any] | None, text: str | None, encoding: str) -> Document:
        """Apply a full text or ranged edits atomically: on any error the document is unchanged."""
        doc = self.changeable(uri, version)
        index = TextIndex(text) if text is not None else edit_index(doc.index, edits or [], encoding)
        return self.commit(doc, index, version)

    def changeable(self, uri: str, version: int | None) -> Document:
        """The open document ``uri``, when ``version`` may follow its own."""
        doc = self.get(uri)
        if version is not None and version <= doc.version:
            raise RpcError(
                ErrorCode.STALE_VERSION,
                f"version {version} is not newer than the document's {doc.version}",
                {"version": doc.version},
            )
        return doc

    def commit(self, doc: Document, index: TextIndex, version: int | None) -> Document:
        """Make ``index`` (edits applied to ``doc``'s text) the document's text, if within the limit."""
        if self.docs.get(doc.uri) is not doc:
            raise RpcError(ErrorCode.UNKNOWN_DOCUMENT, f"document {doc.uri!r} was closed while it was being changed")
        self.check_size(index.text, doc.uri)
        doc.text, doc._index = index.text, index
        doc.version = version if version is not None else doc.version + 1
        return doc

    def close(self, uri: str, owner: int) -> bool:
        """Drop ``owner``'s hold on ``uri``; return True when the document is gone."""
        doc = self.get(uri)
        doc.owners.discard(owner)
        if doc.owners:
            return False
        del self.docs[uri]
        return True

    def release_owner(self, owner: int) -> list[str]:
        """A connection went away: close what only it held. Returns the closed URIs."""
        closed = []
        for uri, doc in list(self.docs.items()):
            if owner in doc.owners:
                doc.owners.discard(owner)
                if not doc.owners:
                    del self.docs[uri]
                    closed.append(uri)
        return closed
