"""From "the editor wants a suggestion here" to post-processed proposals, in code points.

The LSP handlers convert positions and types; the ``Completer`` decides what to ask the daemon
and what to show: per-document debounce and supersession (a newer request for a document wins),
the type-through cache, and whether to ask for one streamed greedy item (automatic triggers,
``streams``) or the greedy item and sampled alternatives (invoked ones, ``alternatives``). What
becomes of a shown proposal is ``accepts``'; one daemon call, its counts and which failures the
user hears of are ``daemon_calls``'. It knows documents and offsets, not LSP types, so a test can
drive it with a fake link.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
from typing import Any, Callable

from specd_lsp.accepts import Accepts
from specd_lsp.alternatives import ask_alternatives
from specd_lsp.cache import TypeThroughCache
from specd_lsp.completion import context_at
from specd_lsp.daemon_calls import DaemonCalls, Stats
from specd_lsp.documents import DocumentStore
from specd_lsp.options import Settings
from specd_lsp.proposals import AUTOMATIC, CompletionQuery, Proposal, place
from specd_lsp.streams import Answered, CacheFound, StreamedCompletion, Streams


class Completer:
    def __init__(self, documents: DocumentStore, link: Any, settings: Callable[[], Settings],
                 on_result: Callable[[], None] | None = None, on_failure: Callable[[str], None] | None = None,
                 on_grew: Callable[[str, int, int], None] | None = None):
        """``on_result``: a completion came back; ``on_failure``: a failure's message, when the
        user should see it; ``on_grew(uri, version, offset)``: a shown item grew, the editor may
        ask again."""
        self.documents = documents
        self.link = link
        self._settings = settings
        self.cache = TypeThroughCache(settings().cache.size)
        self.stats = Stats()
        self.calls = DaemonCalls(documents, link, settings, self.stats, on_result, on_failure)
        self._generation: dict[str, int] = collections.defaultdict(int)  # newest request per document
        self.streams = Streams(documents, self.cache, self.calls, settings, lambda uri: self._generation[uri], on_grew)
        self.accepts = Accepts(documents, self.cache, self.calls, self.streams, settings)
        self._ids = itertools.count(1)

    @property
    def settings(self) -> Settings:
        return self._settings()

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
                stream = await self.streams.ask(query.uri, text, offset, version, generation)
                if stream is None:
                    return []
                raws = [stream.shown_raw]
            else:
                raws = await ask_alternatives(self.calls, self._settings, query, text, offset, version, alternatives,
                                              lambda: self._generation[query.uri] == generation)
                if raws is None:
                    return []
                self.cache.put(query.uri, text, offset, raws)
        else:
            key, raws = found
            self.stats.cache_hits += 1
            stream = self.streams.for_entry(query.uri, key)
            if self.calls.busy(query.uri) and (stream is None or stream.done):
                self.link.cancel_document(query.uri)  # an older request's daemon work is moot now
        proposals = self._proposals(query, doc.text, text, offset, raws, cached)
        if stream is not None and proposals and query.selected is None:
            stream.answered = Answered(generation, version, offset, proposals[0].insert_text)
        return proposals

    async def _from_cache(self, uri: str, text: str, offset: int, alternatives: int) -> CacheFound | None:
        """(entry key, remaining completions) when the user typed into a cached completion, or
        typed all a streamed one has settled so far and its next lines came."""
        if not self.settings.cache.type_through:
            return None
        found = self.cache.lookup_entry(uri, text, offset)
        if found is None:
            found = await self.streams.wait_for_entry(uri, text, offset)
        if found is None or len(found[1]) < alternatives:
            return None  # an invoked request wants more alternatives than the cache holds
        return found

    def _proposals(self, query: CompletionQuery, doc_text: str, text: str, offset: int, raws: list[str],
                   cached: bool) -> list[Proposal]:
        """The distinct items ``raws`` show, each remembered for its accept command."""
        ctx = context_at(text, offset)
        single_line = self.settings.single_line
        proposals: list[Proposal] = []
        seen: set[tuple[int, str]] = set()
        for raw in raws:
            placed = place(query, ctx, offset, raw, single_line)
            if placed is None or placed.shown in seen:
                continue
            seen.add(placed.shown)
            proposal = Proposal(f"{next(self._ids)}", query.uri, doc_text, placed.start, placed.end,
                                placed.insert_text, cached)
            proposals.append(proposal)
            self.accepts.remember(proposal)
        self.stats.shown += len(proposals)
        return proposals

    def accepted(self, proposal_id: str) -> Proposal | None:
        """The editor inserted a proposal: count it, and compute the next suggestion ahead."""
        return self.accepts.accepted(proposal_id)

    def partially_accepted(self, proposal_id: str, chars: int) -> Proposal | None:
        """The editor inserted a word or a line of a proposal: count it (it stays shown)."""
        return self.accepts.partially_accepted(proposal_id, chars)

    def forget(self, uri: str) -> None:
        """The document closed: drop everything kept for it and stop its daemon work."""
        self.cache.drop(uri)
        self._generation.pop(uri, None)
        self.calls.forget(uri)
        self.streams.forget(uri)
        self.accepts.forget(uri)
