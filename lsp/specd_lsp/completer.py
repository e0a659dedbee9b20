"""From "the editor wants a suggestion here" to post-processed proposals, in code points.

The LSP handlers convert positions and types; this module decides what to ask the daemon and
what to show: per-document debounce and supersession, the type-through cache, one greedy
item for automatic triggers and sampled alternatives for invoked ones, selected-completion
info, accept bookkeeping and prefetch after an accept, and which failures the user hears of
(``FailureNotices``). It knows documents and offsets, not LSP types, so a test can drive it
with a fake link.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from specd.protocol.errors import ErrorCode, RpcError

from specd_lsp.cache import TypeThroughCache
from specd_lsp.completion import CursorContext, Suggestion, context_at, postprocess
from specd_lsp.documents import DocumentStore
from specd_lsp.options import Settings

log = logging.getLogger("specd_lsp.completer")

AUTOMATIC = "automatic"
INVOKED = "invoked"
SHOWN_KEPT = 256  # proposals remembered for their accept command
SEED_BASE = 1  # sampled alternatives use seeds 1, 2, ... (not bit for bit repeatable: docs/lsp.md)
EXTRA_DRAWS = 2  # samples drawn past `alternatives` when some would show nothing, or a shown item again

# Completion errors the user is not told of: the request was moot (cancelled, superseded), the
# link mends it by itself (a document the daemon lost is sent again; busy), or the link's own
# state already says it, once per outage (unavailable, connection lost, shutting down).
QUIET_ERRORS = frozenset(code.value for code in (
    ErrorCode.CANCELLED, ErrorCode.UNKNOWN_DOCUMENT, ErrorCode.BUSY, ErrorCode.DAEMON_UNAVAILABLE,
    ErrorCode.CONNECTION_LOST, ErrorCode.SHUTTING_DOWN))
# Reported in ``lastError`` but not shown: a slow answer on a busy machine, or a file kept out
# (it would come back each time the user returns to that file).
UNSHOWN_ERRORS = frozenset(code.value for code in (ErrorCode.TIMEOUT, ErrorCode.DOCUMENT_TOO_LARGE))


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
class Proposal:
    """One item: ``insert_text`` replaces [start, end) of ``text`` (the snapshot it was made for)."""

    id: str
    uri: str
    text: str
    start: int
    end: int
    insert_text: str
    cached: bool = False


class StreamedCompletion:
    """A streamed daemon complete that goes on after its first line answered the editor: its
    settled lines so far (``raw``), the cache entry they feed once the answer went out, and the
    last request it answered (the editor's document version, cursor and what it showed), so a
    growth that changes that item can be told to the editor."""

    def __init__(self, uri: str, text: str, offset: int):
        self.uri, self.text, self.offset = uri, text, offset
        self.raw = ""  # settled lines (the result's text once done)
        self.tail = ""  # the line being written, not settled yet
        self.done = False
        self.failed = False  # it ended without a result (cancelled, superseded, an error)
        self.key: tuple[str, int, int] | None = None  # its cache entry, once the answer went out
        self.answered: tuple[int, int, str] | None = None  # (version, offset, insert text) shown last
        self.task: asyncio.Task[Any] | None = None
        self._changed = asyncio.Event()

    @property
    def has_first_line(self) -> bool:
        return bool(self.raw.strip())

    @property
    def shown_raw(self) -> str:
        """What an answer shows now: the settled lines, or at the time budget before the first
        line settled, the line being written too."""
        return self.raw if self.has_first_line or self.done else self.raw + self.tail

    def progress(self, params: dict[str, Any]) -> bool:
        """A ``progress`` notification; True when the settled text grew."""
        text, tail = params.get("text"), params.get("tail")
        self.tail = tail if isinstance(tail, str) else ""
        if self.done or not isinstance(text, str) or len(text) <= len(self.raw) or not text.startswith(self.raw):
            return False
        self.raw = text
        self._wake()
        return True

    def finish(self, text: str | None) -> bool:
        """The result came (its text), or the call ended without one (None); True when it grew."""
        grew = isinstance(text, str) and text != self.raw
        if grew:
            self.raw = text  # type: ignore[assignment]
        self.done = True
        self._wake()
        return grew

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def changed(self, timeout: float | None) -> None:
        """Wait for the next growth or the end (at most ``timeout`` seconds)."""
        if self.done:
            return
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._changed.wait(), timeout)


@dataclass
class Stats:
    requests: int = 0
    daemon_requests: int = 0
    shown: int = 0
    accepted: int = 0
    accepted_partial: int = 0  # a word or a line of a suggestion taken (each counted)
    accepted_chars: int = 0
    cache_hits: int = 0
    prefetches: int = 0
    streamed: int = 0  # automatic requests answered with their first line while the rest came
    grew: int = 0  # suggestions the editor was told grew after they were shown
    cancelled: int = 0
    failed: int = 0
    last_latency_ms: float | None = None
    last_stop_reason: str | None = None
    last_error: str | None = None  # the last failed completion's error, until one succeeds
    acceptance: dict[str, dict[str, int]] = field(default_factory=dict)  # per drafting source

    def add_sources(self, sources: Any) -> None:
        if not isinstance(sources, dict):
            return
        for name, counts in sources.items():
            if isinstance(counts, dict):
                total = self.acceptance.setdefault(str(name), {"proposed": 0, "accepted": 0})
                total["proposed"] += int(counts.get("proposed", 0) or 0)
                total["accepted"] += int(counts.get("accepted", 0) or 0)

    def to_dict(self) -> dict[str, Any]:
        acceptance = {
            name: {**counts, "rate": round(counts["accepted"] / counts["proposed"], 3) if counts["proposed"] else 0.0}
            for name, counts in self.acceptance.items()
        }
        return {
            "requests": self.requests, "daemonRequests": self.daemon_requests, "shown": self.shown,
            "accepted": self.accepted, "acceptedPartial": self.accepted_partial, "acceptedChars": self.accepted_chars, "cacheHits": self.cache_hits,
            "prefetches": self.prefetches, "streamed": self.streamed, "grew": self.grew, "cancelled": self.cancelled, "failed": self.failed,
            "lastLatencyMs": self.last_latency_ms, "lastStopReason": self.last_stop_reason,
            "lastError": self.last_error,
            "acceptance": acceptance,
        }


class FailureNotices:
    """Which completion failures to show: each distinct message once, and again only after a
    completion succeeded in between (a broken model must not pop up on every keystroke)."""

    def __init__(self) -> None:
        self._shown: set[str] = set()

    def failed(self, message: str) -> bool:
        """True when ``message`` should be shown now."""
        if message in self._shown:
            return False
        self._shown.add(message)
        return True

    def succeeded(self) -> None:
        self._shown.clear()


class Completer:
    def __init__(self, documents: DocumentStore, link: Any, settings: Callable[[], Settings],
                 on_result: Callable[[], None] | None = None, on_failure: Callable[[str], None] | None = None,
                 on_grew: Callable[[str, int, int], None] | None = None):
        self.documents = documents
        self.link = link
        self._settings = settings
        self._on_result = on_result
        self._on_failure = on_failure  # called with a failure's message when the user should see it
        self._on_grew = on_grew  # (uri, version, offset): a shown item grew; the editor may ask again
        self._streams: dict[str, StreamedCompletion] = {}  # per document: the stream still growing
        self.notices = FailureNotices()
        self.cache = TypeThroughCache(settings().cache.size)
        self.stats = Stats()
        self._ids = itertools.count(1)
        self._generation: dict[str, int] = collections.defaultdict(int)  # newest request per document
        self._shown: collections.OrderedDict[str, Proposal] = collections.OrderedDict()
        self._prefetch: dict[str, asyncio.Task[Any]] = {}
        self._busy: collections.Counter[str] = collections.Counter()  # daemon calls in flight per document

    @property
    def settings(self) -> Settings:
        return self._settings()

    # -- the request ---------------------------------------------------------------------

    async def propose(self, query: CompletionQuery) -> list[Proposal]:
        """Proposals for one request; [] when disabled, superseded, unavailable or empty."""
        settings = self.settings
        doc = self.documents.get(query.uri)
        if doc is None or not settings.enable:
            return []
        if query.trigger == AUTOMATIC and settings.trigger_mode == "manual":
            return []
        self.stats.requests += 1
        self._generation[query.uri] += 1
        generation = self._generation[query.uri]
        text, version = doc.text, doc.version
        offset = max(0, min(query.offset, len(text)))
        # The completion is computed at the cursor as it would be with the selected item applied.
        if query.selected is not None:
            sel = query.selected
            text = text[:sel.start] + sel.text + text[sel.end:]
            offset = sel.start + len(sel.text)
        alternatives = 1 if query.trigger == AUTOMATIC else settings.alternatives

        stream: StreamedCompletion | None = None
        found = await self._from_cache(query.uri, text, offset, alternatives)
        if self._generation[query.uri] != generation:
            return []  # superseded while it waited for a streamed line
        cached = found is not None
        if found is None:
            if query.trigger == AUTOMATIC and settings.debounce_ms > 0:
                await asyncio.sleep(settings.debounce_ms / 1000)  # debounce: a newer keystroke wins
                if self._generation[query.uri] != generation:
                    return []
            if alternatives == 1 and settings.stream and query.selected is None:
                stream = await self._ask_streamed(query, text, offset, version, generation)
                if stream is None:
                    return []
                raws = [stream.shown_raw]
            else:
                raws = await self._ask_daemon(query, text, offset, version, alternatives, generation)
                if raws is None:
                    return []
                self.cache.put(query.uri, text, offset, raws)
        else:
            key, raws = found
            self.stats.cache_hits += 1
            stream = self._stream_for(query.uri, key)
            if self._busy[query.uri] and (stream is None or stream.done):
                self.link.cancel_document(query.uri)  # an older request's daemon work is moot now
        proposals = self._proposals(query, doc.text, text, offset, raws, cached)
        if stream is not None and proposals and query.selected is None:
            stream.answered = (generation, version, offset, proposals[0].insert_text)
        return proposals

    async def _from_cache(self, uri: str, text: str, offset: int,
                          alternatives: int) -> tuple[tuple[str, int, int], list[str]] | None:
        """(entry key, remaining completions) when the user typed into a cached completion. When
        they typed all a streamed one has settled so far (accepting its first line), its next
        lines are on the way: wait for them rather than ask the daemon again."""
        if not self.settings.cache.type_through:
            return None
        found = self.cache.lookup_entry(uri, text, offset)
        if found is None:
            typed_all = self.cache.match(uri, text, offset)
            stream = self._stream_for(uri, typed_all[0]) if typed_all is not None else None
            deadline = time.monotonic() + self.settings.daemon.request_timeout_ms / 1000
            generation = self._generation[uri]
            while stream is not None and not stream.done and self._generation[uri] == generation:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                await stream.changed(left)
                if (found := self.cache.lookup_entry(uri, text, offset)) is not None:
                    break
        if found is None or len(found[1]) < alternatives:
            return None  # an invoked request wants more alternatives than the cache holds
        return found

    def _stream_for(self, uri: str, key: tuple[str, int, int]) -> StreamedCompletion | None:
        stream = self._streams.get(uri)
        return stream if stream is not None and stream.key == key else None

    # -- streamed completions ------------------------------------------------------------

    async def _ask_streamed(self, query: CompletionQuery, text: str, offset: int, version: int,
                            generation: int) -> StreamedCompletion | None:
        """A greedy daemon complete, streamed: back as soon as its first non-empty line is
        settled (or at the time budget, with what exists then, or at its result); the rest goes
        on arriving into the cache entry. None when it failed or a newer request took over
        before it answered (its stream is cancelled then: it never feeds a later answer)."""
        stream = StreamedCompletion(query.uri, text, offset)
        previous = self._streams.get(query.uri)
        if previous is not None:
            previous.answered = None  # a new request for the document: the old item grows no more
        self._streams[query.uri] = stream
        stream.task = asyncio.ensure_future(self._run_stream(stream, version, self._options()))
        budget_ms = self.settings.time_budget_ms or self.settings.daemon.request_timeout_ms
        deadline = time.monotonic() + budget_ms / 1000
        try:
            while not stream.has_first_line and not stream.done and self._generation[query.uri] == generation:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                await stream.changed(left)
        except asyncio.CancelledError:
            stream.task.cancel()
            raise
        if self._generation[query.uri] != generation or stream.failed or not stream.shown_raw:
            if not stream.done:
                stream.task.cancel()
            if self._streams.get(query.uri) is stream:
                del self._streams[query.uri]
            return None
        if not stream.done:
            self.stats.streamed += 1
        stream.key = self.cache.put(query.uri, text, offset, [stream.shown_raw])
        return stream

    async def _run_stream(self, stream: StreamedCompletion, version: int, options: dict[str, Any]) -> None:
        result: dict[str, Any] | None = None
        try:
            result = await self._complete(stream.uri, stream.text, stream.offset, version, options, False,
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
        if stream.key is None or not self.cache.extend(stream.key, [stream.raw]) or stream.answered is None:
            return
        generation, version, offset, shown = stream.answered
        doc = self.documents.get(stream.uri)
        if self._generation[stream.uri] != generation or doc is None or doc.version != version:
            return  # the editor has moved on: a newer request is served on its own
        found = self.cache.match(stream.uri, doc.text, offset, empty_ok=False)
        if found is None or found[0] != stream.key:
            return
        suggestion = postprocess(found[1][0], context_at(doc.text, offset), single_line=self.settings.single_line)
        if suggestion is None or suggestion.insert_text == shown:
            return
        stream.answered = (generation, version, offset, suggestion.insert_text)
        self.stats.grew += 1
        if self._on_grew is not None:
            self._on_grew(stream.uri, version, offset)

    def _options(self, temperature: float = 0.0, seed: int | None = None) -> dict[str, Any]:
        settings = self.settings
        options: dict[str, Any] = {"max_tokens": settings.max_tokens, "single_line": settings.single_line,
                                   "temperature": temperature}
        if seed is not None:
            options["seed"] = seed
        if settings.time_budget_ms:
            options["time_budget_ms"] = settings.time_budget_ms
        return options

    async def _ask_daemon(self, query: CompletionQuery, text: str, offset: int, version: int,
                          alternatives: int, generation: int) -> list[str] | None:
        """Greedy first, then sampled alternatives until ``alternatives`` distinct items would
        show: a sample that shows as an item already drawn (texts that differ only past where
        post-processing cuts them), or as nothing, is drawn again, at most ``EXTRA_DRAWS`` times
        in all (a peaked model repeats its greedy item at any temperature); None when superseded
        or the daemon fails."""
        ctx = context_at(text, offset)
        raws: list[str] = []
        shown: set[tuple[int, str]] = set()
        draws = alternatives + (EXTRA_DRAWS if alternatives > 1 else 0)
        for number in range(draws):
            if len(shown) >= alternatives:
                break
            if self._generation[query.uri] != generation:
                return None  # a newer request for this document took over
            temperature = 0.0 if number == 0 else self.settings.temperature
            options = self._options(temperature, SEED_BASE + number - 1 if number else None)
            result = await self._complete(query.uri, text, offset, version, options, query.selected is not None)
            if self._generation[query.uri] != generation:
                return None  # cancelled for a newer request: a partial list would stand as the answer
            if result is None:
                return raws or None
            raw = result.get("text")
            if not isinstance(raw, str):
                continue
            item = self._item(query, ctx, offset, raw)
            if not number or (item is not None and item[1:] not in shown):
                raws.append(raw)  # the greedy one always: the type-through cache serves it as typed
            if item is not None:
                shown.add(item[1:])
        return raws

    async def _complete(self, uri: str, text: str, offset: int, version: int, options: dict[str, Any],
                        virtual: bool, on_progress: Callable[[dict[str, Any]], None] | None = None
                        ) -> dict[str, Any] | None:
        """One daemon complete; the document's own buffer unless the text is not the editor's."""
        doc = self.documents.get(uri)
        params: dict[str, Any] = {"uri": uri, "cursor": {"offset": offset}, "options": options}
        if virtual or doc is None or doc.version != version or doc.text is not text:
            params["text"] = text  # keyed by uri still, so the daemon reuses the document's KV cache
        timeout = self.settings.daemon.request_timeout_ms / 1000
        self.stats.daemon_requests += 1
        started = time.monotonic()
        self._busy[uri] += 1
        try:
            if on_progress is None:
                result = await self.link.complete(params, timeout)
            else:
                result = await self.link.complete(params, timeout, on_progress)
        except RpcError as err:
            if err.code == ErrorCode.CANCELLED.value:
                self.stats.cancelled += 1
            elif err.code == ErrorCode.UNKNOWN_DOCUMENT.value and "text" not in params:
                log.info("the daemon lost %s; sending it again", uri)
                if doc is not None:
                    self.link.open(doc)
                self.stats.failed += 1
            else:
                self.stats.failed += 1
                log.info("completion failed: %s", err)
                self._failed(err)
            return None
        except asyncio.CancelledError:
            self.stats.cancelled += 1
            raise
        except (TypeError, ValueError) as err:  # text the socket cannot carry (a lone surrogate)
            self.stats.failed += 1
            log.warning("cannot ask the daemon: %s", err)
            return None
        finally:
            self._busy[uri] -= 1
        self.stats.last_latency_ms = round(result.get("latency_ms") or (time.monotonic() - started) * 1000, 1)
        self.stats.last_stop_reason = result.get("stop_reason")
        self.stats.add_sources(result.get("sources"))
        self.stats.last_error = None
        self.notices.succeeded()
        if self._on_result is not None:
            self._on_result()
        return result

    def _failed(self, err: RpcError) -> None:
        if err.code in QUIET_ERRORS:
            return
        self.stats.last_error = f"{err.code}: {err.message}"
        if err.code not in UNSHOWN_ERRORS and self.notices.failed(self.stats.last_error) and self._on_failure:
            self._on_failure(self.stats.last_error)

    def _proposals(self, query: CompletionQuery, doc_text: str, text: str, offset: int, raws: list[str],
                   cached: bool) -> list[Proposal]:
        ctx = context_at(text, offset)
        proposals: list[Proposal] = []
        seen: set[tuple[int, str]] = set()
        for raw in raws:
            item = self._item(query, ctx, offset, raw)
            if item is None:
                continue
            start, end, insert = item
            if (end, insert) in seen:
                continue
            seen.add((end, insert))
            proposal = Proposal(f"{next(self._ids)}", query.uri, doc_text, start, end, insert, cached)
            proposals.append(proposal)
            self._remember(proposal)
        self.stats.shown += len(proposals)
        return proposals

    def _item(self, query: CompletionQuery, ctx: CursorContext, offset: int, raw: str) -> tuple[int, int, str] | None:
        """What ``raw`` shows: (start, end, insert text) in the editor's text; None when nothing."""
        suggestion = postprocess(raw, ctx, single_line=self.settings.single_line,
                                 replace_line_suffix=query.selected is None)
        return None if suggestion is None else self._placement(query, offset, suggestion)

    @staticmethod
    def _placement(query: CompletionQuery, offset: int, suggestion: Suggestion) -> tuple[int, int, str]:
        """Where the item goes in the editor's text: the selected item's range, or the cursor's."""
        if query.selected is not None:
            sel = query.selected
            return sel.start, sel.end, sel.text + suggestion.insert_text
        return offset, offset + suggestion.replace_chars, suggestion.insert_text

    # -- accepts and prefetch ------------------------------------------------------------

    def _remember(self, proposal: Proposal) -> None:
        self._shown[proposal.id] = proposal
        while len(self._shown) > SHOWN_KEPT:
            self._shown.popitem(last=False)

    def accepted(self, proposal_id: str) -> Proposal | None:
        """The editor inserted a proposal: count it, and compute the next suggestion ahead."""
        proposal = self._shown.pop(str(proposal_id), None)
        if proposal is None:
            return None
        self.stats.accepted += 1
        self.stats.accepted_chars += len(proposal.insert_text)
        if self.settings.cache.prefetch and self.settings.enable and not self._streamed_on(proposal):
            previous = self._prefetch.pop(proposal.uri, None)
            if previous is not None:
                previous.cancel()
            task = asyncio.ensure_future(self._prefetch_after(proposal))
            self._prefetch[proposal.uri] = task
            task.add_done_callback(lambda t, uri=proposal.uri: self._prefetch_done(uri, t))
        return proposal

    def _streamed_on(self, proposal: Proposal) -> bool:
        """After accepting ``proposal``, its stream serves what comes next: its entry holds more
        lines, or is still growing. A prefetch would only supersede that stream."""
        text = proposal.text[:proposal.start] + proposal.insert_text + proposal.text[proposal.end:]
        found = self.cache.match(proposal.uri, text, proposal.start + len(proposal.insert_text))
        stream = self._stream_for(proposal.uri, found[0]) if found is not None else None
        return stream is not None and (any(found[1]) or not stream.done)  # type: ignore[index]

    def partially_accepted(self, proposal_id: str, chars: int) -> Proposal | None:
        """The editor inserted a word or a line of a proposal: count it; the proposal stays
        shown (the rest may be taken later, which counts as an accept)."""
        proposal = self._shown.get(str(proposal_id))
        if proposal is None:
            return None
        self.stats.accepted_partial += 1
        self.stats.accepted_chars += max(0, min(int(chars), len(proposal.insert_text)))
        return proposal

    def _prefetch_done(self, uri: str, task: asyncio.Task[Any]) -> None:
        if self._prefetch.get(uri) is task:
            del self._prefetch[uri]
        if not task.cancelled() and (err := task.exception()) is not None:
            log.debug("prefetch failed: %s", err)

    async def _prefetch_after(self, proposal: Proposal) -> None:
        text = proposal.text[:proposal.start] + proposal.insert_text + proposal.text[proposal.end:]
        offset = proposal.start + len(proposal.insert_text)
        doc = self.documents.get(proposal.uri)
        version = -1
        if doc is not None and doc.text == text:  # the editor already applied the accept
            text, version = doc.text, doc.version
        result = await self._complete(proposal.uri, text, offset, version, self._options(), virtual=version < 0)
        if result is not None and isinstance(result.get("text"), str):
            self.cache.put(proposal.uri, text, offset, [result["text"]])
            self.stats.prefetches += 1

    def wait_prefetch(self, uri: str) -> asyncio.Task[Any] | None:
        return self._prefetch.get(uri)

    def forget(self, uri: str) -> None:
        self.cache.drop(uri)
        self._generation.pop(uri, None)
        self._busy.pop(uri, None)
        stream = self._streams.pop(uri, None)
        if stream is not None and stream.task is not None:
            stream.task.cancel()
        task = self._prefetch.pop(uri, None)
        if task is not None:
            task.cancel()
