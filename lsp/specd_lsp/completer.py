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
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from specd.protocol.errors import ErrorCode, RpcError

from specd_lsp.cache import TypeThroughCache
from specd_lsp.completion import Suggestion, context_at, postprocess
from specd_lsp.documents import DocumentStore
from specd_lsp.options import Settings

log = logging.getLogger("specd_lsp.completer")

AUTOMATIC = "automatic"
INVOKED = "invoked"
SHOWN_KEPT = 256  # proposals remembered for their accept command
SEED_BASE = 1  # sampled alternatives use seeds 1, 2, ... so a repeated request repeats them

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
            "prefetches": self.prefetches, "cancelled": self.cancelled, "failed": self.failed,
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
                 on_result: Callable[[], None] | None = None, on_failure: Callable[[str], None] | None = None):
        self.documents = documents
        self.link = link
        self._settings = settings
        self._on_result = on_result
        self._on_failure = on_failure  # called with a failure's message when the user should see it
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

        raws = self._from_cache(query.uri, text, offset, alternatives)
        cached = raws is not None
        if raws is None:
            if query.trigger == AUTOMATIC and settings.debounce_ms > 0:
                await asyncio.sleep(settings.debounce_ms / 1000)  # debounce: a newer keystroke wins
                if self._generation[query.uri] != generation:
                    return []
            raws = await self._ask_daemon(query, text, offset, version, alternatives, generation)
            if raws is None:
                return []
            self.cache.put(query.uri, text, offset, raws)
        else:
            self.stats.cache_hits += 1
            if self._busy[query.uri]:
                self.link.cancel_document(query.uri)  # an older request's daemon work is moot now
        return self._proposals(query, doc.text, text, offset, raws, cached)

    def _from_cache(self, uri: str, text: str, offset: int, alternatives: int) -> list[str] | None:
        if not self.settings.cache.type_through:
            return None
        raws = self.cache.lookup(uri, text, offset)
        if raws is None or len(raws) < alternatives:
            return None  # an invoked request wants more alternatives than the cache holds
        return raws

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
        """Greedy first, then sampled alternatives; None when superseded or the daemon fails."""
        raws: list[str] = []
        for number in range(alternatives):
            if self._generation[query.uri] != generation:
                return None  # a newer request for this document took over
            temperature = 0.0 if number == 0 else self.settings.temperature
            options = self._options(temperature, SEED_BASE + number - 1 if number else None)
            result = await self._complete(query.uri, text, offset, version, options, query.selected is not None)
            if result is None:
                return raws or None
            raw = result.get("text")
            if isinstance(raw, str) and raw not in raws:
                raws.append(raw)
        return raws

    async def _complete(self, uri: str, text: str, offset: int, version: int, options: dict[str, Any],
                        virtual: bool) -> dict[str, Any] | None:
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
            result = await self.link.complete(params, timeout)
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
            suggestion = postprocess(raw, ctx, single_line=self.settings.single_line,
                                     replace_line_suffix=query.selected is None)
            if suggestion is None:
                continue
            start, end, insert = self._placement(query, offset, suggestion)
            if (end, insert) in seen:
                continue
            seen.add((end, insert))
            proposal = Proposal(f"{next(self._ids)}", query.uri, doc_text, start, end, insert, cached)
            proposals.append(proposal)
            self._remember(proposal)
        self.stats.shown += len(proposals)
        return proposals

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
        if self.settings.cache.prefetch and self.settings.enable:
            previous = self._prefetch.pop(proposal.uri, None)
            if previous is not None:
                previous.cancel()
            task = asyncio.ensure_future(self._prefetch_after(proposal))
            self._prefetch[proposal.uri] = task
            task.add_done_callback(lambda t, uri=proposal.uri: self._prefetch_done(uri, t))
        return proposal

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
        task = self._prefetch.pop(uri, None)
        if task is not None:
            task.cancel()
