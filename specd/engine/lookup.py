"""Prompt lookup: an incremental n-gram index over token sequences. No model.

Each ``NgramIndex`` keys every bigram of its token list to the last position just after it,
and chains each position to the previous one after the same bigram (``_prev``, an array beside
the tokens). A lookup walks the tail's bigram's chain, most recent first, and extends each match
backwards up to ``MAX_N`` tokens; the longest wins. Memory is 8 bytes per token (two 4-byte
arrays) plus one dict entry per distinct bigram, so whole workspaces fit; and an index holds ints and two arrays
only, nothing per bigram that CPython's cyclic garbage collector would walk (an array per bigram
did: a workspace's worth made every full collection longer). Appending and truncating touch only
the changed tail: no rescans. A keystroke's few tokens go through a loop; idle indexing's slices
of thousands go through numpy (a sort groups each bigram's positions, the dict is read and
written in C-level passes), several times faster per token (docs/engine.md) and, above all,
that much less time holding the GIL the daemon's event loop needs.
"""

from __future__ import annotations

import itertools
from array import array
from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np

MIN_N = 2  # a single shared token predicts little
MAX_N = 5  # longer matches are rarer and barely more reliable than 5-grams
MAX_CANDIDATES = 64  # bigram occurrences examined per lookup, most recent first
VECTORIZED_FROM = 512  # tokens added or dropped at once from which numpy beats the loop


@dataclass(frozen=True)
class Match:
    tokens: list[int]  # the proposed continuation
    ngram: int  # length of the matched tail n-gram (longer = more trustworthy)
    source: str  # which index answered: lookup:current, lookup:suggested, lookup:open, lookup:workspace
    repeat: bool = False  # the context repeats itself: the match is closer to the tail than the proposal is long


class NgramIndex:
    def __init__(self, tokens: Iterable[int] = ()):
        self.max_n = MAX_N
        self.tokens = array("i")  # token ids fit 32 bits; compared by memcmp (corpus.common_prefix_length)
        self._last: dict[int, int] = {}  # bigram (a, b), keyed a << 32 | b -> the last position after it
        self._prev = array("i", (0,))  # position -> the previous position after the same bigram (0: none); positions fit 32 bits
        self.changes = 0  # counts every extend and truncate: who synced it can tell nobody else has since
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, new: Iterable[int]) -> None:
        tokens, prev, last = self.tokens, self._prev, self._last
        self.changes += 1
        start = len(tokens)
        tokens.extend(new)
        if len(tokens) - start >= VECTORIZED_FROM:
            self._extend_many(start)
            return
        for end in range(start + 1, len(tokens) + 1):
            if end < 2:
                prev.append(0)  # no bigram ends before position 1
                continue
            key = tokens[end - 2] << 32 | tokens[end - 1]
            prev.append(last.get(key, 0))
            last[key] = end

    def _extend_many(self, start: int) -> None:
        """``extend``'s chaining for the tokens from ``start`` on (already appended), at once."""
        tokens, prev, last = self.tokens, self._prev, self._last
        first = start + 1
        if first < 2:
            prev.append(0)  # no bigram ends before position 1
            first = 2
        if first > len(tokens):
            return
        keys = _bigrams(tokens, first)  # the bigram before each end, first..len
        ends = np.arange(first, len(tokens) + 1, dtype=np.int64)
        order = np.argsort(keys, kind="stable")  # each bigram's ends together, in order
        keys, ends = keys[order], ends[order]
        opens = np.ones(len(keys), dtype=bool)  # the first of its bigram in this batch
        opens[1:] = keys[1:] != keys[:-1]
        chained = np.empty(len(keys), dtype=np.int64)
        chained[1:] = ends[:-1]  # the previous end of the same bigram
        firsts = np.flatnonzero(opens)
        chained[firsts] = list(map(last.get, keys[firsts].tolist(), itertools.repeat(0)))  # from before
        out = np.empty(len(keys), dtype=np.int32)
        out[order] = chained
        prev.frombytes(out.tobytes())
        closes = np.empty(len(keys), dtype=bool)  # the last of its bigram: the new last position
        closes[:-1], closes[-1] = opens[1:], True
        last.update(zip(keys[closes].tolist(), ends[closes].tolist()))

    def truncate(self, length: int) -> None:
        """Drop tokens from ``length`` on. Positions are chained in order, so each dropped one is
        its bigram's last: the one before it becomes the last again."""
        tokens, prev, last = self.tokens, self._prev, self._last
        self.changes += 1
        if len(tokens) - length >= VECTORIZED_FROM:
            self._truncate_many(length)
        else:
            for end in range(len(tokens), max(length, 1), -1):
                key = tokens[end - 2] << 32 | tokens[end - 1]
                if prev[end]:
                    last[key] = prev[end]
                else:
                    del last[key]
        del tokens[length:]
        del prev[length + 1:]

    def _truncate_many(self, length: int) -> None:
        """``truncate``'s unchaining of the ends after ``length``, at once: each dropped bigram's
        last becomes what its earliest dropped end chained to (none: the bigram goes)."""
        tokens, prev, last = self.tokens, self._prev, self._last
        first = max(length, 1) + 1  # the first dropped end with a bigram
        if first > len(tokens):
            return
        keys = _bigrams(tokens, first)
        keys, earliest = np.unique(keys, return_index=True)  # each bigram's earliest dropped end
        chains = np.frombuffer(prev, dtype=np.int32)  # a view: released below, before prev shrinks
        before = chains[first:][earliest].astype(np.int64)
        del chains
        kept = before != 0
        last.update(zip(keys[kept].tolist(), before[kept].tolist()))
        for key in keys[~kept].tolist():
            del last[key]

    def sync(self, tokens: Sequence[int]) -> None:
        """Make the index hold ``tokens``, touching only what differs from what it holds."""
        held = len(self.tokens)
        if len(tokens) >= held and self.tokens.tolist() == list(tokens[:held]):  # grew at the end
            self.extend(tokens[held:])
            return
        keep = 0
        limit = min(held, len(tokens))
        while keep < limit and self.tokens[keep] == tokens[keep]:
            keep += 1
        self.truncate(keep)
        self.extend(tokens[keep:])

    def locate(self, tail: Sequence[int]) -> tuple[int, int]:
        """(end, n) of the most recent occurrence of the longest matching suffix n-gram of
        ``tail``: its continuation starts at ``end``; (-1, 0) when none."""
        if len(tail) < MIN_N:
            return -1, 0
        end = self._last.get(tail[-2] << 32 | tail[-1], 0)
        tokens, prev, size = self.tokens, self._prev, len(self.tokens)
        longest = min(self.max_n, len(tail))
        best_end, best_n = -1, 0
        examined = 0
        while end:  # most recent first
            if end < size:  # (at size: the tail itself, nothing follows it)
                n = MIN_N
                while n < longest and end - n - 1 >= 0 and tokens[end - n - 1] == tail[-n - 1]:
                    n += 1
                if n > best_n:
                    best_end, best_n = end, n
                    if n == longest:
                        break
                examined += 1
                if examined >= MAX_CANDIDATES:
                    break
            end = prev[end]
        return best_end, best_n

    def continuation(self, end: int, k: int, periodic: bool = False) -> list[int]:
        """Up to k tokens from ``end`` on.

        ``periodic``: this index holds the tail itself (the context being written). A match d
        tokens back then says the text repeats with period d, and the continuation runs on past
        the end of what is held, copying what it has just proposed (as LZ77 copies overlap), to
        k tokens: in a run like ``0, 0, 0`` or ``'s', 's',`` the most recent match is a token or
        three back, and without this the proposal would stop at the tail after d tokens."""
        proposal = self.tokens[end:end + k].tolist()
        if periodic:
            period = len(self.tokens) - end
            while len(proposal) < k:
                proposal.append(proposal[len(proposal) - period])
        return proposal


def _bigrams(tokens: array, first: int) -> np.ndarray:
    """The bigram keys (a << 32 | b) ending at positions ``first``..len(tokens), as int64."""
    view = np.frombuffer(tokens, dtype=np.int32)  # a view: released before tokens changes size
    held = view[first - 2:].astype(np.int64)
    del view
    return held[:-1] << 32 | held[1:]


def candidates(tail: Sequence[int], k: int, indexes: Sequence[tuple[str, NgramIndex]],
               holding_tail: NgramIndex | None = None) -> list[Match]:
    """Every index's match, best first as ``lookup`` ranks them (longer n-gram, then the earlier
    index): the candidates a token tree verifies side by side."""
    found = []
    for order, (source, index) in enumerate(indexes):
        end, n = index.locate(tail)
        if n:
            found.append((-n, order, _match(source, index, end, n, k, index is holding_tail)))
    return [match for _, _, match in sorted(found, key=lambda item: item[:2])]


def _match(source: str, index: NgramIndex, end: int, n: int, k: int, periodic: bool) -> Match:
    tokens = index.continuation(end, k, periodic)
    return Match(tokens, n, source, repeat=periodic and len(index) - end < len(tokens))


def lookup(tail: Sequence[int], k: int, indexes: Sequence[tuple[str, NgramIndex]],
           holding_tail: NgramIndex | None = None) -> Match | None:
    """Search the indexes in priority order; the longest n-gram wins, ties go to the earlier index.
    ``holding_tail``: the index whose tokens are ``tail`` itself (its matches may run periodic)."""
    best: Match | None = None
    for source, index in indexes:
        end, n = index.locate(tail)
        if n and (best is None or n > best.ngram):
            best = _match(source, index, end, n, k, index is holding_tail)
            if n >= index.max_n:
                break
    return best
