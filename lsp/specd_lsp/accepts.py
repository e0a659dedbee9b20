"""What became of shown proposals: accepts and partial accepts counted, and after an accept
the next suggestion computed ahead into the type-through cache (a prefetch), unless the
accepted item's stream already brings it.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from typing import Any, Callable

from specd_lsp.cache import TypeThroughCache
from specd_lsp.daemon_calls import DaemonCalls
from specd_lsp.documents import DocumentStore
from specd_lsp.options import Settings
from specd_lsp.proposals import Proposal
from specd_lsp.streams import Streams

log = logging.getLogger("specd_lsp.completer")

SHOWN_KEPT = 256  # proposals remembered for their accept command


class Accepts:
    def __init__(self, documents: DocumentStore, cache: TypeThroughCache, calls: DaemonCalls, streams: Streams,
                 settings: Callable[[], Settings]):
        self.documents = documents
        self.cache = cache
        self.calls = calls
        self.stats = calls.stats
        self.streams = streams
        self._settings = settings
        self._shown: collections.OrderedDict[str, Proposal] = collections.OrderedDict()
        self._prefetch: dict[str, asyncio.Task[Any]] = {}  # per document: the prefetch in flight

    def remember(self, proposal: Proposal) -> None:
        """``proposal`` is shown: keep it for its accept command (the last ``SHOWN_KEPT``)."""
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
        settings = self._settings()
        if settings.cache.prefetch and settings.enable and not self._streamed_on(proposal):
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

    def _streamed_on(self, proposal: Proposal) -> bool:
        """After accepting ``proposal``, its stream serves what comes next: its entry holds more
        lines, or is still growing. A prefetch would only supersede that stream."""
        text, offset = proposal.applied()
        found = self.cache.match(proposal.uri, text, offset)
        if found is None:
            return False
        stream = self.streams.for_entry(proposal.uri, found[0])
        return stream is not None and (any(found[1]) or not stream.done)

    def _prefetch_done(self, uri: str, task: asyncio.Task[Any]) -> None:
        if self._prefetch.get(uri) is task:
            del self._prefetch[uri]
        if not task.cancelled() and (err := task.exception()) is not None:
            log.debug("prefetch failed: %s", err)

    async def _prefetch_after(self, proposal: Proposal) -> None:
        text, offset = proposal.applied()
        doc = self.documents.get(proposal.uri)
        version = -1
        if doc is not None and doc.text == text:  # the editor already applied the accept
            text, version = doc.text, doc.version
        result = await self.calls.complete(proposal.uri, text, offset, version, self.calls.options(),
                                           virtual=version < 0)
        if result is not None and isinstance(result.get("text"), str):
            self.cache.put(proposal.uri, text, offset, [result["text"]])
            self.stats.prefetches += 1

    def forget(self, uri: str) -> None:
        task = self._prefetch.pop(uri, None)
        if task is not None:
            task.cancel()
