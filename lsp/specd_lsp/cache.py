"""The type-through cache: raw completions keyed by the text around the cursor they were made for.

When the user types characters the last completion predicted, the document's text before the
cursor is the old text plus those characters and the text after it is unchanged: the rest of
that completion is still the model's answer, so it is served with no model work. Prefetched
completions (computed as if a shown suggestion had been accepted) live here too.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

PER_DOCUMENT = 4  # type-through needs the last few completions of a document, not its history
MAX_CHARS = 16 * 1024 * 1024  # text held over all entries (each keeps its document's text)


@dataclass(frozen=True)
class CacheEntry:
    uri: str
    before: str  # the document text before the cursor
    after: str  # the document text after the cursor
    raws: tuple[str, ...]  # the daemon's completions at that cursor, best first


class TypeThroughCache:
    def __init__(self, size: int = 64):
        self.size = size
        self._entries: OrderedDict[tuple[str, int, int], CacheEntry] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, uri: str, text: str, offset: int, raws: list[str]) -> None:
        raws = [raw for raw in raws if raw]
        if self.size <= 0 or not raws:
            return
        key = (uri, offset, hash(text))
        self._entries[key] = CacheEntry(uri, text[:offset], text[offset:], tuple(raws))
        self._entries.move_to_end(key)
        same_document = [k for k, entry in self._entries.items() if entry.uri == uri]
        for old in same_document[:-PER_DOCUMENT]:
            del self._entries[old]
        while len(self._entries) > self.size or (len(self._entries) > 1 and self._chars() > MAX_CHARS):
            self._entries.popitem(last=False)

    def _chars(self) -> int:
        return sum(len(entry.before) + len(entry.after) for entry in self._entries.values())

    def lookup(self, uri: str, text: str, offset: int) -> list[str] | None:
        """The remaining completions at ``offset`` if the user typed into a cached one."""
        for key in reversed(self._entries):
            entry = self._entries[key]
            if entry.uri != uri:
                continue
            start = len(entry.before)
            if start > offset or len(text) - offset != len(entry.after):
                continue
            if not (text.startswith(entry.before) and text.endswith(entry.after)):
                continue
            typed = text[start:offset]
            remaining = [raw[len(typed):] for raw in entry.raws if raw.startswith(typed) and len(raw) > len(typed)]
            if remaining:
                self._entries.move_to_end(key)
                self.hits += 1
                return remaining
        self.misses += 1
        return None

    def drop(self, uri: str) -> None:
        for key in [key for key, entry in self._entries.items() if entry.uri == uri]:
            del self._entries[key]
