"""Streamed completions: an automatic request answered at its first settled line (or, after
``partialLineMs``, with that line while it is being written), the rest arriving into the
type-through cache, and the editor told when the item it shows grew.

``Streams`` keeps, per document, the stream still growing after it answered; ``ask`` starts
one and returns at its first non-empty settled line, or at a partial one once the setting's
wait has passed; ``wait_for_entry`` serves a request that typed all a stream has settled so far
from its next lines rather than a new daemon call.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from specd_lsp.cache import TypeThroughCache
from specd_lsp.completion import context_at, partial_line, postprocess
from specd_lsp.daemon_calls import DaemonCalls
from specd_lsp.documents import DocumentStore
from specd_lsp.options import Settings

CacheKey = tuple[str, int, int]  # a type-through cache entry's key
CacheFound = tuple[CacheKey, list[str]]  # an entry's key and the completions it holds at a cursor


@dataclass(frozen=True)
class Answered:
    """The request a stream answered last, and what the editor was shown for it."""

    generation: int  # the document's request it answered (newer ones supersede it)
    version: int  # the editor's document version then
    offset: int  # the cursor, code points into that version's text
    insert_text: str  # the item shown


@dataclass(eq=False)
class StreamedCompletion:
    """A streamed daemon complete that goes on after its first line answered the editor: its
    settled lines so far (``raw``), the cache entry they feed once the answer went out, and the
    last request it answered, so a growth that changes that item can be told to the editor.

    With ``partial_of`` (the partialLineMs setting on), before its first line with text is
    settled it also keeps ``partial``: what may be shown of the text so far, by that function
    (``completion.partial_line`` at the stream's cursor). Once an answer showed a partial
    (``showing_partial``), the cache entry follows the partial as it grows, then the settled
    lines."""

    uri: str
    text: str  # the text it completes (the editor's, or with a selected item applied)
    offset: int
    partial_of: Callable[[str], str] | None = None  # the text so far to what may be shown of it
    raw: str = ""  # settled lines (the result's text once done)
    tail: str = ""  # the line being written, not settled yet
    partial: str = ""  # what may be shown before the first line settled ("": nothing yet)
    showing_partial: bool = False  # an answer showed ``partial``
    done: bool = False
    failed: bool = False  # it ended without a result (cancelled, superseded, an error)
    key: CacheKey | None = None  # its cache entry, once the answer went out
    answered: Answered | None = None
    task: asyncio.Task[Any] | None = None
    _changed: asyncio.Event = field(default_factory=asyncio.Event, repr=False)

    @property
    def has_first_line(self) -> bool:
        return bool(self.raw.strip())

    @property
    def shown_raw(self) -> str:
        """What an answer shows now: the settled lines; before the first line settled, the
        partial an answer showed, or at the time budget the line being written too."""
        if self.has_first_line or self.done:
            return self.raw
        return self.partial if self.showing_partial else self.raw + self.tail

    def show_partial(self) -> None:
        """The answer shows the partial line: from now on it only grows."""
        self.showing_partial = bool(self.partial)

    def progress(self, params: dict[str, Any]) -> bool:
        """A ``progress`` notification; True when what an answer shows (``shown_raw``) grew."""
        text, tail = params.get("text"), params.get("tail")
        if self.done or not isinstance(text, str) or len(text) < len(self.raw) or not text.startswith(self.raw):
            return False
        before = self.shown_raw
        self.raw, self.tail = text, tail if isinstance(tail, str) else ""
        if self.partial_of is not None and not self.has_first_line:
            partial = self.partial_of(self.raw + self.tail)
            # once shown, a partial only grows: a later one that is held back or no longer
            # extends it leaves it as it is until the line settles
            if not self.showing_partial or (len(partial) > len(self.partial) and partial.startswith(self.partial)):
                self.partial = partial
        self._wake()
        return self.shown_raw != before and bool(self.shown_raw)

    def finish(self, text: str | None) -> bool:
        """The result came (its text), or the call ended without one (None); True when what an
        answer shows changed."""
        before = self.shown_raw
        if isinstance(text, str):
            self.raw = text
        self.done = True
        self._wake()
        return isinstance(text, str) and self.shown_raw != before

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def changed(self, timeout: float | None) -> None:
        """Wait for the next growth or the end (at most ``timeout`` seconds)."""
        if self.done:
            return
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._changed.wait(), timeout)


class Streams:
    def __init__(self, documents: DocumentStore, cache: TypeThroughCache, calls: DaemonCalls,
                 settings: Callable[[], Settings], generation: Callable[[str], int],
                 on_grew: Callable[[str, int, int], None] | None = None):
        self.documents = documents
        self.cache = cache
        self.calls = calls
        self._settings = settings
        self._generation = generation  # a document's newest request (the completer's count)
        self._on_grew = on_grew  # (uri, version, offset): a shown item grew; the editor may ask again
        self._streams: dict[str, StreamedCompletion] = {}  # per document: the stream still growing

    def for_entry(self, uri: str, key: CacheKey) -> StreamedCompletion | None:
        """The document's stream if it feeds the cache entry ``key``."""
        stream = self._streams.get(uri)
        return stream if stream is not None and stream.key == key else None

    async def wait_for_entry(self, uri: str, text: str, offset: int) -> CacheFound | None:
        """When the user typed all a streamed completion has settled so far (accepting its
        first line), its next lines are on the way: wait for them (until the request timeout,
        the stream's end or a newer request) and return the cache entry they make."""
        typed_all = self.cache.match(uri, text, offset)
        stream = self.for_entry(uri, typed_all[0]) if typed_all is not None else None
        deadline = time.monotonic() + self._settings().daemon.request_timeout_ms / 1000
        generation = self._generation(uri)
        found = None
        while stream is not None and not stream.done and self._generation(uri) == generation:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            await stream.changed(left)
            if (found := self.cache.lookup_entry(uri, text, offset)) is not None:
                break
        return found

    async def ask(self, uri: str, text: str, offset: int, version: int, generation: int) -> StreamedCompletion | None:
        """A greedy daemon complete, streamed: back as soon as its first non-empty line is
        settled, or once ``partialLineMs`` passed, as soon as that line is partly written and
        may be shown (``StreamedCompletion.partial``), or at the time budget, with what exists
        then, or at its result; the rest goes on arriving into the cache entry. None when it
        failed or a newer request took over before it answered (its stream is cancelled then:
        it never feeds a later answer)."""
        settings = self._settings()
        partial_of = None
        if settings.partial_line_ms > 0:
            ctx, single_line = context_at(text, offset), settings.single_line
            partial_of = lambda written: partial_line(written, ctx, single_line=single_line)  # noqa: E731
        stream = StreamedCompletion(uri, text, offset, partial_of=partial_of)
        previous = self._streams.get(uri)
        if previous is not None:
            previous.answered = None  # a new request for the document: the old item grows no more
        self._streams[uri] = stream
        stream.task = asyncio.ensure_future(self._run(stream, version, self.calls.options()))
        started = time.monotonic()
        budget_ms = settings.time_budget_ms or settings.daemon.request_timeout_ms
        deadline = started + budget_ms / 1000
        partial_from = started + settings.partial_line_ms / 1000 if partial_of is not None else deadline
        try:
            while not stream.has_first_line and not stream.done and self._generation(uri) == generation:
                now = time.monotonic()
                if now >= partial_from and stream.partial:
                    stream.show_partial()
                    break
                left = (partial_from if now < partial_from else deadline) - now
                if deadline - now <= 0:
                    break
                await stream.changed(min(left, deadline - now))
        except asyncio.CancelledError:
            stream.task.cancel()
            raise
        if self._generation(uri) != generation or stream.failed or not stream.shown_raw:
            if not stream.done:
                stream.task.cancel()
            if self._streams.get(uri) is stream:
                del self._streams[uri]
            return None
        if not stream.done:
            self.calls.stats.streamed += 1
        stream.key = self.cache.put(uri, text, offset, [stream.shown_raw])
        return stream

    async def _run(self, stream: StreamedCompletion, version: int, options: dict[str, Any]) -> None:
        result: dict[str, Any] | None = None
        try:
            result = await self.calls.complete(stream.uri, stream.text, stream.offset, version, options, False,
                                               on_progress=lambda params: self._progress(stream, params))
        finally:
            text = result.get("text") if result is not None else None
            stream.failed = result is None
            if stream.finish(text if isinstance(text, str) else None):
                self._grown(stream)

    def _progress(self, stream: StreamedCompletion, params: dict[str, Any]) -> None:
        if stream.progress(params):
            self._grown(stream)

    def _grown(self, stream: StreamedCompletion) -> None:
        """The stream's text grew: its cache entry holds it now; if that changes the item the
        editor shows for the document's latest request, say so (the editor may ask again and
        get it from the cache)."""
        if stream.key is None or not self.cache.extend(stream.key, [stream.shown_raw]) or stream.answered is None:
            return
        answered = stream.answered
        doc = self.documents.get(stream.uri)
        if self._generation(stream.uri) != answered.generation or doc is None or doc.version != answered.version:
            return  # the editor has moved on: a newer request is served on its own
        found = self.cache.match(stream.uri, doc.text, answered.offset, empty_ok=False)
        if found is None or found[0] != stream.key:
            return
        suggestion = postprocess(found[1][0], context_at(doc.text, answered.offset),
                                 single_line=self._settings().single_line)
        if suggestion is None or suggestion.insert_text == answered.insert_text:
            return
        stream.answered = Answered(answered.generation, answered.version, answered.offset, suggestion.insert_text)
        self.calls.stats.grew += 1
        if self._on_grew is not None:
            self._on_grew(stream.uri, answered.version, answered.offset)

    def forget(self, uri: str) -> None:
        stream = self._streams.pop(uri, None)
        if stream is not None and stream.task is not None:
            stream.task.cancel()
