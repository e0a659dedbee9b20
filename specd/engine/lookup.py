"""Prompt lookup: an incremental n-gram index over token sequences. Pure Python, no model.

Each ``NgramIndex`` keys every bigram of its token list to the positions just after it (a
compact ``array``, increasing). A lookup takes the candidates of the tail's bigram, most recent
first, and extends each match backwards up to ``MAX_N`` tokens; the longest wins. Memory is
about 4 bytes per token plus one entry per distinct bigram, so whole workspaces fit. Appending
and truncating touch only the changed tail: no rescans.
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
        self._ends: dict[tuple[int, int], array] = {}
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, new: Iterable[int]) -> None:
        tokens = self.tokens
        start = len(tokens)
        tokens.extend(new)
        ends = self._ends
        for end in range(max(start, 1) + 1, len(tokens) + 1):
            key = (tokens[end - 2], tokens[end - 1])
            positions = ends.get(key)
            if positions is None:
                ends[key] = array("l", (end,))
            else:
                positions.append(end)

    def truncate(self, length: int) -> None:
        """Drop tokens from ``length`` on. Positions are appended in order, so each pop is the last."""
        tokens = self.tokens
        for end in range(len(tokens), max(length, 1), -1):
            key = (tokens[end - 2], tokens[end - 1])
            positions = self._ends[key]
            positions.pop()
            if not positions:
                del self._ends[key]
        del tokens[length:]

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
        positions = self._ends.get((tail[-2], tail[-1]))
        if not positions:
            return -1, 0
        tokens, size = self.tokens, len(self.tokens)
        longest = min(self.max_n, len(tail))
        best_end, best_n = -1, 0
        examined = 0
        for i in range(len(positions) - 1, -1, -1):
            end = positions[i]
            if end >= size:  # the tail itself: nothing follows it
                continue
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
