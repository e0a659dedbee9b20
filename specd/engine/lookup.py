"""Prompt lookup: an incremental n-gram index over token sequences. Pure Python, no model.

Each ``NgramIndex`` keys every bigram of its token list to the last position just after it,
and chains each position to the previous one after the same bigram (``_prev``, an array beside
the tokens). A lookup walks the tail's bigram's chain, most recent first, and extends each match
backwards up to ``MAX_N`` tokens; the longest wins. Memory is 8 bytes per token (two 4-byte
arrays) plus one dict entry per distinct bigram, so whole workspaces fit; and an index holds ints and two arrays
only, nothing per bigram that CPython's cyclic garbage collector would walk (an array per bigram
did: a workspace's worth made every full collection longer). Appending and truncating touch only
the changed tail: no rescans.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from typing import Iterable, Sequence

MIN_N = 2  # a single shared token predicts little
MAX_N = 5  # longer matches are rarer and barely more reliable than 5-grams
MAX_CANDIDATES = 64  # bigram occurrences examined per lookup, most recent first


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
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, new: Iterable[int]) -> None:
        tokens, prev, last = self.tokens, self._prev, self._last
        start = len(tokens)
        tokens.extend(new)
        for end in range(start + 1, len(tokens) + 1):
            if end < 2:
                prev.append(0)  # no bigram ends before position 1
                continue
            key = tokens[end - 2] << 32 | tokens[end - 1]
            prev.append(last.get(key, 0))
            last[key] = end

    def truncate(self, length: int) -> None:
        """Drop tokens from ``length`` on. Positions are chained in order, so each dropped one is
        its bigram's last: the one before it becomes the last again."""
        tokens, prev, last = self.tokens, self._prev, self._last
        for end in range(len(tokens), max(length, 1), -1):
            key = tokens[end - 2] << 32 | tokens[end - 1]
            if prev[end]:
                last[key] = prev[end]
            else:
                del last[key]
        del tokens[length:]
        del prev[length + 1:]

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
