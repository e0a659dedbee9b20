"""The speculative loop: draft, verify in one target forward, accept/reject, roll back.

Invariant between steps: the target's KV cache holds ``seq[:-1]``; ``seq[-1]`` is pending, so
each step runs ``[seq[-1], d_1 .. d_k]`` through the target and gets k + 1 next-token
distributions at once (the last prompt token rides along with the first step).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from specd.engine.drafters import EMPTY, ContinuationDrafter, Draft, LookupDrafter, ModelDrafter
from specd.engine.kvcache import KVState
from specd.engine.sampling import SamplingParams, probabilities
from specd.engine.types import Cancelled, SourceStats

LOOKUP_TRUSTED_NGRAM = 3  # a lookup match this long beats the draft model outright
LOOKUP_MIN_RATE = 0.35  # below this acceptance rate, shorter lookup matches yield to the model


@dataclass
class AdaptiveLength:
    """Draft length per source: grow after a fully accepted draft, shrink after a rejection."""

    current: int
    maximum: int

    def update(self, proposed: int, accepted: int) -> None:
        if proposed and accepted == proposed:
            self.current = min(self.maximum, self.current + 2)
        elif proposed:
            self.current = max(1, min(self.current - 1, accepted + 1))


@dataclass
class DraftPlanner:
    """Per step, the source most likely to be accepted: a trusted lookup match, else the draft
    model, else a weaker lookup match. Counts proposals and acceptances per source."""

    lookup: LookupDrafter | None
    model: ModelDrafter | None
    model_length: AdaptiveLength
    lookup_length: AdaptiveLength
    continuation: ContinuationDrafter | None = None
    stats: dict[str, SourceStats] = field(default_factory=dict)
    lookup_rate: float = 0.6  # running acceptance rate of lookup drafts

    def propose(self, seq: Sequence[int], room: int) -> Draft:
        if room <= 0:
            return EMPTY
        if self.continuation is not None:
            draft = self.continuation.propose(seq, room)
            if draft.tokens:
                return draft
            self.continuation = None  # diverged or used up: it never proposes again
        match = self.lookup.propose(seq, min(room, self.lookup_length.current)) if self.lookup else EMPTY
        if match.tokens and (match.ngram >= LOOKUP_TRUSTED_NGRAM or self.model is None
                             or self.lookup_rate >= LOOKUP_MIN_RATE):
            return match
        if self.model is not None:
            return self.model.propose(seq, min(room, self.model_length.current))
        return match

    def record(self, draft: Draft, accepted: int) -> None:
        if not draft.tokens:
            return
        stats = self.stats.setdefault(draft.source, SourceStats())
        stats.proposed += len(draft)
        stats.accepted += accepted
        stats.steps += 1
        if draft.source == ModelDrafter.source:
            self.model_length.update(len(draft), accepted)
        elif draft.source != ContinuationDrafter.source:
            self.lookup_length.update(len(draft), accepted)
            self.lookup_rate = 0.8 * self.lookup_rate + 0.2 * (accepted / len(draft))


def verify(logits: torch.Tensor, draft: Draft, sampling: SamplingParams,
           generator: torch.Generator | None) -> tuple[int, int]:
    """Accepted draft count n and the target's own next token after them.

    logits: [k + 1, V]; row i is the target's distribution for the token after draft[:i].
    """
    k = len(draft)
    if sampling.greedy:
        # Greedy: a draft token stands iff it is the target's argmax; the first mismatch is
        # replaced by the argmax, and if all stand the last row gives a bonus token.
        choice = logits.argmax(-1).tolist()
        n = 0
        while n < k and choice[n] == draft.tokens[n]:
            n += 1
        return n, choice[n]
    p = probabilities(logits, sampling)  # [k + 1, V]
    for i, token in enumerate(draft.tokens):
        # Speculative sampling: accept d with probability min(1, p(d) / q(d)); on rejection
        # draw from norm(max(0, p - q)). A lookup draft is a point mass: q(d) = 1, so accept
        # with p(d), and the residual is p with d removed.
        q_token = draft.probs[i, token].item() if draft.probs is not None else 1.0
        u = torch.rand((), generator=generator).item()
        if u < min(1.0, p[i, token].item() / q_token):
            continue
        if draft.probs is not None:
            residual = (p[i] - draft.probs[i]).clamp(min=0.0)
        else:
            residual = p[i].clone()
            residual[token] = 0.0
        if residual.sum() <= 0:  # p == q up to rounding: any draw from p is right
            residual = p[i]
        return i, int(torch.multinomial(residual / residual.sum(), 1, generator=generator))
    return k, int(torch.multinomial(p[k], 1, generator=generator))


@dataclass
class DecodeOutcome:
    tokens: list[int]
    stop_reason: str
    target_forwards: int
    first_token_s: float


def speculative_decode(
    target: KVState,
    seq: list[int],
    planner: DraftPlanner,
    sampling: SamplingParams,
    max_tokens: int,
    stop: Callable[[int], str | None],
    deadline: float,
    cancel: threading.Event | None = None,
    generator: torch.Generator | None = None,
) -> DecodeOutcome:
    """Generate after ``seq`` (whose last token is pending; the target holds ``seq[:-1]``).

    ``stop(token)`` sees each new token in order and returns a reason to stop, or None.
    """
    start = time.monotonic()
    first_token_s = 0.0
    out: list[int] = []
    forwards = 0
    while True:
        if cancel is not None and cancel.is_set():
            raise Cancelled("completion cancelled")
        if out and time.monotonic() > deadline:
            return DecodeOutcome(out, "time_budget", forwards, first_token_s)
        room = max_tokens - len(out) - 1  # one token of each step is the target's own
        draft = planner.propose(seq, room)
        logits = target.extend([seq[-1], *draft.tokens])  # [k + 1, V], one forward
        forwards += 1
        accepted, own = verify(logits, draft, sampling, generator)
        target.rollback(len(seq) + accepted)  # keep seq[-1] and the accepted drafts
        planner.record(draft, accepted)
        new = [*draft.tokens[:accepted], own]
        if not out:
            first_token_s = time.monotonic() - start
        seq.extend(new)
        for token in new:
            reason = stop(token)
            if reason is not None:
                if reason != "eos":
                    out.append(token)
                return DecodeOutcome(out, reason, forwards, first_token_s)
            out.append(token)
            if len(out) >= max_tokens:
                return DecodeOutcome(out, "max_tokens", forwards, first_token_s)
