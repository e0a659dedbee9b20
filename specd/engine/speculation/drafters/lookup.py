"""Prompt lookup as a drafter: the longest n-gram match of the context's tail, in the current
context first, then this document's recent completions, other open buffers and the workspace.
Asking costs nothing (an incremental index, no model); every source's match is a candidate for a
token tree; a draft's kind says how far it is trusted (where it comes from, how long a match)."""

from __future__ import annotations

from typing import Sequence

from specd.engine.lookup import MAX_N, NgramIndex, candidates, lookup
from specd.engine.options import EngineOptions
from specd.engine.speculation.drafters.base import EMPTY, Draft, Drafter, DrafterInputs

CURRENT = "lookup:current"  # matches in the context itself (the prompt plus what has been generated)
SUGGESTED = "lookup:suggested"  # matches in the document's recent completions
TRUSTED_NGRAM = 3  # matches this long are their own kind of draft (they stand far more often)
# A repeat as long as matches go (``MAX_N``: the tail's whole 5-gram seen a period back) is a
# kind apart from a 3-4-token one: on two pairs over the four bench workloads, once its first
# token stood its next ones stood far more often (docs/engine.md, "Planning each step"; ``kind``).
LONG_REPEAT_NGRAM = MAX_N


class LookupDrafter(Drafter):
    """Longest n-gram match of the context's tail: the context itself (the current document's
    prompt plus what has been generated; its matches may run periodic, ``NgramIndex.continuation``),
    then whatever else the engine passes in priority order: this document's recent completions
    (``lookup:suggested``), other open buffers, the workspace corpus."""

    priors = {  # measured on the development pairs, see ``kind``
        "lookup/repeat": (0.9, 0.95),
        "lookup/repeat/mid": (0.75, 0.85),
        "lookup/repeat/short": (0.4, 0.85),
        "lookup/suggested": (0.7, 0.85),
        "lookup/suggested/short": (0.3, 0.8),
        "lookup/trusted": (0.5, 0.7),
        "lookup/short": (0.3, 0.6),
    }

    def __init__(self, context_index: NgramIndex, others: Sequence[tuple[str, NgramIndex]],
                 longest: int = EngineOptions.lookup_max):
        self.context_index = context_index
        self.others = list(others)
        self.longest = longest
        self._synced: tuple[list[int], int] | None = None  # the context last synced, and the index's changes then

    @classmethod
    def for_request(cls, inputs: DrafterInputs) -> "LookupDrafter | None":
        if not inputs.use_lookup:
            return None
        suggested = [(SUGGESTED, index) for index in inputs.state.suggestions]
        return cls(inputs.state.context_index, suggested + inputs.lookup_sources(), inputs.options.lookup_max)

    @staticmethod
    def kind(draft: Draft) -> str:
        """By where the match comes from and how long a match (n-gram) it rests on. Measured on the
        development pairs (every candidate's proposal against what the target wrote, edit_replay
        and line): a match where the context repeats itself has its first token stand most often,
        then one in the document's recent completions, then any other match, and a 2-token match
        far less often than a longer one. A repeat's later tokens depend on how much of the tail
        repeats: on the real-shaped stand-in in Q8_0 and on the demo pair (all four workloads), a
        5-token match's stood more often than a 3-token one's. One kind for both priced a 3-token
        repeat's chain as a 5-token one's, and on a path where a wide verify costs several steps
        its failures cost more than the rest gained (docs/engine.md, "Planning each step", has the
        rates)."""
        short = draft.ngram < TRUSTED_NGRAM
        if draft.repeat:
            if short:
                return "lookup/repeat/short"
            return "lookup/repeat" if draft.ngram >= LONG_REPEAT_NGRAM else "lookup/repeat/mid"
        if draft.source == SUGGESTED:
            return "lookup/suggested/short" if short else "lookup/suggested"
        return "lookup/short" if short else "lookup/trusted"

    def _sync(self, seq: Sequence[int]) -> None:
        """The context index to ``seq``. The decode loop asks with one list that only grows
        between its steps: when that list comes again and nothing else touched the index since,
        the new tokens are appended without comparing the thousands before them (``sync``'s
        check costs a small model's step or a good part of one at a few thousand tokens:
        docs/engine.md)."""
        index = self.context_index
        held = len(index)
        if self._synced is not None and self._synced[0] is seq and self._synced[1] == index.changes \
                and len(seq) >= held and (held == 0 or seq[held - 1] == index.tokens[-1]):
            if len(seq) > held:
                index.extend(seq[held:])
        else:
            index.sync(seq)  # incremental: only what differs from what it holds is redone
        self._synced = (seq, index.changes)

    def propose(self, seq: Sequence[int], k: int) -> Draft:
        self._sync(seq)
        match = lookup(seq, k, [(CURRENT, self.context_index), *self.others], holding_tail=self.context_index)
        if match is None:
            return EMPTY
        return Draft(match.tokens, match.source, None, match.ngram, match.repeat)

    def propose_all(self, seq: Sequence[int], k: int) -> list[Draft]:
        """Every source's match (``propose``'s first), for a token tree."""
        self._sync(seq)
        matches = candidates(seq, k, [(CURRENT, self.context_index), *self.others], holding_tail=self.context_index)
        return [Draft(m.tokens, m.source, None, m.ngram, m.repeat) for m in matches]
