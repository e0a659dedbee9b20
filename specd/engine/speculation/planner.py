"""The draft planner: per step, the draft (or token tree of drafts) that maximises expected tokens
per millisecond, from what each drafter declares (``drafters.Drafter``) and what the planner has
measured (``PlannerMemory``: forward costs by width, acceptance by kind). It counts proposals and
acceptances per source for reporting. No model here and no branching on a drafter's type or source.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Sequence

from specd.engine.caches import common_prefix
from specd.engine.speculation.costs import Acceptance, ForwardCosts, ForwardTally
from specd.engine.speculation.drafters import EMPTY, Draft, Drafter, DraftTree, Prior
from specd.engine.types import SourceStats

PROBE_EVERY = 24  # steps without a priced drafter (the draft model) after which it is tried once, so its estimate can recover
PROBE_CATCH_UP = 64  # ... if catching it up costs at most this many tokens
PROBE_CATCH_UP_STEPS = 2.0  # ... or at most this many target steps' time (a draft that never ran lags the whole prompt)
PROBE_LENGTH = 4  # tokens of an offered draft (a lookup match) tried after PROBE_EVERY steps of passing such drafts over
TREE_BRANCHES = 3  # most drafts a token tree verifies side by side
TREE = "tree"  # SourceStats of token trees: steps, branches beyond the first (proposed), and won (accepted)
CONTESTED = "/contested"  # a kind's acceptance where another source's draft starts with another token ...
RIVAL = "/rival"  # ... and that of the other source's draft there (measured on every such step, tree or not)
UNKNOWN_PRIOR: Prior = (0.3, 0.5)  # a kind no drafter declared a prior for
# A request's first forward also runs the prompt's new tokens, and the editor waits for its first
# token: that forward carries draft rows only while they keep it within this factor of the prompt
# rows' forward alone (where extra rows cost next to nothing, as on a GPU, drafts still go along;
# where each row costs about as much as a step, the draft waits for the second forward).
FIRST_TOKEN_SLACK = 1.1


@dataclass
class PlannerMemory:
    """What the planner learns across requests, per loaded pair: costs and acceptance, and the
    priors its drafters declared (``Drafter.priors``; a kind belongs to one drafter). ``ran``:
    the forwards its steps ran, by width, for pricing at other costs (``ForwardCosts.price``)."""

    costs: ForwardCosts = field(default_factory=ForwardCosts)
    ran: ForwardTally = field(default_factory=ForwardTally)
    acceptance: dict[str, Acceptance] = field(default_factory=dict)
    priors: dict[str, Prior] = field(default_factory=dict)
    steps_unpriced: dict[str, int] = field(default_factory=dict)  # priced drafter's kind -> steps it did not run
    steps_passed_over: int = 0  # steps an offered draft was found and not drafted

    def of(self, kind: str) -> Acceptance:
        if kind not in self.acceptance:
            base = kind.removesuffix(CONTESTED).removesuffix(RIVAL)
            self.acceptance[kind] = Acceptance.prior(*self.priors.get(base, UNKNOWN_PRIOR))
        return self.acceptance[kind]


@dataclass
class DraftPlanner:
    """Per step, the draft that maximises expected tokens per millisecond: none, or one of the
    drafters' drafts, each cut to its best length; where the forward path runs trees, several
    drafters' drafts side by side (``_tree``).

    Drafters whose ``cost`` is None are offered first, in priority order: each proposes up to its
    ``longest`` tokens and the draft is cut to its best length, priced by its kind's acceptance.
    Then each drafter with a ``cost`` (a model's forwards) is priced before it drafts and runs only
    when its chain beats the best offer.

    rate(draft of k tokens) = (1 + E[accepted | k]) / (step_ms(k + 1) + drafting ms), where a
    step pays for the rows of logits it reads (1 + accepted) when they are computed on demand;
    a plain step is rate 1 / step_ms(1). A priced drafter's catch-up (tokens its cache lacks) is
    spread over the steps the rest of the completion should take.
    """

    memory: PlannerMemory
    drafters: Sequence[Drafter] = ()  # in priority order: of two drafts that rate the same, the earlier drafter's
    trees: bool = False  # may verify several drafts as a token tree (a forward path that runs trees)
    stats: dict[str, SourceStats] = field(default_factory=dict)
    # This step's contest, when another source's draft started with another token than the
    # chosen one: (kind + CONTESTED, its first token), and each rival's (kind + RIVAL, first token)
    contest: list[tuple[str, int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.drafters = list(self.drafters)  # this planner's own: a drafter that ends leaves it
        for drafter in self.drafters:
            for kind, prior in drafter.priors.items():
                self.memory.priors.setdefault(kind, prior)

    def _best_length(self, kind: str, available: int, draft_step_ms: float = 0.0, catch_up_ms: float = 0.0,
                     room: int = 1) -> tuple[int, float]:
        """The draft length of ``kind`` with the most expected tokens per ms, and that rate. A
        priced drafter's k tokens cost ``draft_step_ms`` each, plus its catch-up ``catch_up_ms``
        spread over the steps the rest of the completion (``room`` tokens) should take."""
        acceptance, costs = self.memory.of(kind), self.memory.costs
        first = acceptance.first
        step_ms, head_row = costs.target_table(available + 1), costs.head_row
        best_k, best_rate = 0, 0.0
        later, power = 0.0, 1.0  # acceptance.expected_after_first(k), summed as k grows
        rates = acceptance.later_rates(available + 1)
        for k in range(1, available + 1):
            tokens = 1.0 + first * (1.0 + later)  # 1 + acceptance.expected(k): also the rows read
            drafting = k * draft_step_ms + catch_up_ms * min(1.0, tokens / room)
            rate = tokens / (step_ms[k + 1] + head_row * tokens + drafting)
            if rate > best_rate:
                best_k, best_rate = k, rate
            power *= min(rates[k - 1], 0.999)  # the token at depth k, should the draft grow to k + 1
            later += power
        return best_k, best_rate

    def first_token_room(self, lead: int, room: int) -> int:
        """Draft tokens (at most ``room``) a forward of ``lead`` prompt rows may carry while its cost
        stays within ``FIRST_TOKEN_SLACK`` of theirs alone."""
        table = self.memory.costs.target_table(lead + room)
        k = 0
        while k < room and table[lead + k + 1] <= FIRST_TOKEN_SLACK * table[lead]:
            k += 1
        return k

    def propose(self, seq: Sequence[int], room: int, lead: int = 0) -> Draft | DraftTree:
        """The draft for the next step, at most ``room`` tokens. ``lead``: on a request's first
        step, the prompt tokens its forward runs before the draft; the draft is then cut to what
        keeps the first token's wait near theirs alone (``first_token_room``)."""
        widest = None  # most draft tokens in all, a token tree's branches together
        if lead:
            widest = self.first_token_room(lead, TREE_BRANCHES * room)
            room = min(room, widest)
        if room <= 0:
            return EMPTY
        best, best_rate = EMPTY, 1.0 / self.memory.costs.step_ms(1, 1)
        offers = self._offers(seq, room)  # each offered drafter's best draft
        alternatives = [draft for drafts in offers for draft in drafts]  # what a token tree may add beside the chosen draft
        unchosen = []
        probe = None
        for draft in (drafts[0] if drafts else EMPTY for drafts in offers):
            if draft.tokens:
                k, rate = self._best_length(draft.kind, len(draft))
                unchosen.append(draft.kind)
                if rate > best_rate:
                    best, best_rate = dataclasses.replace(draft, tokens=draft.tokens[:k]), rate
                elif probe is None:
                    probe = dataclasses.replace(draft, tokens=draft.tokens[:PROBE_LENGTH])
        if best.tokens:
            self.memory.steps_passed_over = 0
        elif probe is not None:
            # Offers keep being passed over: try one short one now and then, so its acceptance
            # and the cost of a verify that wide are measured again (both may be stale).
            self.memory.steps_passed_over += 1
            if self.memory.steps_passed_over >= PROBE_EVERY:
                self.memory.steps_passed_over = 0
                best = probe
        for drafter in [drafter for drafter in self.drafters if drafter.cost is not None]:
            cost = drafter.cost
            catch_up = cost.catch_up(seq)
            k = self._priced_length(drafter, catch_up, room, best_rate)
            if k:
                self._relax(unchosen)
                self.memory.steps_unpriced[cost.kind] = 0
                started, forwards, recordings = time.perf_counter(), cost.forwards, cost.recordings
                draft = dataclasses.replace(self._kinded(drafter, drafter.propose(seq, k)), asked=k)
                self.memory.ran.add_draft(catch_up, cost.forwards - forwards)
                if cost.recordings == recordings:  # a step that recorded a CUDA graph first is no measure
                    self.memory.costs.record_draft(catch_up, cost.forwards - forwards,
                                                   (time.perf_counter() - started) * 1000)
                return self._tree(draft, alternatives, widest)
            self.memory.steps_unpriced[cost.kind] = self.memory.steps_unpriced.get(cost.kind, 0) + 1
            unchosen.append(cost.kind)
        self._relax([kind for kind in unchosen if not best.tokens or kind != best.kind])
        return self._tree(best, alternatives, widest)

    def _offers(self, seq: Sequence[int], room: int) -> list[list[Draft]]:
        """Per drafter that costs nothing to ask, in priority order: its drafts (all its candidates
        where a token tree may verify them, else its one), with their kinds. A drafter that
        ``ends_when_empty`` and proposes nothing leaves this planner, never to propose again."""
        offers = []
        for drafter in [drafter for drafter in self.drafters if drafter.cost is None]:
            k = room if drafter.longest is None else min(room, drafter.longest)
            drafts = drafter.propose_all(seq, k) if self.trees else [drafter.propose(seq, k)]
            if drafter.ends_when_empty and not (drafts and drafts[0].tokens):
                self.drafters.remove(drafter)
                continue
            offers.append([self._kinded(drafter, draft) for draft in drafts])
        return offers

    @staticmethod
    def _kinded(drafter: Drafter, draft: Draft) -> Draft:
        """``draft`` carrying its drafter's kind for it (what it is priced and learnt under)."""
        return dataclasses.replace(draft, kind=drafter.kind(draft)) if draft.tokens else draft

    def _tree(self, chosen: Draft, alternatives: list[Draft], widest: int | None = None) -> Draft | DraftTree:
        """``chosen``, or a token tree of it and the alternatives (other sources' drafts) that
        raise the expected tokens per millisecond enough to pay for a wider forward, at most
        ``TREE_BRANCHES`` drafts and ``widest`` tokens in all. An alternative adds what it proposes from where it leaves the
        chosen draft (its first token, or one after a shared start), cut to its best length;
        where another branch already leaves at that point with that token, it adds nothing.

        Expected tokens: the chosen draft's as a chain, plus for each branch leaving it after m
        shared tokens, P(the chosen draft's first m stand) P(the branch's next token stands)
        (1 + its later tokens expected): that next-token probability is its kind's rate as a
        rival in a contest when it leaves at the first token (and the chosen draft's first token is
        then priced at its kind's contested rate), else its kind's rate at that depth
        (``then_at``); capped by what the branches leaving at the same point leave (only one
        token stands there)."""
        self.contest = []
        if not (self.trees and chosen.tokens and alternatives):
            return chosen
        rivals = {}
        for draft in alternatives:
            if draft.tokens and draft.tokens[0] != chosen.tokens[0]:
                rivals.setdefault(draft.tokens[0], draft.kind + RIVAL)
        costs = self.memory.costs
        main = self.memory.of(chosen.kind)
        if rivals:
            # Where sources disagree, each is right less often than it is overall (often neither
            # is): the first tokens are priced as measured in such contests (``settle``).
            self.contest = [(chosen.kind + CONTESTED, chosen.tokens[0]),
                            *((kind, token) for token, kind in rivals.items())]
            contested = self.memory.of(self.contest[0][0])
            main = dataclasses.replace(main, first_hits=contested.first_hits, first_misses=contested.first_misses)
        tokens = 1.0 + main.expected(len(chosen))
        width = 1 + len(chosen)
        rate = tokens / costs.step_ms(width, tokens)
        branches, taken = [chosen], set()
        left = [1.0 - main.first] + [1.0 - rate for rate in main.later_rates(len(chosen))]  # per point of leaving
        for draft in alternatives:
            if len(branches) >= TREE_BRANCHES:
                break
            shared = common_prefix(draft.tokens, chosen.tokens)
            if shared >= min(len(draft), len(chosen)) or (shared, draft.tokens[shared]) in taken:
                continue
            acceptance = self.memory.of(draft.kind)
            reach = main.reach(shared)
            next_stands = self.memory.of(rivals[draft.tokens[0]]).first if shared == 0 else acceptance.then_at(shared)
            odds = min(next_stands, left[shared])
            best_k, best_rate = 0, rate
            longest = len(draft) - shared if widest is None else min(len(draft) - shared, widest + 1 - width)
            for k in range(1, longest + 1):
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

    def _priced_length(self, drafter: Drafter, catch_up: int, room: int, rate_to_beat: float) -> int:
        """Chain length worth drafting with ``drafter`` (its cache lacks ``catch_up`` tokens), or 0."""
        kind, costs = drafter.cost.kind, self.memory.costs
        step, per_token = costs.draft_rates()
        available = room if drafter.longest is None else min(room, drafter.longest)
        # drafting k tokens: k draft steps, and the catch-up spread over the steps left
        k, rate = self._best_length(kind, available, step, max(0, catch_up - 1) * per_token, room)
        if rate > rate_to_beat:
            return k
        if self.memory.steps_unpriced.get(kind, 0) >= PROBE_EVERY and (
                catch_up <= PROBE_CATCH_UP or costs.draft_ms(catch_up, 0) <= PROBE_CATCH_UP_STEPS * costs.target_ms(1)):
            # Catching a draft cache up on a document is paid once: with KV reuse it then stays
            # with the document, so the next steps price the draft without it.
            return min(2, room)
        return 0

    def record(self, draft: Draft, accepted: int, ms: float | None = None, head_row_ms: float = 0.0) -> None:
        """After verification: ``accepted`` of the draft's tokens stood; the target forward (and
        verification) took ``ms`` besides the rows of logits computed on demand, ``head_row_ms``
        each (0: the rows came with the forward)."""
        self._ran(len(draft) + 1, ms, head_row_ms)
        self._credit(draft, accepted)

    def _ran(self, width: int, ms: float | None, head_row_ms: float) -> None:
        """A target forward of ``width`` tokens ran: counted, and its cost recorded where timed."""
        self.memory.ran.add_target(width)
        if ms is not None:
            self.memory.costs.record_target(width, ms)
        if head_row_ms > 0:
            self.memory.costs.record_head_row(head_row_ms)

    def _credit(self, draft: Draft, accepted: int) -> None:
        """``accepted`` of ``draft``'s tokens stood: its source's counts and its kind's acceptance."""
        if not draft.tokens:
            return
        stats = self.stats.setdefault(draft.source, SourceStats())
        stats.proposed += len(draft)
        stats.accepted += accepted
        stats.steps += 1
        self.memory.of(draft.kind).record(max(len(draft), draft.asked), accepted)

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
        self._ran(len(tree) + 1, ms, head_row_ms)
        for draft in tree.branches:
            self._credit(draft, common_prefix(draft.tokens, accepted))
        stats = self.stats.setdefault(TREE, SourceStats())
        stats.steps += 1
        stats.proposed += len(tree.branches) - 1
        stats.accepted += 1 if common_prefix(accepted, tree.branches[0].tokens) < len(accepted) else 0
