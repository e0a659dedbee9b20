"""``open``, ``change``, ``close`` and ``focus``: the open buffers, each request on a document
after the ones before it, a long change applied in steps while the loop serves other clients.

After each, the document's latest text goes to the worker's ``DocumentMirror`` (with, after a
ranged change, where its last edit ended: idle prefill warms the cache where the user types).
``focus`` tells it where the editor's cursor came to rest, for idle prefill there.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from typing import Any, AsyncIterator, Callable

from specd.daemon.admission import Connection
from specd.daemon.buffers import (
    STEPWISE_INDEX_CHARS,
    BufferStore,
    TextIndex,
    apply_edit,
    document_index,
    edit_end,
    in_pieces,
    index_in_steps,
    locate,
    yield_turns,
)
from specd.daemon.params import ChangeParams, CloseParams, Edits, FocusParams, LineCursor, OpenParams
from specd.daemon.worker import DocumentMirror

# A change with many edits is applied in steps of about EDIT_STEP_S, the loop serving other
# clients in between (``buffers.yield_turns``: enough turns for a request to be answered). While
# a request waits on a thread (``status`` fetching the engine's figures, or a completion whose
# steps run on the model thread), the loop also sleeps EDIT_PAUSE_S between steps (epoll rounds
# it up to 1 ms; a request arriving ends it early): a sleeping loop lets go of the GIL, a busy
# one makes the thread wait out the interpreter's switch interval each time. The steps of a
# large text's line index and the copies of its whole text are paced the same way.
# docs/reliability.md gives the latencies behind these settings.
EDIT_STEP_S = 0.00025
EDIT_PAUSE_S = 0.0005


class DocumentLocks:
    """One FIFO lock per document in use: a change applied in steps, and the requests after it
    on that document, keep their order (uncontended, an asyncio lock costs nothing). A lock
    lives while some request holds or waits for it."""

    def __init__(self) -> None:
        self._locks: dict[str, tuple[asyncio.Lock, int]] = {}  # uri -> (lock, requests holding or waiting)

    def __len__(self) -> int:
        return len(self._locks)

    @contextlib.asynccontextmanager
    async def hold(self, uri: str) -> AsyncIterator[None]:
        """Hold ``uri`` for one request, after the requests on it that came before."""
        lock, users = self._locks.get(uri) or (asyncio.Lock(), 0)
        self._locks[uri] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            lock, users = self._locks[uri]
            if users == 1:
                del self._locks[uri]
            else:
                self._locks[uri] = (lock, users - 1)


class DocumentMethods:
    def __init__(self, buffers: BufferStore, locks: DocumentLocks, mirror: DocumentMirror, *,
                 on_closed: Callable[[str], None], waiting_on_thread: Callable[[], bool]):
        self.buffers = buffers
        self.locks = locks
        self.mirror = mirror
        self._on_closed = on_closed  # a document is gone: its running complete is moot
        self._waiting_on_thread = waiting_on_thread  # some request waits on a thread (see EDIT_STEP_S)
        self.focus_counts: collections.Counter[str] = collections.Counter()  # received, not_open

    async def open(self, conn: Connection, params: OpenParams, msgid: int | None) -> dict[str, Any]:
        async with self.locks.hold(params.uri):
            # Only the text is kept: its line index waits for the first request that needs one.
            size = self.buffers.measure(params.uri, params.text, conn.id)
            doc = self.buffers.open(params.uri, params.text, params.version, conn.id, params.language, size=size)
        self.mirror.set(params.uri, doc.text, None, conn.id)
        return {"uri": params.uri, "version": doc.version}

    async def change(self, conn: Connection, params: ChangeParams, msgid: int | None) -> dict[str, Any]:
        async with self.locks.hold(params.uri):
            doc = self.buffers.changeable(params.uri, params.version)
            if params.edits is None:
                self.buffers.check_size(params.text, params.uri)
                index = await index_in_steps(params.text, self._serve_others)
            else:
                index = await in_pieces(await document_index(doc, self._serve_others), self._serve_others)
                index = await self._apply_in_steps(index, params.edits)
                if index.length > STEPWISE_INDEX_CHARS:
                    await self._serve_others()  # the commit joins the pieces: a step of its own
            doc = self.buffers.commit(doc, index, params.version)
            cursor = edit_end(index, params.edits[-1]) if params.edits else None
        self.mirror.set(params.uri, doc.text, cursor, conn.id)
        return {"uri": params.uri, "version": doc.version}

    async def _apply_in_steps(self, index: TextIndex, edits: Edits) -> TextIndex:
        loop = asyncio.get_running_loop()
        step_ends = loop.time() + EDIT_STEP_S
        for number in range(len(edits)):
            if loop.time() > step_ends:
                await self._serve_others()
                step_ends = loop.time() + EDIT_STEP_S
            index = apply_edit(index, edits[number], number)
        return index

    async def _serve_others(self) -> None:
        """Between two steps of a long change: a few loop turns for other clients' requests,
        and a short sleep while one of them waits on a thread (see EDIT_STEP_S)."""
        await yield_turns()
        if self._waiting_on_thread():
            await asyncio.sleep(EDIT_PAUSE_S)

    async def focus(self, conn: Connection, params: FocusParams, msgid: int | None) -> dict[str, Any]:
        """The editor's cursor came to rest in an open document: where, for idle prefill there.
        A document not open here is no error (its open may still be on the way): ``focused``
        says whether it was."""
        async with self.locks.hold(params.uri):
            doc = self.buffers.docs.get(params.uri)
            if doc is None:
                self.focus_counts["not_open"] += 1
                return {"uri": params.uri, "focused": False}
            index = await document_index(doc) if isinstance(params.cursor, LineCursor) else doc.index
            offset = locate(index, params.cursor)
        self.focus_counts["received"] += 1
        self.mirror.focus(params.uri, offset)
        return {"uri": params.uri, "focused": True}

    async def close(self, conn: Connection, params: CloseParams, msgid: int | None) -> dict[str, Any]:
        async with self.locks.hold(params.uri):
            closed = self.buffers.close(params.uri, conn.id)
        if closed:
            self.mirror.close(params.uri)
            self._on_closed(params.uri)
        return {"uri": params.uri, "closed": closed}

    def release(self, conn: Connection) -> None:
        """``conn`` went away: close what only it held open."""
        for uri in self.buffers.release_owner(conn.id):
            self.mirror.close(uri)
