"""Prompt lookup: an incremental n-gram index over token sequences. Pure Python, no model.

Each ``NgramIndex`` maps every n-gram (MIN_N <= n <= MAX_N) of its token list to the positions
just after it, in increasing order. Appending and truncating touch only the changed tail, so
the index of a document or of a growing completion is kept up to date without rescans.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

MIN_N = 2  # a single shared token predicts little
MAX_N = 5  # longer matches are rarer and barely more reliable than 5-grams


@dataclass(frozen=True)
class Match:
    tokens: list[int]  # the proposed continuation
    ngram: int  # length of the matched tail n-gram (longer = more trustworthy)
    source: str  # which index answered: lookup:current, lookup:open, lookup:workspace


class NgramIndex:
    def __init__(self, tokens: Iterable[int] = (), min_n: int = MIN_N, max_n: int = MAX_N):
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        self._ends: dict[tuple[int, ...], list[int]] = {}
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, new: Iterable[int]) -> None:
        tokens = self.tokens
        start = len(tokens)
        tokens.extend(new)
        for end in range(start + 1, len(tokens) + 1):
            for n in range(self.min_n, min(self.max_n, end) + 1):
                self._ends.setdefault(tuple(tokens[end - n:end]), []).append(end)

    def truncate(self, length: int) -> None:
        """Drop tokens from ``length`` on. Positions are appended in order, so each pop is the last."""
        tokens = self.tokens
        for end in range(len(tokens), length, -1):
            for n in range(self.min_n, min(self.max_n, end) + 1):
                key = tuple(tokens[end - n:end])
                ends = self._ends[key]
                ends.pop()
                if not ends:
                    del self._ends[key]
        del tokens[length:]

    def sync(self, tokens: Sequence[int]) -> None:
        """Make the index hold ``tokens``, touching only what differs from what it holds."""
        held = len(self.tokens)
        if len(tokens) >= held and list(tokens[:held]) == self.tokens:  # grew at the end
            self.extend(tokens[held:])
            return
        keep = 0
        limit = min(len(self.tokens), len(tokens))
        while keep < limit and self.tokens[keep] == tokens[keep]:
            keep += 1
        self.truncate(keep)
        self.extend(tokens[keep:])

    def find(self, tail: Sequence[int], k: int) -> tuple[list[int], int]:
        """Continuation (up to k tokens) after the most recent occurrence of the longest
        matching suffix n-gram of ``tail``; ([], 0) when nothing matches."""
        for n in range(min(self.max_n, len(tail)), self.min_n - 1, -1):
            ends = self._ends.get(tuple(tail[-n:]))
            if not ends:
                continue
            for end in reversed(ends):
                if end < len(self.tokens):  # an occurrence with something after it
                    return self.tokens[end:end + k], n
        return [], 0


def lookup(tail: Sequence[int], k: int, indexes: Sequence[tuple[str, NgramIndex]]) -> Match | None:
    """Search the indexes in priority order; the longest n-gram wins, ties go to the earlier index."""
    best: Match | None = None
    for source, index in indexes:
        tokens, n = index.find(tail, k)
        if tokens and (best is None or n > best.ngram):
            best = Match(tokens, n, source)
            if n >= index.max_n:
                break
    return best
