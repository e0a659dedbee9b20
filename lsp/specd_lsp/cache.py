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

    def put(self, uri: str, text: str, offset: int, raws: list[str]) -> tuple[str, int, int] | None:
        """Keep ``raws`` for this cursor; the entry's key (for ``extend``), None when not kept."""
        raws = [raw for raw in raws if raw]
        if self.size <= 0 or not raws:
            return None
        key = (uri, offset, hash(text))
        self._entries[key] = CacheEntry(uri, text[:offset], text[offset:], tuple(raws))
        self._entries.move_to_end(key)
        same_document = [k for k, entry in self._entries.items() if entry.uri == uri]
        for old in same_document[:-PER_DOCUMENT]:
            del self._entries[old]
        while len(self._entries) > self.size or (len(self._entries) > 1 and self._chars() > MAX_CHARS):
            self._entries.popitem(last=False)
        return key if key in self._entries else None

    def extend(self, key: tuple[str, int, int], raws: list[str]) -> bool:
        """A streamed completion grew: the entry under ``key`` holds ``raws`` now (if still kept)."""
        entry = self._entries.get(key)
        raws = [raw for raw in raws if raw]
        if entry is None or not raws:
            return False
        self._entries[key] = CacheEntry(entry.uri, entry.before, entry.after, tuple(raws))
        return True

    def match(self, uri: str, text: str, offset: int, empty_ok: bool = True) -> tuple[tuple[str, int, int], list[str]] | None:
        """The newest entry the user typed into (``text`` around ``offset`` is its text plus a
        prefix of one of its completions), with what remains of each: a remainder may be empty
        when the user typed all there was so far (a streamed completion still growing)."""
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
            remaining = [raw[len(typed):] for raw in entry.raws
                         if raw.startswith(typed) and (empty_ok or len(raw) > len(typed))]
            if remaining:
                return key, remaining
        return None

    def _chars(self) -> int:
        return sum(len(entry.before) + len(entry.after) for entry in self._entries.values())

    def lookup(self, uri: str, text: str, offset: int) -> list[str] | None:
        """The remaining completions at ``offset`` if the user typed into a cached one."""
        found = self.lookup_entry(uri, text, offset)
        return found[1] if found is not None else None

    def lookup_entry(self, uri: str, text: str, offset: int) -> tuple[tuple[str, int, int], list[str]] | None:
        """``lookup`` with the entry's key; counted as a hit or a miss."""
        found = self.match(uri, text, offset, empty_ok=False)
        if found is None:
            self.misses += 1
            return None
        self._entries.move_to_end(found[0])
        self.hits += 1
        return found

    def drop(self, uri: str) -> None:
        for key in [key for key, entry in self._entries.items() if entry.uri == uri]:
            del self._entries[key]
