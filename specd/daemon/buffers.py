"""Open documents: the store, typed edits applied to them, and cursors resolved in them.

Everything here runs on the daemon's event loop; nothing is shared with the worker thread
except immutable ``str`` snapshots. Documents are ``specd.protocol.documents.Document``, the
model specd-lsp uses too, over an index that refuses positions outside the text. Positions
follow LSP: lines are split at ``\\r\\n``, ``\\r`` or ``\\n``, lines and characters count from
0, a character past the end of its line means the end of the line, and the unit of
``character`` is chosen per request (utf-32 = code points, utf-16 = LSP's default, utf-8 =
bytes as Neovim counts columns). Values come parsed (``params``): nothing here reads a wire map.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Iterable

from specd.daemon.params import ByteCursor, Cursor, Edit, OffsetCursor, RangeEdit, WholeText
from specd.protocol.documents import Document as TextDocument
from specd.protocol.errors import ErrorCode, RpcError
from specd.protocol.positions import TextIndex as SharedTextIndex
from specd.protocol.positions import scan_line_starts, starts_array


def utf8_size(text: str, limit: int) -> int:
    """UTF-8 length of ``text``, computed exactly only when it could be near ``limit``."""
    if len(text) * 4 <= limit or text.isascii():  # isascii: a flag of the str, O(1)
        return len(text)  # surely under the limit, or exact: the text needs no encoding to tell
    return len(text.encode("utf-8", errors="surrogatepass"))


__all__ = ["BufferStore", "Document", "TextIndex", "apply_edit", "apply_edits", "edit_end", "edit_index",
           "document_index", "in_pieces", "index_in_steps", "locate", "text_bytes", "utf8_size", "yield_turns"]


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
        if offset < 0 or offset > self.length:
            raise RpcError(ErrorCode.OUT_OF_RANGE, f"offset {offset} outside the document (0..{self.length})")
        return offset


# Texts above this many characters get their line index built in steps (``index_in_steps``),
# the event loop serving others between them; below it, building at once costs one step. The
# index is otherwise built on first use, which would stall the loop for the first edit of a
# change to a large text.
INDEX_STEP_CHARS = 64 * 1024  # characters scanned in one step (under a millisecond of code: docs/reliability.md)
STEPWISE_INDEX_CHARS = 256 * 1024
# Loop turns given to other connections between two steps of work on a large text: a request
# takes three to be answered (the read, the session's dispatch, the handler), and one more when
# it arrives during a turn. One turn between steps let a ``status`` wait out several steps.
STEP_YIELD_TURNS = 8


async def yield_turns() -> None:
    """Between two steps of work on a large text: ``STEP_YIELD_TURNS`` loop turns for others."""
    for _turn in range(STEP_YIELD_TURNS):
        await asyncio.sleep(0)


async def index_in_steps(text: str, between: Callable[[], Awaitable[None]] = yield_turns) -> TextIndex:
    """The line index of ``text``, built in short steps when the text is large, ``between``
    awaited after each."""
    index = TextIndex(text)
    if len(text) > STEPWISE_INDEX_CHARS:
        starts, at = starts_array((0,), len(text)), 0  # machine integers: a list would hold an int object per line
        while at < len(text):
            found, at = scan_line_starts(text, at, INDEX_STEP_CHARS)
            starts.extend(found)
            await between()
        index.set_line_starts(starts)
    return index


CUT_STEP_BLOCKS = 64  # blocks of a large text cut into pieces in one step (~1 MiB of code)


async def in_pieces(index: TextIndex, between: Callable[[], Awaitable[None]] = yield_turns) -> TextIndex:
    """``index`` with its text cut into one piece per block, in steps when it is large: a ranged
    edit on a whole text cuts it first, one copy of all of it in one go."""
    if index.in_pieces or not index.built or index.length <= STEPWISE_INDEX_CHARS:
        return index
    pieces: list[str] = []
    for first in range(0, index.block_count, CUT_STEP_BLOCKS):
        pieces += index.cut_blocks(first, first + CUT_STEP_BLOCKS)
        await between()
    return index.with_pieces(pieces)


async def document_index(doc: Document, between: Callable[[], Awaitable[None]] = yield_turns) -> TextIndex:
    """``doc``'s line index, built in steps when the text is large and no request has needed it
    yet: an open keeps only the text, and the first ranged edit or line cursor pays for the index."""
    index = doc.index
    if not index.built and len(index.text) > STEPWISE_INDEX_CHARS:
        index = await index_in_steps(doc.text, between)
        if index.text is doc.text:  # (callers hold the document's lock: always)
            doc.set_index(index)
    return index


def locate(index: TextIndex, cursor: Cursor) -> int:
    """The code-point offset of ``cursor`` in ``index.text``; ``out_of_range`` outside it."""
    if isinstance(cursor, OffsetCursor):
        return index.char_offset(cursor.offset)
    if isinstance(cursor, ByteCursor):
        return index.byte_offset_to_char(cursor.byte_offset)
    return index.offset(cursor.line, cursor.character, cursor.encoding)


@dataclass
class Document(TextDocument):
    """An open document (the shared model) and the connections that hold it open."""

    owners: set[int] = field(default_factory=set)  # connection ids that opened it

    index_type = TextIndex


def apply_edit(index: TextIndex, edit: Edit, number: int = 0) -> TextIndex:
    """The index of the text after ``edit`` (``edits[number]`` in messages).

    The line index is carried from edit to edit (``TextIndex.replace`` rescans only what an
    edit touched), so many ranged edits on a large file cost as many small rescans and string
    splices, not as many scans of the whole text."""
    if isinstance(edit, WholeText):
        return TextIndex(edit.text)
    if isinstance(edit, RangeEdit):
        start, end = locate(index, edit.start), locate(index, edit.end)
    else:
        start, end = edit.start, edit.end
        for value in (start, end):
            if value < 0 or value > index.length:
                raise RpcError(ErrorCode.OUT_OF_RANGE, f"edits[{number}]: offset {value} outside the document (0..{index.length})")
    if start > end:
        raise RpcError(ErrorCode.OUT_OF_RANGE, f"edits[{number}]: start {start} is after end {end}")
    return index.replace(start, end, edit.text)


def edit_index(index: TextIndex, edits: Iterable[Edit]) -> TextIndex:
    """Apply edits in order, each to the result of the one before (LSP's contentChanges)."""
    for number, edit in enumerate(edits):
        index = apply_edit(index, edit, number)
    return index


def apply_edits(text: str, edits: Iterable[Edit]) -> str:
    return edit_index(TextIndex(text), edits).text


def edit_end(index: TextIndex, edit: Edit) -> int | None:
    """Offset in ``index.text`` (the text after ``edit``, the last of a change) just after the
    edit's new text: where the cursor is when a user types. None when it replaced the whole
    text. The text before an edit's start is the same before and after it, so its start
    resolves against the final text."""
    if isinstance(edit, WholeText):
        return None
    start = locate(index, edit.start) if isinstance(edit, RangeEdit) else edit.start
    end = start + len(edit.text)
    return end if 0 <= end <= index.length else None


def text_bytes(text: str) -> int:
    """The exact UTF-8 length of ``text`` (an ASCII text's is its length, known at once)."""
    return len(text) if text.isascii() else len(text.encode("utf-8", errors="surrogatepass"))


class BufferStore:
    """The documents editors have open, bounded in count, in size each, and in bytes together:
    all open documents' UTF-8 bytes at most ``max_open_bytes``, and each connection's at most
    ``max_open_bytes_per_connection`` (a document counts in full for every connection holding
    it open). A request that would go over is refused whole: nothing held changes."""

    def __init__(self, max_documents: int, max_document_bytes: int, max_open_bytes: int | None = None,
                 max_open_bytes_per_connection: int | None = None):
        self.max_documents = max_documents
        self.max_document_bytes = max_document_bytes
        self.max_open_bytes = max_open_bytes if max_open_bytes is not None else max_documents * max_document_bytes
        self.max_open_bytes_per_connection = (max_open_bytes_per_connection if max_open_bytes_per_connection is not None
                                              else self.max_open_bytes)
        self.docs: dict[str, Document] = {}
        self.sizes: dict[str, int] = {}  # uri -> its text's UTF-8 bytes
        self.open_bytes = 0  # sum of ``sizes``
        self.owner_bytes: dict[int, int] = {}  # connection id -> bytes of the documents it holds open

    def __len__(self) -> int:
        return len(self.docs)

    def texts(self) -> dict[str, str]:
        """Every open document's text, by URI."""
        return {uri: doc.text for uri, doc in self.docs.items()}

    def total_chars(self) -> int:
        return sum(len(doc.text) for doc in self.docs.values())

    def check_size(self, text: str, what: str) -> None:
        size = utf8_size(text, self.max_document_bytes)
        if size > self.max_document_bytes:
            raise self._too_large(what, size)

    def _too_large(self, what: str, size: int) -> RpcError:
        return RpcError(
            ErrorCode.DOCUMENT_TOO_LARGE,
            f"{what} is {size} bytes, over the limit of {self.max_document_bytes} (daemon.max_document_bytes)",
            {"bytes": size, "limit": self.max_document_bytes},
        )

    def measure(self, uri: str, text: str, owner: int) -> int:
        """``text``'s UTF-8 bytes, once it is known that ``owner`` may hold it open as ``uri``
        (each document's size, and the budgets): ``document_too_large`` or
        ``too_many_document_bytes`` otherwise."""
        self.check_size(text, uri)
        size = text_bytes(text)
        self.check_budget(uri, size, {owner})
        return size

    def check_budget(self, uri: str, size: int, adding: set[int] = frozenset()) -> None:
        """Refuse ``uri`` holding ``size`` bytes (held by its owners and those in ``adding``)
        when that takes the open documents, or a connection's, over its byte budget."""
        held = self.sizes.get(uri, 0)
        total = self.open_bytes - held + size
        if total > self.max_open_bytes:
            raise self._over_budget(uri, size, total, self.max_open_bytes, "daemon.max_open_bytes",
                                    "the open documents")
        doc = self.docs.get(uri)
        owners = doc.owners if doc is not None else set()
        for owner in owners | adding:
            mine = self.owner_bytes.get(owner, 0) - (held if owner in owners else 0) + size
            if mine > self.max_open_bytes_per_connection:
                raise self._over_budget(uri, size, mine, self.max_open_bytes_per_connection,
                                        "daemon.max_open_bytes_per_connection", "a connection's open documents")

    @staticmethod
    def _over_budget(uri: str, size: int, total: int, limit: int, key: str, whose: str) -> RpcError:
        return RpcError(
            ErrorCode.TOO_MANY_DOCUMENT_BYTES,
            f"{uri} ({size} bytes) would bring {whose} to {total} bytes, over the limit of {limit} ({key}); "
            "close some first",
            {"bytes": size, "total": total, "limit": limit},
        )

    def get(self, uri: str) -> Document:
        doc = self.docs.get(uri)
        if doc is None:
            raise RpcError(ErrorCode.UNKNOWN_DOCUMENT, f"document {uri!r} is not open")
        return doc

    def open(self, uri: str, text: str, version: int, owner: int, language: str | None = None,
             index: TextIndex | None = None, size: int | None = None) -> Document:
        """Open (or reopen, replacing text and version) a document; ``index``: ``text``'s line
        index, when built already; ``size``: its UTF-8 bytes, when measured already."""
        if size is None:
            size = self.measure(uri, text, owner)
        else:
            self.check_budget(uri, size, {owner})  # the budgets may have moved since it was measured
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
        if index is not None and index.text is text:
            doc.set_index(index)
        self._resize(doc, size)
        if owner not in doc.owners:
            doc.owners.add(owner)
            self.owner_bytes[owner] = self.owner_bytes.get(owner, 0) + size
        return doc

    def _resize(self, doc: Document, size: int) -> None:
        """Account ``doc`` (open, owners unchanged) as holding ``size`` bytes now."""
        delta = size - self.sizes.get(doc.uri, 0)
        self.sizes[doc.uri] = size
        self.open_bytes += delta
        for owner in doc.owners:
            self.owner_bytes[owner] += delta

    def change(self, uri: str, version: int | None, edits: Iterable[Edit] | None, text: str | None) -> Document:
        """Apply a full text or edits atomically: on any error the document is unchanged."""
        doc = self.changeable(uri, version)
        index = TextIndex(text) if text is not None else edit_index(doc.index, edits or [])
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
        """Make ``index`` (edits applied to ``doc``'s text) the document's text, if within the limits."""
        if self.docs.get(doc.uri) is not doc:
            raise RpcError(ErrorCode.UNKNOWN_DOCUMENT, f"document {doc.uri!r} was closed while it was being changed")
        self.check_size(index.text, doc.uri)
        size = text_bytes(index.text)
        self.check_budget(doc.uri, size)
        doc.set_index(index)
        self._resize(doc, size)
        doc.version = version if version is not None else doc.version + 1
        return doc

    def close(self, uri: str, owner: int) -> bool:
        """Drop ``owner``'s hold on ``uri``; return True when the document is gone."""
        return self._let_go(self.get(uri), owner)

    def _let_go(self, doc: Document, owner: int) -> bool:
        if owner in doc.owners:
            doc.owners.discard(owner)
            left = self.owner_bytes.get(owner, 0) - self.sizes[doc.uri]
            if left > 0:
                self.owner_bytes[owner] = left
            else:
                self.owner_bytes.pop(owner, None)
        if doc.owners:
            return False
        del self.docs[doc.uri]
        self.open_bytes -= self.sizes.pop(doc.uri)
        return True

    def release_owner(self, owner: int) -> list[str]:
        """A connection went away: close what only it held. Returns the closed URIs."""
        return [uri for uri, doc in list(self.docs.items()) if owner in doc.owners and self._let_go(doc, owner)]

    def stats(self, owner: int | None = None) -> dict[str, int]:
        """What ``status`` reports: counts, characters, bytes against the budgets."""
        out = {"open": len(self.docs), "chars": self.total_chars(), "bytes": self.open_bytes,
               "max_bytes": self.max_open_bytes, "max_bytes_per_connection": self.max_open_bytes_per_connection}
        if owner is not None:
            out["connection_bytes"] = self.owner_bytes.get(owner, 0)
        return out
