"""The speculative loop: draft, verify in one target forward, accept/reject, roll back.

Invariant between steps: the target's KV cache holds ``seq[:-1]``; ``seq[-1]`` is pending, so
each step runs ``[seq[-1], d_1 .. d_k]`` through the target and gets k + 1 next-token
distributions at once (the last prompt token rides along with the first step; so may a
keystroke's few new prompt tokens before it, whose rows are never read: one forward to the first
token instead of a prefill and a step). Where the planner builds a token tree (on a forward path
that runs trees), the step runs ``[seq[-1], tree nodes]`` instead and keeps the path that stood
(``KVState.keep``).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence

import torch

from specd.engine.speculation.costs import Acceptance, ForwardCosts
from specd.engine.speculation.drafters import EMPTY, SUGGESTED, ContinuationDrafter, Draft, DraftTree, LookupDrafter, ModelDrafter
from specd.engine.caches import KVState, Rows, common_prefix
from specd.engine.speculation.sampling import SamplingParams, probabilities
from specd.engine.types import Cancelled, SourceStats

PROBE_EVERY = 24  # steps without the draft model after which it is tried once, so its estimate can recover
PROBE_CATCH_UP = 64  # ... if catching it up costs at most this many tokens
PROBE_LENGTH = 4  # tokens of a lookup match tried after PROBE_EVERY steps of passing matches over
TRUSTED_NGRAM = 3  # lookup matches this long are their own kind of draft (they stand far more often)
TREE_BRANCHES = 3  # most drafts a token tree verifies side by side
MERGED_PREFILL = 64  # most prompt tokens the first step runs before its draft (a keystroke's, see Engine._complete)
TREE = "tree"  # SourceStats of token trees: steps, branches beyond the first (proposed), and won (accepted)
CONTESTED = "/contested"  # a kind's acceptance where another source's draft starts with another token ...
RIVAL = "/rival"  # ... and that of the other source's draft there (measured on every such step, tree or not)

PRIORS = {  # (first, then): acceptance of a draft's first token, and of each later one, before anything is measured
    ContinuationDrafter.source: (0.9, 0.9),
    "lookup/repeat": (0.8, 0.9),
    "lookup/repeat/short": (0.4, 0.85),
    "lookup/suggested": (0.7, 0.85),
    "lookup/suggested/short": (0.3, 0.8),
    "lookup/trusted": (0.5, 0.7),
    "lookup/short": (0.3, 0.6),
    ModelDrafter.source: (0.5, 0.5),
}


def draft_kind(draft: Draft) -> str:
    """The acceptance bucket a draft belongs to: lookup matches by where they come from and by
    how long a match (n-gram) they rest on. Measured on the development pairs (every candidate's
    proposal against what the target wrote, edit_replay and line): a match where the context
    repeats itself has its first token stand 89-100% of the time on 3+ tokens (30-53% on 2), one
    in the document's recent completions 46-100% (22-33%), any other match 19-83% (29-42%)."""
    if not draft.source.startswith("lookup:") or draft.source == ContinuationDrafter.source:
        return draft.source
    short = draft.ngram < TRUSTED_NGRAM
    if draft.repeat:
        return "lookup/repeat/short" if short else "lookup/repeat"
    if draft.source == SUGGESTED:
        return "lookup/suggested/short" if short else "lookup/suggested"
    return "lookup/short" if short else "lookup/trusted"


@dataclass
class PlannerMemory:
    """What the planner learns across requests, per loaded pair: costs and acceptance."""

    costs: ForwardCosts = field(default_factory=ForwardCosts)
    acceptance: dict[str, Acceptance] = field(default_factory=dict)
    steps_since_model: int = 0
    steps_since_lookup: int = 0  # steps a lookup match was found and not drafted

    def of(self, kind: str) -> Acceptance:
        if kind not in self.acceptance:
            base = kind.removesuffix(CONTESTED).removesuffix(RIVAL)
            self.acceptance[kind] = Acceptance.prior(*PRIORS.get(base, (0.3, 0.5)))
        return self.acceptance[kind]


@dataclass
class DraftPlanner:
    """Per step, the draft that maximises expected tokens per millisecond: none, the rest of the
    previous suggestion, a lookup match, or a draft-model chain, each cut to its best length.

    rate(draft of k tokens) = (1 + E[accepted | k]) / (step_ms(k + 1) + drafting ms), where a
    step pays for the rows of logits it reads (1 + accepted) when they are computed on demand;
    a plain step is rate 1 / step_ms(1). The draft model's catch-up (tokens its cache lacks) is spread
    over the steps the rest of the completion should take. Counts proposals and acceptances per
    source for reporting.
    """

    memory: PlannerMemory
    lookup: LookupDrafter | None = None
    model: ModelDrafter | None = None
    continuation: ContinuationDrafter | None = None
    lookup_max: int = 16
    draft_max: int = 8
    trees: bool = False  # may verify several drafts as a token tree (a forward path that runs trees)
    stats: dict[str, SourceStats] = field(default_factory=dict)
    # This step's contest, when another source's draft started with another token than the
    # chosen one: (kind + CONTESTED, its first token), and each rival's (kind + RIVAL, first token)
    contest: list[tuple[str, int]] = field(default_factory=list)

    def _best_length(self, kind: str, available: int, extra_ms: Callable[[int], float]) -> tuple[int, float]:
        acceptance, costs = self.memory.of(kind), self.memory.costs
        first, then = acceptance.first, min(acceptance.then, 0.999)
        best_k, best_rate = 0, 0.0
        later, power = 0.0, 1.0  # acceptance.expected_after_first(k), summed as k grows
        for k in range(1, available + 1):
            tokens = 1.0 + first * (1.0 + later)  # 1 + acceptance.expected(k): also the rows read
            rate = tokens / (costs.step_ms(k + 1, tokens) + extra_ms(k))
            if rate > best_rate:
                best_k, best_rate = k, rate
            power *= then
            later += power
        return best_k, best_rate

    def propose(self, seq: Sequence[int], room: int) -> Draft | DraftTree:
        if room <= 0:
            return EMPTY
        best, best_rate = EMPTY, 1.0 / self.memory.costs.step_ms(1, 1)
        candidates: list[Draft] = []
        if self.continuation is not None:
            draft = self.continuation.propose(seq, room)
            if draft.tokens:
                candidates.append(draft)
            else:
                self.continuation = None  # diverged or used up: it never proposes again
        alternatives = list(candidates)  # what a token tree may add beside the chosen draft
        if self.lookup is not None:
            k = min(room, self.lookup_max)
            matches = self.lookup.propose_all(seq, k) if self.trees else [self.lookup.propose(seq, k)]
            candidates.append(matches[0] if matches else EMPTY)
            alternatives += matches
        unchosen = []
        probe = None
        for draft in candidates:
            if draft.tokens:
                kind = draft_kind(draft)
                k, rate = self._best_length(kind, len(draft), lambda k: 0.0)
                unchosen.append(kind)
                if rate > best_rate:
                    best, best_rate = dataclasses.replace(draft, tokens=draft.tokens[:k]), rate
                elif probe is None:
                    probe = dataclasses.replace(draft, tokens=draft.tokens[:PROBE_LENGTH])
        if best.tokens:
            self.memory.steps_since_lookup = 0
        elif probe is not None:
            # Matches keep being passed over: try one short one now and then, so its acceptance
            # and the cost of a verify that wide are measured again (both may be stale).
            self.memory.steps_since_lookup += 1
            if self.memory.steps_since_lookup >= PROBE_EVERY:
                self.memory.steps_since_lookup = 0
                best = probe
        if self.model is not None:
            catch_up = len(seq) - common_prefix(self.model.state.ids, seq)
            k = self._model_length(catch_up, room, best_rate)
            if k:
                self._relax(unchosen)
                self.memory.steps_since_model = 0
                state = self.model.state
                started, forwards, recordings = time.perf_counter(), state.forwards, state.recordings
                draft = self.model.propose(seq, k)
                if state.recordings == recordings:  # a step that recorded a CUDA graph first is no measure
                    self.memory.costs.record_draft(catch_up, state.forwards - forwards,
                                                   (time.perf_counter() - started) * 1000)
                return self._tree(draft, alternatives)
            self.memory.steps_since_model += 1
            unchosen.append(ModelDrafter.source)
        self._relax([kind for kind in unchosen if not best.tokens or kind != draft_kind(best)])
        return self._tree(best, alternatives)

    def _tree(self, chosen: Draft, alternatives: list[Draft]) -> Draft | DraftTree:
        """``chosen``, or a token tree of it and the alternatives (other sources' drafts) that
        raise the expected tokens per millisecond enough to pay for a wider forward, at most
        ``TREE_BRANCHES`` drafts. An alternative adds what it proposes from where it leaves the
        chosen draft (its first token, or one after a shared start), cut to its best length;
        where another branch already leaves at that point with that token, it adds nothing.

        Expected tokens: the chosen draft's as a chain, plus for each branch leaving it after m
        shared tokens, P(the chosen draft's first m stand) P(the branch's next token stands)
        (1 + its later tokens expected): that next-token probability is its kind's rate as a
        rival in a contest when it leaves at the first token (and the chosen draft's first token is
        then priced at its kind's contested rate), else its kind's ``then``; capped by what the
        branches leaving at the same point leave (only one token stands there)."""
        self.contest = []
        if not (self.trees and chosen.tokens and alternatives):
            return chosen
        rivals = {}
        for draft in alternatives:
            if draft.tokens and draft.tokens[0] != chosen.tokens[0]:
                rivals.setdefault(draft.tokens[0], draft_kind(draft) + RIVAL)
        costs = self.memory.costs
        main = self.memory.of(draft_kind(chosen))
        if rivals:
            # Where sources disagree, each is right less often than it is overall (often neither
            # is): the first tokens are priced as measured in such contests (``settle``).
            self.contest = [(draft_kind(chosen) + CONTESTED, chosen.tokens[0]),
                            *((kind, token) for token, kind in rivals.items())]
            contested = self.memory.of(self.contest[0][0])
            main = dataclasses.replace(main, first_hits=contested.first_hits, first_misses=contested.first_misses)
        tokens = 1.0 + main.expected(len(chosen))
        width = 1 + len(chosen)
        rate = tokens / costs.step_ms(width, tokens)
        branches, taken = [chosen], set()
        left = [1.0 - main.first] + [1.0 - main.then] * (len(chosen) - 1)  # per point of leaving
        for draft in alternatives:
            if len(branches) >= TREE_BRANCHES:
                break
            shared = common_prefix(draft.tokens, chosen.tokens)
            if shared >= min(len(draft), len(chosen)) or (shared, draft.tokens[shared]) in taken:
                continue
            acceptance = self.memory.of(draft_kind(draft))
            reach = 1.0 if shared == 0 else main.first * main.then ** (shared - 1)
            next_stands = self.memory.of(rivals[draft.tokens[0]]).first if shared == 0 else acceptance.then
            odds = min(next_stands, left[shared])
            best_k, best_rate = 0, rate
            for k in range(1, len(draft) - shared + 1):
                more = tokens + reach * odds * (1.0 + acceptance.expected_after_first(k))
                branch_rate = more / costs.step_ms(width + k, more)
                if branch_rate > best_rate:
                    best_k, best_rate = k, branch_rate
            if best_k:
                branches.append(dataclasses.replace(draft, tokens=draft.tokens[:shared + best_k]))
                taken.add((shared, draft.tokens[shared]))
                tokens += reach * odds * (1.0 + acceptance.expected_after_first(best_k))
                width += best_k
                rate = best_rate
                left[shared] -= odds
        return chosen if len(branches) == 1 else DraftTree.of(branches)

    def _relax(self, kinds: list[str]) -> None:
        """Kinds that could have drafted this step and did not: their estimates drift back
        toward the prior, so a kind switched off by a bad stretch is tried again later."""
        for kind in set(kinds):
            self.memory.of(kind).relax()

    def _model_length(self, catch_up: int, room: int, rate_to_beat: float) -> int:
        """Draft-model chain length worth running (its cache lacks ``catch_up`` tokens), or 0."""
        acceptance, costs = self.memory.of(ModelDrafter.source), self.memory.costs

        def drafting_ms(k: int) -> float:
            steps_left = max(1.0, room / (1.0 + acceptance.expected(k)))
            return costs.draft_ms(1, k) + costs.draft_ms(catch_up, 0) / steps_left

        k, rate = self._best_length(ModelDrafter.source, min(room, self.draft_max), drafting_ms)
        if rate > rate_to_beat:
            return k
        if self.memory.steps_since_model >= PROBE_EVERY and catch_up <= PROBE_CATCH_UP:
            return min(2, room)
        return 0

    def record(self, draft: Draft, accepted: int, ms: float | None = None, head_row_ms: float = 0.0) -> None:
        """After verification: ``accepted`` of the draft's tokens stood; the target forward (and
        verification) took ``ms`` besides the rows of logits computed on demand, ``head_row_ms``
        each (0: the rows came with the forward)."""
        if ms is not None:
            self.memory.costs.record_target(len(draft) + 1, ms)
        if head_row_ms > 0:
            self.memory.costs.record_head_row(head_row_ms)
        if not draft.tokens:
            return
        stats = self.stats.setdefault(draft.source, SourceStats())
        stats.proposed += len(draft)
        stats.accepted += accepted
        stats.steps += 1
        self.memory.of(draft_kind(draft)).record(len(draft), accepted)

    def settle(self, first: int) -> None:
        """After a step whose first new token was ``first`` (the target's): which side of this
        step's contest, if any, was right, whether it was verified as a tree or not (a rival
        left out would have stood iff its first token is the target's)."""
        for kind, token in self.contest:
            self.memory.of(kind).record(1, 1 if token == first else 0)
        self.contest = []

    def record_tree(self, tree: DraftTree, accepted: Sequence[int], ms: float | None = None,
                    head_row_ms: float = 0.0) -> None:
        """``record`` for a token tree whose path ``accepted`` (tokens) stood: each branch is
        recorded as the draft it is, with the tokens of it that stood; the forward as one of the
        tree's width. ``stats[TREE]``: trees, branches beyond the first, and how many trees a token
        off the first branch stood in."""
        if ms is not None:
            self.memory.costs.record_target(len(tree) + 1, ms)
        if head_row_ms > 0:
            self.memory.costs.record_head_row(head_row_ms)
        for draft in tree.branches:
            self.record(draft, common_prefix(draft.tokens, accepted))
        stats = self.stats.setdefault(TREE, SourceStats())
        stats.steps += 1
        stats.proposed += len(tree.branches) - 1
        stats.accepted += 1 if common_prefix(accepted, tree.branches[0].tokens) < len(accepted) else 0


class Constraint(Protocol):
    """Masks the target's logits (token healing): ``rows`` for a forward's rows [k + 1, V]
    after ``before`` + draft[:i], ``row`` for one row [V] after ``before``."""

    def rows(self, logits: torch.Tensor, before: Sequence[int], draft: Sequence[int]) -> torch.Tensor: ...
    def row(self, logits: torch.Tensor, before: Sequence[int]) -> torch.Tensor: ...


def _row(rows: Rows, i: int, constraint: Constraint | None, before: Sequence[int]) -> torch.Tensor:
    """Row i of the logits, masked by the constraint after ``before`` when there is one."""
    logits = rows.row(i)
    return logits if constraint is None else constraint.row(logits, before)


def _choice(rows: Rows, i: int, constraint: Constraint | None, before: Sequence[int]) -> int:
    """The target's greedy token at row i (under the constraint after ``before``)."""
    if constraint is None:
        return rows.argmax(i)
    return int(constraint.row(rows.row(i), before).argmax())


def _stands(p: torch.Tensor, token: int, q: torch.Tensor | None, generator: torch.Generator | None) -> bool:
    """One step of speculative sampling: a draft ``token`` drawn from q (None: a point mass,
    q(token) = 1) stands with probability min(1, p(token) / q(token))."""
    q_token = q[token].item() if q is not None else 1.0
    return torch.rand((), generator=generator).item() < min(1.0, p[token].item() / q_token)


def _rejected(p: torch.Tensor, token: int, q: torch.Tensor | None) -> torch.Tensor:
    """What p becomes once a draft ``token`` drawn from q was rejected: norm(max(0, p - q)); for a
    point mass, p with the token removed; p itself where that leaves nothing (p == q up to
    rounding: any draw from p is right)."""
    if q is not None:
        residual = (p - q).clamp(min=0.0)
    else:
        residual = p.clone()
        residual[token] = 0.0
    total = residual.sum()
    return p if total <= 0 else residual / total


def verify_greedy(rows: Rows, draft: Draft, out: Sequence[int],
                  constraint: Constraint | None = None) -> tuple[int, int]:
    """Greedy verification reading rows only as far as the draft stands: a draft token stands
    iff it is the target's argmax (under the constraint); the first mismatch is replaced by the
    argmax, and if all stand the last row gives a bonus token. Rows past the first mismatch are
    never computed (``LazyRows``)."""
    n, k = 0, len(draft)
    while True:
        choice = _choice(rows, n, constraint, [*out, *draft.tokens[:n]])
        if n == k or choice != draft.tokens[n]:
            return n, choice
        n += 1


def verify_tree_greedy(rows: Rows, tree: DraftTree, out: Sequence[int],
                       constraint: Constraint | None = None) -> tuple[list[int], int]:
    """``verify_greedy`` down a token tree (row 0: after the pending token; row i + 1: after
    node i): from the root, follow the child whose token is the target's argmax while there is
    one. Returns the path of nodes that stood and the target's own token after them; rows off the
    path are never computed."""
    children = tree.children()
    node, path, stood = -1, [], []
    while True:
        choice = _choice(rows, node + 1, constraint, [*out, *stood])
        child = children.get(node, {}).get(choice)
        if child is None:
            return path, choice
        path.append(child)
        stood.append(choice)
        node = child


def verify_tree(rows: Rows, tree: DraftTree, sampling: SamplingParams, generator: torch.Generator | None,
                out: Sequence[int], constraint: Constraint | None = None) -> tuple[list[int], int]:
    """Speculative sampling down a token tree: at each node, the drafts offered after it are
    tested in turn as SpecInfer's multi-draft rule tests them, each as one step of ``verify``:
    draft d drawn from q stands with probability min(1, p(d) / q(d)) under the current p, and if
    it does not, p becomes norm(max(0, p - q)) for the next (a point mass: p with d removed).
    The first that stands moves down to its node; when none does, the target's own token is
    drawn from what p has become. Each test is an exact rejection step for a draft drawn
    independently of the others, so the token that comes out follows the target's p, as for a
    chain. Returns the path of nodes that stood and the target's own token after them."""
    offers = tree.offers()
    node, path, stood = -1, [], []
    while True:
        p = probabilities(_row(rows, node + 1, constraint, [*out, *stood]), sampling)
        for child, token, q in offers.get(node, []):
            if _stands(p, token, q, generator):
                break
            p = _rejected(p, token, q)
        else:
            return path, int(torch.multinomial(p, 1, generator=generator))
        path.append(child)
        stood.append(token)
        node = child


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
        q = draft.probs[i] if draft.probs is not None else None
        if not _stands(p[i], token, q, generator):
            return i, int(torch.multinomial(_rejected(p[i], token, q), 1, generator=generator))
    return k, int(torch.multinomial(p[k], 1, generator=generator))


@dataclass
class DecodeOutcome:
    tokens: list[int]
    stop_reason: str
    target_forwards: int
    first_token_s: float


def _timed(started: float, recordings: int, target: KVState, rows: Rows) -> float | None:
    """ms of a verify step since ``started``, less the rows of logits computed on demand (they
    are priced apart); None when the forward recorded a CUDA graph first (``recordings`` moved):
    a recording costs a few forwards once, and would price that width out for a while."""
    if target.recordings != recordings:
        return None
    return (time.perf_counter() - started) * 1000 - rows.head_ms


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
    constraint: Constraint | None = None,
) -> DecodeOutcome:
    """Generate after ``seq``, of which the target holds a prefix, at least all but the last
    token: the rest (the last token, or a keystroke's few new prompt tokens, ``MERGED_PREFILL``)
    runs with the first step's draft in one forward, whose rows before the last prompt token's
    are never read. Each later step runs the last token and its draft.

    ``stop(token)`` sees each new token in order and returns a reason to stop, or None.
    ``constraint``, if given, masks disallowed tokens in the verify logits (token healing):
    drafts and the target's own tokens obey it alike.
    """
    start = time.monotonic()
    first_token_s = 0.0
    out: list[int] = []
    forwards = 0
    held = len(target.ids)  # the target holds seq[:held]; seq[held:] runs with the next step
    if not 0 < len(seq) - held <= MERGED_PREFILL or target.ids != seq[:held]:
        raise ValueError(f"the target holds {held} tokens that do not lead the {len(seq)} to decode after")
    while True:
        if cancel is not None and cancel.is_set():
            raise Cancelled("completion cancelled")
        if out and time.monotonic() > deadline:
            return DecodeOutcome(out, "time_budget", forwards, first_token_s)
        room = max_tokens - len(out) - 1  # one token of each step is the target's own
        draft = planner.propose(seq, room)
        step_started, recordings = time.perf_counter(), target.recordings
        forwards += 1
        lead = seq[held:]  # the pending token, after the first step's prompt tokens (if any)
        skip = len(lead) - 1  # rows not read: the prompt tokens' before the last
        if isinstance(draft, DraftTree):
            parents = [*range(-1, skip), *(skip + 1 + parent for parent in draft.parents)]
            rows = target.extend_tree([*lead, *draft.tokens], parents, skip=skip)
            if sampling.greedy:
                path, own = verify_tree_greedy(rows, draft, out, constraint)
            else:
                path, own = verify_tree(rows, draft, sampling, generator, out, constraint)
            step_ms = _timed(step_started, recordings, target, rows) if not skip else None
            stood = [draft.tokens[node] for node in path]
            planner.record_tree(draft, stood, step_ms, rows.head_ms / max(rows.computed, 1))
            target.keep(held, [*range(len(lead)), *(len(lead) + node for node in path)])  # lead and the path that stood
            new = [*stood, own]
        else:
            rows = target.extend_rows([*lead, *draft.tokens], skip=skip)  # k + 1 rows read, one forward
            if sampling.greedy:
                accepted, own = verify_greedy(rows, draft, out, constraint)
            else:
                logits = rows.dense()
                if constraint is not None:
                    logits = constraint.rows(logits, out, draft.tokens)
                accepted, own = verify(logits, draft, sampling, generator)  # reads the logits: a device sync
            # (a step that also ran prompt tokens is no measure of a k + 1 verify's cost)
            step_ms = _timed(step_started, recordings, target, rows) if not skip else None
            planner.record(draft, accepted, step_ms, rows.head_ms / max(rows.computed, 1))
            target.rollback(len(seq) + accepted)  # keep the lead and the accepted drafts
            new = [*draft.tokens[:accepted], own]
        planner.settle(new[0])
        if not out:
            first_token_s = time.monotonic() - start
        seq.extend(new)
        held = len(seq) - 1
        for token in new:
            reason = stop(token)
            if reason is not None:
                if reason != "eos":
                    out.append(token)
                return DecodeOutcome(out, reason, forwards, first_token_s)
            out.append(token)
            if len(out) >= max_tokens:
                return DecodeOutcome(out, "max_tokens", forwards, first_token_s)
