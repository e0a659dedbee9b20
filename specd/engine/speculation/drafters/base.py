"""What every drafter shares: the draft types (``Draft``, ``DraftTree``, ``EMPTY``), the
``Drafter`` protocol (everything the planner asks of a drafter, with defaults), the cost model
inputs of a drafter that runs a model (``DraftingCost``), and what the engine hands the
registry's factories for one request (``DrafterInputs``).

A drafter proposes tokens; the target verifies them. ``propose(seq, k) -> Draft``: up to k tokens
to follow ``seq``. ``Draft.probs`` holds the drafter's distribution q for each token (the draft
model), or None for a deterministic proposal (prompt lookup), which the verifier treats as a point
mass. The planner and the loop never branch on a drafter's type or source: what differs between
drafters is declared here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, ClassVar, Mapping, NamedTuple, Protocol, Sequence

import torch

from specd.engine.caches import DocumentState, KVState, common_prefix
from specd.engine.lookup import NgramIndex
from specd.engine.options import EngineOptions
from specd.engine.speculation.healing import Constraint
from specd.engine.speculation.sampling import SamplingParams

Prior = tuple[float, float]  # (first, then): acceptance of a draft's first token, and of each later one


@dataclass
class Draft:
    tokens: list[int]
    source: str  # who proposed it: what stats() counts it under
    probs: torch.Tensor | None = None  # q: [len(tokens), V], None = deterministic
    ngram: int = 0  # lookup: length of the matched n-gram
    repeat: bool = False  # lookup: the context repeats itself (``lookup.Match.repeat``)
    kind: str = ""  # its acceptance bucket (its drafter's ``kind``): set by the planner, priced and learnt under
    # Tokens the planner asked a priced drafter for (0: not asked, cut by the planner). A drafter
    # may stop short (the draft model below its confidence); the planner learns the shortfall as
    # tokens that did not stand, so a chain is priced at what it delivers, not at what was asked.
    asked: int = 0

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


class DraftingCost(Protocol):
    """Cost model inputs of a drafter whose drafting runs forwards of a model: the planner prices
    a chain before it is drafted (``ForwardCosts.draft_ms``: per forward, and per token the
    model's cache must catch up on) and measures the forwards it took after."""

    kind: str  # the acceptance bucket its chains are priced under before they exist

    def catch_up(self, seq: Sequence[int]) -> int:
        """Tokens of ``seq`` the model's cache lacks: run before its first drafted token."""
        ...

    @property
    def forwards(self) -> int:
        """Forwards the model has run so far (a counter: the planner reads it before and after)."""
        ...

    @property
    def recordings(self) -> int:
        """CUDA graphs recorded so far: a drafting that recorded one is no measure of its cost."""
        ...


class _Compared(NamedTuple):
    """What ``KVCost.catch_up`` last compared: the list, its length and last token then, the
    state's forwards and length then, and how many leading tokens the two shared."""

    seq: Sequence[int]
    length: int
    last: int | None
    state: tuple[int, int]
    shared: int


class KVCost:
    """``DraftingCost`` of a drafter that runs forwards on a ``KVState``."""

    def __init__(self, kind: str, state: KVState):
        self.kind = kind
        self.state = state
        self._compared: _Compared | None = None

    def catch_up(self, seq: Sequence[int]) -> int:
        """Asked every step with the decode loop's one growing list: while the state has not
        moved since, and what they shared ended before the list's old end or at the state's, it
        is what they share now, and the thousands of tokens before it are not compared again."""
        state, was = (self.state.forwards, len(self.state.ids)), self._compared
        if was is not None and was.seq is seq and len(seq) >= was.length and was.state == state \
                and (was.length == 0 or seq[was.length - 1] == was.last) \
                and (was.shared < was.length or was.shared == len(self.state.ids)):
            shared = was.shared
        else:
            shared = common_prefix(self.state.ids, seq)
        self._compared = _Compared(seq, len(seq), seq[-1] if seq else None, state, shared)
        return len(seq) - shared

    @property
    def forwards(self) -> int:
        return self.state.forwards

    @property
    def recordings(self) -> int:
        return self.state.recordings


class Drafter(Protocol):
    """Everything the planner asks of a drafter. Drafters subclass it for the defaults: a drafter
    that costs nothing to ask, proposes one draft per step, and whose drafts are of one kind, its
    source.

    Per step, the planner first asks every drafter whose ``cost`` is None (an index look-up: asking
    costs nothing) for up to ``longest`` tokens, prices each draft by its ``kind``'s acceptance
    and cuts it to its best length; then it prices the chain of each drafter with a ``cost`` (a
    model's forwards) before drafting, and runs it only when it pays."""

    priors: ClassVar[Mapping[str, Prior]] = {}  # its kinds -> acceptance before anything is measured
    longest: int | None = None  # most tokens in one draft (None: as many as the completion has room for)
    ends_when_empty: bool = False  # drafts only while the output agrees with it: dropped the first step it proposes nothing
    cost: DraftingCost | None = None  # None: asking costs nothing; else what drafting k tokens costs

    @staticmethod
    def kind(draft: Draft) -> str:
        """The acceptance bucket ``draft`` is priced and learnt under (one of ``priors``' keys)."""
        return draft.source

    def propose(self, seq: Sequence[int], k: int) -> Draft:
        """Up to k tokens to follow ``seq`` (``EMPTY``: none)."""
        ...

    def propose_all(self, seq: Sequence[int], k: int) -> list[Draft]:
        """Every candidate it has, best (``propose``'s) first: what a token tree may verify side by
        side. One unless the drafter offers several."""
        return [self.propose(seq, k)]


@dataclass(frozen=True)
class DrafterInputs:
    """What the engine has for one request, for the registry's factories to build drafters from.
    The callables are asked only by a factory that builds (they may encode text)."""

    state: DocumentState  # the document's KV states (target, draft), context index, recent completions
    options: EngineOptions  # lookup_max, draft_max
    draft_confidence: float  # where the draft model stops a chain (the option, or measured at load)
    sampling: SamplingParams
    generator: torch.Generator | None
    vocab_size: int  # the target's: a drafting distribution must index the same token ids
    use_lookup: bool
    use_draft: bool  # ... and the pair has a draft model
    lookup_sources: Callable[[], list[tuple[str, NgramIndex]]]  # other open buffers', the workspace's, in priority order
    previous: Callable[[], tuple[int, list[int]] | None]  # the last suggestion's rest after what was typed: (prompt length, tokens)
    constraint: Constraint | None = None  # token healing's, which the target's first tokens obey (drafts may too)
    prompt_length: int = 0  # tokens of the prompt: what follows them in a drafter's ``seq`` is the output


DrafterFactory = Callable[[DrafterInputs], "Drafter | None"]  # a registry entry: None where it has nothing to draft
