"""Drafters propose tokens; the target verifies them. One interface, no branching on type.

``propose(seq, k) -> Draft``: up to k tokens to follow ``seq``. ``Draft.probs`` holds the
drafter's distribution q for each token (the draft model), or None for a deterministic
proposal (prompt lookup), which the verifier treats as a point mass.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import torch

from specd.engine.caches import KVState
from specd.engine.lookup import MAX_N, NgramIndex, candidates, lookup
from specd.engine.speculation.sampling import SamplingParams, probabilities, sample


@dataclass
class Draft:
    tokens: list[int]
    source: str
    probs: torch.Tensor | None = None  # q: [len(tokens), V], None = deterministic
    ngram: int = 0  # lookup: length of the matched n-gram
    repeat: bool = False  # lookup: the context repeats itself (``lookup.Match.repeat``)

    def __len__(self) -> int:
        return len(self.tokens)


EMPTY = Draft([], "none")


@dataclass
class DraftTree:
    """Drafts verified side by side in one target forward (token-tree verification): a trie of
    their tokens under the pending token. ``tokens[i]`` is node i, ``parents[i]`` its parent node
    (-1: the pending token); drafts that share a prefix share its nodes. ``branches`` are the
    drafts, the planner's first choice first."""

    tokens: list[int]
    parents: list[int]
    branches: list[Draft]

    @classmethod
    def of(cls, branches: Sequence[Draft]) -> "DraftTree":
        tokens: list[int] = []
        parents: list[int] = []
        children: dict[tuple[int, int], int] = {}  # (parent, token) -> node
        for draft in branches:
            node = -1
            for token in draft.tokens:
                child = children.get((node, token))
                if child is None:
                    child = children[(node, token)] = len(tokens)
                    tokens.append(token)
                    parents.append(node)
                node = child
        return cls(tokens, parents, list(branches))

    def __len__(self) -> int:
        return len(self.tokens)

    def children(self) -> dict[int, dict[int, int]]:
        """node (-1: the pending token) -> {token: child node}."""
        out: dict[int, dict[int, int]] = {}
        for node, (token, parent) in enumerate(zip(self.tokens, self.parents)):
            out.setdefault(parent, {})[token] = node
        return out

    def offers(self) -> dict[int, list[tuple[int, int, torch.Tensor | None]]]:
        """node -> the drafts offered after it, in branch order, as (child node, token, q):
        q is the drafting distribution the token was drawn from (a draft-model branch), or None
        for a point mass (lookup; offered once per node and token, a second would never stand)."""
        children = self.children()
        out: dict[int, list[tuple[int, int, torch.Tensor | None]]] = {}
        seen: set[tuple[int, int]] = set()
        for draft in self.branches:
            node = -1
            for depth, token in enumerate(draft.tokens):
                child = children[node][token]
                if draft.probs is not None:
                    out.setdefault(node, []).append((child, token, draft.probs[depth]))
                elif (node, token) not in seen:
                    seen.add((node, token))
                    out.setdefault(node, []).append((child, token, None))
                node = child
        return out
SUGGESTED = "lookup:suggested"  # lookup's source for matches in the document's recent completions


class Drafter(Protocol):
    def propose(self, seq: Sequence[int], k: int) -> Draft: ...


class LookupDrafter:
    """Longest n-gram match of the context's tail: the context itself (the current document's
    prompt plus what has been generated; its matches may run periodic, ``NgramIndex.continuation``),
    then whatever else the engine passes in priority order: this document's recent completions
    (``lookup:suggested``), other open buffers, the workspace corpus."""

    def __init__(self, context_index: NgramIndex, others: Sequence[tuple[str, NgramIndex]]):
        self.context_index = context_index
        self.others = list(others)

    def propose(self, seq: Sequence[int], k: int) -> Draft:
        self.context_index.sync(seq)  # incremental: only the newly accepted tokens are indexed
        match = lookup(seq, k, [("lookup:current", self.context_index), *self.others],
                       holding_tail=self.context_index)
        if match is None:
            return EMPTY
        return Draft(match.tokens, match.source, None, match.ngram, match.repeat)

    def propose_all(self, seq: Sequence[int], k: int) -> list[Draft]:
        """Every source's match (``propose``'s first), for a token tree."""
        self.context_index.sync(seq)
        matches = candidates(seq, k, [("lookup:current", self.context_index), *self.others],
                             holding_tail=self.context_index)
        return [Draft(m.tokens, m.source, None, m.ngram, m.repeat) for m in matches]


class ContinuationDrafter:
    """The document's previous completion minus what the user typed since: while the user types
    through a suggestion, its rest is the best possible draft. It proposes only while the output
    so far agrees with it; the first rejection ends it."""

    source = "lookup:previous"

    def __init__(self, prompt_length: int, tokens: list[int]):
        self.prompt_length = prompt_length
        self.tokens = tokens

    def propose(self, seq: Sequence[int], k: int) -> Draft:
        done = len(seq) - self.prompt_length
        if done >= len(self.tokens) or list(seq[self.prompt_length:]) != self.tokens[:done]:
            return EMPTY
        return Draft(self.tokens[done:done + k], self.source, None, MAX_N)


class ModelDrafter:
    """Chain from the draft model; stops early when its confidence (the top probability of its
    next-token distribution, known before the draw) falls below a threshold."""

    source = "draft"

    def __init__(self, state: KVState, vocab_size: int, sampling: SamplingParams, confidence: float,
                 generator: torch.Generator | None = None):
        self.state = state
        self.vocab_size = vocab_size  # the target's: q must index the same token ids as p
        self.sampling = sampling
        self.confidence = confidence
        self.generator = generator

    def _fit_vocab(self, q: torch.Tensor) -> torch.Tensor:
        if q.shape[-1] == self.vocab_size:
            return q
        if q.shape[-1] > self.vocab_size:
            q = q[..., : self.vocab_size]
            return q / q.sum(-1, keepdim=True)
        return torch.nn.functional.pad(q, (0, self.vocab_size - q.shape[-1]))

    def propose(self, seq: Sequence[int], k: int) -> Draft:
        if k <= 0:
            return EMPTY
        logits = self.state.logits_after(seq)  # [1, V]
        tokens: list[int] = []
        probs: list[torch.Tensor] = []
        while True:
            q = self._fit_vocab(probabilities(logits[-1], self.sampling))  # [V]
            # Stop on q alone, before drawing: a cut that depended on the drawn token would
            # skew the drafted tokens away from q, and verification divides by q (not lossless).
            # Greedy draws the argmax, so this is the argmax's confidence there, as before.
            if tokens and q.max().item() < self.confidence:
                break
            token = sample(q, self.sampling, self.generator)
            tokens.append(token)
            probs.append(q)
            if len(tokens) == k:
                break
            logits = self.state.extend([token], last_only=True)
        return Draft(tokens, self.source, torch.stack(probs))
