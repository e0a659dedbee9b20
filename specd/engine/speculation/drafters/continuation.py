"""The rest of the document's previous suggestion as a drafter: while the user types through a
suggestion, its rest is the best possible draft. It drafts only while the output agrees with it
and is dropped once it proposes nothing."""

from __future__ import annotations

from typing import Sequence

from specd.engine.lookup import MAX_N
from specd.engine.speculation.drafters.base import EMPTY, Draft, Drafter, DrafterInputs


class ContinuationDrafter(Drafter):
    """The document's previous completion minus what the user typed since: it proposes only while
    the output so far agrees with it; the first rejection ends it."""

    source = "lookup:previous"
    # Once its first token stands (the user typed what was suggested), the rest is the target's
    # own greedy from nearly the same prompt and stands nearly always: priced so, it is drafted
    # long from its first use, where a per-token coin toss would cut it to a token or two on a
    # CPU whose rows cost most of a step (and a one-token draft never measures ``then``).
    priors = {source: (0.9, 0.98)}
    ends_when_empty = True

    def __init__(self, prompt_length: int, tokens: list[int]):
        self.prompt_length = prompt_length
        self.tokens = tokens

    @classmethod
    def for_request(cls, inputs: DrafterInputs) -> "ContinuationDrafter | None":
        previous = inputs.previous() if inputs.use_lookup else None
        return cls(*previous) if previous is not None else None

    def propose(self, seq: Sequence[int], k: int) -> Draft:
        done = len(seq) - self.prompt_length
        if done >= len(self.tokens) or list(seq[self.prompt_length:]) != self.tokens[:done]:
            return EMPTY
        return Draft(self.tokens[done:done + k], self.source, None, MAX_N)
