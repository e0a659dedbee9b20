"""The cost-aware draft planner: per step, the draft with the most expected tokens per ms.

Pure: stand-in drafters and a hand-set cost table, no model."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from specd.engine.lookup import NgramIndex
from specd.engine.speculation.costs import CATCH_UP_MEASURED, Acceptance, ForwardCosts, depth_ranges
from specd.engine.speculation.drafters import ContinuationDrafter, Draft, LookupDrafter, ModelDrafter
from specd.engine.speculation.planner import PROBE_EVERY, DraftPlanner, PlannerMemory
from specd.engine.speculation.sampling import SamplingParams


class FixedLookup(LookupDrafter):
    """Stands in for LookupDrafter's index search: always the same match."""

    def __init__(self, tokens, ngram=4, source="lookup:current", longest=16):
        super().__init__(NgramIndex(), [], longest)
        self.tokens, self.ngram, self.source = tokens, ngram, source

    def propose(self, seq, k):
        return Draft(self.tokens[:k], self.source, None, self.ngram)


@dataclass
class _State:
    ids: list = field(default_factory=list)
    forwards: int = 0
    recordings: int = 0  # CUDA graphs recorded (KVState.recordings)


class CountingModel(ModelDrafter):
    """Stands in for ModelDrafter's model: records how often and how long it was asked to draft."""

    def __init__(self, synced=True, longest=8):
        super().__init__(_State(), 8, SamplingParams(), 0.0, longest=longest)
        self.synced = synced
        self.calls: list[int] = []

    def propose(self, seq, k):
        if self.synced:
            self.state.ids = list(seq)
        self.calls.append(k)
        self.state.forwards += k
        return Draft([7] * k, "draft", torch.full((k, 8), 1 / 8))


def looked_up(tokens, source, ngram, repeat=False):
    """A lookup draft as the planner hands it out: carrying its kind."""
    draft = Draft(tokens, source, None, ngram, repeat)
    return Draft(tokens, source, None, ngram, repeat, kind=LookupDrafter.kind(draft))


def memory(target_ms, draft_step=1.0, alphas=None):
    costs = ForwardCosts(target=dict(target_ms), draft_step=draft_step, draft_per_token=draft_step / 10)
    mem = PlannerMemory(costs)
    for kind, alpha in (alphas or {}).items():
        mem.acceptance[kind] = Acceptance.prior(alpha, weight=1000)
    return mem


# A CPU-like table: a verify of 9 tokens costs 1.6x a single-token forward.
CPU = {1: 10.0, 2: 10.8, 4: 12.0, 8: 15.0, 16: 21.0, 32: 34.0}


def test_useless_draft_model_is_not_run():
    mem = memory(CPU, draft_step=3.0, alphas={"draft": 0.05})
    model = CountingModel()
    planner = DraftPlanner(mem, [model])
    seq = list(range(100))
    for _ in range(PROBE_EVERY - 1):
        assert planner.propose(seq, 40).tokens == []
    assert model.calls == []


def test_good_draft_model_is_run_at_a_length_that_pays():
    mem = memory(CPU, draft_step=1.0, alphas={"draft": 0.8})
    model = CountingModel()
    planner = DraftPlanner(mem, [model])
    draft = planner.propose(list(range(100)), 40)
    assert draft.source == "draft" and 3 <= len(draft) <= 8


def test_probe_lets_a_rejected_draft_model_recover():
    mem = memory(CPU, draft_step=3.0, alphas={"draft": 0.05})
    model = CountingModel()
    planner = DraftPlanner(mem, [model])
    seq = list(range(100))
    model.state.ids = list(seq)
    for _ in range(PROBE_EVERY + 1):
        planner.propose(seq, 40)
    assert model.calls == [2]  # one short probe


def test_trusted_lookup_goes_as_long_as_the_match():
    mem = memory(CPU, alphas={"lookup/trusted": 0.95})
    planner = DraftPlanner(mem, [FixedLookup(list(range(16)), longest=16)])
    assert len(planner.propose([1, 2, 3], 40)) == 16


def test_lookup_is_cut_to_its_expected_value():
    """A weak match on a machine where width is expensive: short, or none at all."""
    steep = {1: 10.0, 2: 14.0, 4: 22.0, 8: 38.0, 16: 70.0}
    planner = DraftPlanner(memory(steep, alphas={"lookup/short": 0.2}), [FixedLookup(list(range(16)), ngram=2)])
    assert planner.propose([1, 2, 3], 40).tokens == []
    planner = DraftPlanner(memory(steep, alphas={"lookup/short": 0.6}), [FixedLookup(list(range(16)), ngram=2)])
    assert 1 <= len(planner.propose([1, 2, 3], 40)) <= 3


def test_draft_model_catch_up_is_weighed():
    """A draft model whose cache lacks a long prompt is worth catching up only when the rest of
    the completion is long enough to repay it."""
    mem = memory(CPU, draft_step=1.0, alphas={"draft": 0.6})
    mem.costs.draft_per_token = 0.5  # a 1,000-token catch-up costs 50 target forwards
    model = CountingModel(synced=False)
    planner = DraftPlanner(mem, [model])
    assert planner.propose(list(range(1000)), 4).tokens == []
    assert planner.propose(list(range(1000)), 4000).source == "draft"


def test_the_catch_up_rate_is_learnt_from_long_catch_ups_only():
    """A draft chain after a short catch-up costs about a draft step, and the step's own cost moves
    by more than a few tokens add (in the decode loop the target's forward has just evicted the
XX
    cost 0.025, and priced the draft model out of every new document. Only catch-ups of
    ``CATCH_UP_MEASURED`` tokens or more teach the rate; short ones teach nothing, steps the step."""
    costs = ForwardCosts(draft_step=0.2, draft_per_token=0.025)
    for catch_up in (3, 10, CATCH_UP_MEASURED - 1):
        costs.record_draft(catch_up, 2, 1.8)
    assert costs.draft_per_token == 0.025 and costs.draft_step == 0.2
    costs.record_draft(1000, 3, 0.6 + 999 * 0.03)
    assert costs.draft_per_token == pytest.approx(0.8 * 0.025 + 0.2 * 0.03)
    costs.record_draft(2, 3, 3 * 0.7)  # a chain after the bonus token alone: a step's cost
    assert costs.draft_step == pytest.approx(0.8 * 0.2 + 0.2 * 0.7)


def test_record_learns_acceptance_and_costs():
    mem = memory(CPU)
    planner = DraftPlanner(mem)
    for _ in range(50):
        planner.record(looked_up([1, 2, 3, 4], "lookup:current", 2), 0, ms=12.0)
    assert mem.of("lookup/short").first < 0.05
    assert mem.costs.target_ms(5) == pytest.approx(12.0, rel=0.01)
    assert planner.stats["lookup:current"].proposed == 200


def test_target_cost_interpolates_between_measured_widths():
    costs = ForwardCosts(target={1: 10.0, 8: 17.0})
    assert costs.target_ms(4) == pytest.approx(13.0)
    assert costs.target_ms(16) == pytest.approx(25.0)  # the last slope, extended


def test_a_lookup_switched_off_by_a_bad_stretch_is_tried_again():
    """Rejections drive lookup's estimate down until it is not worth proposing; while unchosen,
    the estimate drifts back toward the prior, so lookup drafts again later (and would drop
    again at once if it still lost)."""
    mem = memory(CPU)
    planner = DraftPlanner(mem, [FixedLookup(list(range(8)), ngram=4, longest=8)])
    for _ in range(40):
        planner.record(looked_up([1, 2, 3, 4], "lookup:current", 4), 0)
    assert planner.propose([1, 2, 3], 40).tokens == []
    steps = 0
    while not planner.propose([1, 2, 3], 40).tokens:
        steps += 1
        assert steps < 500, "never tried again"
    assert steps > 10  # not at once: a stretch of plain steps first


def test_widths_follow_the_single_token_cost_when_the_machine_slows_or_speeds_up():
    costs = ForwardCosts(target=dict(CPU))
    costs.record_target(1, 20.0)  # the machine got busy: one sample at twice the cost
    scale = costs.target[1] / CPU[1]
    assert scale > 1
    assert costs.target[8] == pytest.approx(CPU[8] * scale) and costs.target[32] == pytest.approx(CPU[32] * scale)
    costs.record_target(8, 15.0)  # a width's own sample moves only that width
    assert costs.target[1] == pytest.approx(CPU[1] * scale)


def test_a_lookup_match_passed_over_is_probed_now_and_then():
    """Priced out (a stale cost table, a pessimistic estimate), a match is still tried, short,
    every PROBE_EVERY steps: its acceptance and the verify's cost get measured again."""
    steep = {1: 10.0, 2: 14.0, 4: 22.0, 8: 38.0, 16: 70.0}
    planner = DraftPlanner(memory(steep, alphas={"lookup/short": 0.05}), [FixedLookup(list(range(16)), ngram=2)])
    drafts = [planner.propose([1, 2, 3], 40) for _ in range(2 * PROBE_EVERY)]
    assert [len(d) for d in drafts].count(0) == 2 * PROBE_EVERY - 2
    assert [i for i, d in enumerate(drafts) if d.tokens] == [PROBE_EVERY - 1, 2 * PROBE_EVERY - 1]
    assert all(len(d) == 4 for d in drafts if d.tokens)


def test_drafts_that_stand_whole_or_not_at_all_are_drafted_whole():
    """Lookup drafts are mostly right or wrong from their first token: acceptance is learnt as
    two rates (the first token, then each later one), and a kind whose 8-token drafts stand
    whole 40% of the time and fail at once otherwise is drafted at full length. One geometric
    rate of 0.4 per token (each token a coin toss until the first rejection) would expect 0.66
    tokens of an 8-token draft, and cut it to two."""
    acceptance = Acceptance.prior(0.5, 0.5)
    for i in range(100):
        acceptance.record(8, 8 if i % 5 < 2 else 0)
    assert acceptance.first == pytest.approx(0.4, abs=0.05)
    assert acceptance.then > 0.9
    assert acceptance.expected(8) == pytest.approx(3.2, abs=0.4)
    assert Acceptance.prior(0.4, 0.4).expected(8) < 0.7
    mem = memory(CPU)
    mem.acceptance["lookup/trusted"] = acceptance
    planner = DraftPlanner(mem, [FixedLookup(list(range(8)), ngram=4, longest=8)])
    assert len(planner.propose([1, 2, 3], 40)) == 8
    mem.acceptance["lookup/trusted"] = Acceptance.prior(0.4, 0.4, weight=1000)
    assert len(planner.propose([1, 2, 3], 40)) <= 2


def test_later_tokens_are_learnt_by_depth_and_a_depth_not_reached_takes_the_one_before():
    """The longer a lookup draft has stood, the likelier its next token is to stand (measured on
    the real model's bench workloads: a match's second token stood 74-77% of the time, its
    eighth 86-97%). Each range of depth (``THEN_DEPTHS``) is learnt apart; one no draft has
    reached yet is priced at the range before it, so a kind whose drafts fail early is not
    credited with long runs it never showed."""
    acceptance = Acceptance.prior(0.5, 0.5)
    for i in range(200):  # every draft's first token stands; its second 60%; then all 12 stand
        acceptance.record(12, 1 if i % 5 < 2 else 12)
    assert acceptance.first > 0.95
    assert acceptance.then == pytest.approx(0.6, abs=0.05) == acceptance.then_at(1)
    assert all(acceptance.then_at(depth) > 0.95 for depth in (2, 3, 5, 9, 11))
    assert acceptance.expected(12) == pytest.approx(acceptance.reach(1) * (1 + 0.6 * 10), abs=0.5)
    assert acceptance.reach(3) == pytest.approx(acceptance.first * acceptance.then_at(1) * acceptance.then_at(2))

    failing = Acceptance.prior(0.9, 0.9)
    for _ in range(100):  # asked for 8, only the first ever stands: nothing deeper was reached
        failing.record(8, 1)
    assert failing.then < 0.1
    assert failing.then_at(2) == pytest.approx(failing.then) and failing.then_at(20) == pytest.approx(failing.then)
    assert failing.expected(8) < 1.1
    # As specd status names the ranges (engine.planner.acceptance[kind].then_by_depth)
    assert [name for name, _ in depth_ranges()] == ["1", "2", "3-4", "5-8", "9+"]


def test_a_kind_whose_long_drafts_run_on_is_drafted_longer_than_its_second_token_alone_suggests():
    """Two kinds whose second token stands equally often: the one whose drafts then run on is
    drafted longer. One rate for every later token would draft both alike."""
    flat, rising = Acceptance.prior(0.8, 0.6, weight=1000), Acceptance.prior(0.8, 0.6, weight=1000)
    for _ in range(300):
        rising.record(16, 16)  # reaches every depth and stands; depth 1 keeps its prior's weight
    rising.then_hits[0], rising.then_misses[0] = flat.then_hits[0], flat.then_misses[0]
    assert rising.then == pytest.approx(flat.then) and rising.then_at(8) > 0.9 > flat.then_at(8)
    lengths = {}
    for name, acceptance in (("flat", flat), ("rising", rising)):
        mem = memory(CPU)
        mem.acceptance["lookup/trusted"] = acceptance
        lengths[name] = len(DraftPlanner(mem, [FixedLookup(list(range(16)), ngram=4)]).propose([1, 2, 3], 40))
    assert lengths["rising"] > lengths["flat"] >= 1, lengths


def test_lookup_drafts_are_priced_by_where_they_come_from():
    """A match where the context repeats itself and one in the document's recent completions
    are kinds of their own, each apart for 2-token matches: measured, they stand far more often
    than other matches, and matches of 3+ tokens far more often than 2-token ones."""
    draft_kind = LookupDrafter.kind
    assert draft_kind(Draft([1], "lookup:current", None, 5, repeat=True)) == "lookup/repeat"
    assert draft_kind(Draft([1], "lookup:current", None, 3, repeat=True)) == "lookup/repeat/mid"
    assert draft_kind(Draft([1], "lookup:current", None, 4, repeat=True)) == "lookup/repeat/mid"
    assert draft_kind(Draft([1], "lookup:current", None, 2, repeat=True)) == "lookup/repeat/short"
    assert draft_kind(Draft([1], "lookup:suggested", None, 5)) == "lookup/suggested"
    assert draft_kind(Draft([1], "lookup:suggested", None, 2)) == "lookup/suggested/short"
    assert draft_kind(Draft([1], "lookup:workspace", None, 4)) == "lookup/trusted"
    assert draft_kind(Draft([1], "lookup:open", None, 2)) == "lookup/short"
    assert ContinuationDrafter.kind(Draft([1], "lookup:previous", None, 5)) == "lookup:previous"
    assert ModelDrafter.kind(Draft([1], "draft")) == "draft"
    mem = memory(CPU, alphas={"lookup/repeat/short": 0.9, "lookup/short": 0.05})
    lookup = FixedLookup(list(range(8)), ngram=2, longest=8)
    planner = DraftPlanner(mem, [lookup])
    assert planner.propose([1, 2, 3], 40).tokens == []
    lookup.propose = lambda seq, k: Draft(list(range(k)), "lookup:current", None, 2, repeat=True)
    draft = planner.propose([1, 2, 3], 40)
    assert len(draft) == 8 and draft.repeat


def test_the_previous_suggestions_rest_is_drafted_long_from_its_first_use_where_rows_are_dear():
    """On a CPU whose every verify row costs most of a step (llama.cpp's Q4_1 kernels at one
    thread), the document's previous suggestion, once the user typed along it, is drafted long at
    its first use: priced as a coin toss per token it would be cut to a token, and a one-token
    draft never measures how often later tokens stand."""
    steep = {1: 28.3, 2: 44.0, 4: 76.9, 8: 140.2, 12: 203.7, 16: 268.1}
    planner = DraftPlanner(memory(steep), [ContinuationDrafter(3, list(range(100, 140)))])
    draft = planner.propose([1, 2, 3], 40)
    assert draft.source == "lookup:previous" and len(draft) >= 6, len(draft)  # 2 at (0.9, 0.9)


class ManyLookups(LookupDrafter):
    """Stands in for LookupDrafter with several sources' matches, best first."""

    def __init__(self, *drafts):
        super().__init__(NgramIndex(), [])
        self.drafts = list(drafts)

    def propose(self, seq, k):
        return self.drafts[0]

    def propose_all(self, seq, k):
        return [Draft(d.tokens[:k], d.source, None, d.ngram) for d in self.drafts]


CURRENT = Draft([1, 2, 3, 4], "lookup:current", None, 4)
SUGGESTED = Draft([9, 8, 7, 6], "lookup:suggested", None, 4)


def tree_planner(target_ms, contested_first, trees=True, **alphas):
    mem = memory(target_ms)
    mem.acceptance["lookup/trusted"] = Acceptance.prior(0.9, 0.9, weight=1000)
    mem.acceptance["lookup/suggested"] = Acceptance.prior(0.9, 0.9, weight=1000)
    mem.acceptance["lookup/trusted/contested"] = Acceptance.prior(contested_first, 0.9, weight=1000)
    mem.acceptance["lookup/suggested/rival"] = Acceptance.prior(0.9, weight=4)
    return DraftPlanner(mem, [ManyLookups(CURRENT, SUGGESTED)], trees=trees)


FLAT = {1: 10.0, 2: 10.2, 4: 10.4, 8: 10.8, 16: 11.6, 32: 13.0}  # a GPU-like table: width is nearly free


def test_two_sources_that_disagree_are_verified_as_a_tree_where_width_is_cheap():
    from specd.engine.speculation.drafters import DraftTree
    planner = tree_planner(FLAT, contested_first=0.5)
    tree = planner.propose([0], 16)
    assert isinstance(tree, DraftTree)
    assert [b.source for b in tree.branches] == ["lookup:current", "lookup:suggested"]
    assert tree.tokens == [1, 2, 3, 4, 9, 8, 7, 6] and tree.parents == [-1, 0, 1, 2, -1, 4, 5, 6]


def test_no_tree_where_the_chosen_draft_wins_its_contests_or_width_is_dear():
    assert planner_draft(tree_planner(FLAT, contested_first=0.999)).source == "lookup:current"
    assert planner_draft(tree_planner(CPU, contested_first=0.9)).source == "lookup:current"
    assert planner_draft(tree_planner(FLAT, contested_first=0.5, trees=False)).source == "lookup:current"


def planner_draft(planner):
    draft = planner.propose([0], 16)
    assert isinstance(draft, Draft), draft
    return draft


def test_contests_are_measured_and_a_tree_is_recorded_per_branch():
    from specd.engine.speculation.planner import TREE
    planner = tree_planner(FLAT, contested_first=0.5)
    tree = planner.propose([0], 16)
    assert planner.contest == [("lookup/trusted/contested", 1), ("lookup/suggested/rival", 9)]
    chosen, rival = (planner.memory.of(kind).first for kind, _ in planner.contest)
    planner.record_tree(tree, [9, 8], ms=10.5)  # the second branch stood for two tokens
    planner.settle(9)
    assert planner.memory.of("lookup/trusted/contested").first < chosen
    assert planner.memory.of("lookup/suggested/rival").first > rival
    assert planner.stats[TREE].steps == 1 and planner.stats[TREE].accepted == 1
    assert planner.stats["lookup:suggested"].accepted == 2 and planner.stats["lookup:current"].accepted == 0
    assert planner.contest == []  # measured once


def test_a_contest_is_measured_where_no_tree_was_built():
    planner = tree_planner(CPU, contested_first=0.9)
    assert planner_draft(planner).source == "lookup:current"
    rival = planner.memory.of("lookup/suggested/rival").first
    planner.settle(9)  # the target wrote what the rival left out proposed
    assert planner.memory.of("lookup/suggested/rival").first > rival


def test_a_branch_that_leaves_the_chosen_draft_later_shares_its_start():
    from specd.engine.speculation.drafters import DraftTree
    mem = memory(FLAT)
    mem.acceptance["lookup/trusted"] = Acceptance.prior(0.9, 0.5, weight=1000)
    mem.acceptance["lookup/suggested"] = Acceptance.prior(0.9, 0.9, weight=1000)
    planner = DraftPlanner(mem, [ManyLookups(CURRENT, Draft([1, 2, 5, 5], "lookup:suggested", None, 4))], trees=True)
    tree = planner.propose([0], 16)
    assert isinstance(tree, DraftTree)
    assert tree.tokens == [1, 2, 3, 4, 5, 5] and tree.parents == [-1, 0, 1, 2, 1, 4]


def test_the_lookup_drafter_syncs_a_growing_context_as_a_full_sync_would():
    """The decode loop's context list grows between steps and is appended without a full
    compare; any other change (another list, the index touched elsewhere, a list edited in the
    middle) falls back to ``NgramIndex.sync``. Each step's index equals one synced from scratch."""
    import random

    rng = random.Random(7)
    index = NgramIndex()
    drafter = LookupDrafter(index, [])
    seq = [rng.randrange(50) for _ in range(300)]
    for step in range(200):
        action = rng.random()
        if action < 0.6:
            seq.extend(rng.randrange(50) for _ in range(rng.randrange(1, 5)))  # the loop's growth
        elif action < 0.7:
            seq = seq[: rng.randrange(1, len(seq))] + [rng.randrange(50)]  # a new request's prompt
        elif action < 0.8:
            seq[rng.randrange(len(seq))] = rng.randrange(50)  # edited in place: the tail check or a new list
            seq = list(seq)
        elif action < 0.9:
            index.truncate(rng.randrange(len(index) + 1))  # someone else touched the index
        drafter.propose(seq, 8)
        fresh = NgramIndex(seq)
        assert index.tokens == fresh.tokens and index._last == fresh._last and index._prev == fresh._prev, step


def test_calibration_survives_a_busy_moment_of_the_machine():
    """A burst of load during calibration slows a run of consecutive forwards. Timed in rounds
    over every width, it lands on one round, and each width's median stays its own; timed width
    by width, it would make one width cost several times what it does (and price its drafts out)."""
    import time as clock

    from specd.engine.speculation.costs import CALIBRATION_WIDTHS, calibrate

    calls = []

    class Rows:
        head_ms = 0.0

        def row(self, i):
            return None

    class State:
        def extend(self, tokens, last_only=False):
            pass

        def extend_rows(self, tokens):
            calls.append(len(tokens))
            burst = 4 <= len(calls) < 10  # six forwards in a row, soon after the warm-up round
            clock.sleep(0.002 * (1 + len(tokens) / 32) + (0.03 if burst else 0.0))
            return Rows()

        def rollback(self, length):
            pass

    costs = calibrate(State, None, vocab_size=100, max_width=32, device=torch.device("cpu")).costs
    assert sorted(costs.target) == sorted(w for w in CALIBRATION_WIDTHS if w <= 32)
    for width, ms in costs.target.items():
        assert ms < 2.0 * 1000 * 0.002 * (1 + width / 32) + 5, (width, ms, costs.target)


def test_a_draft_model_that_never_ran_is_probed_where_catching_up_costs_a_step_or_two():
    """A draft cache that never ran lags by the whole prompt; on a model whose target step is
    dear and whose draft prefills cheaply, that catch-up costs about a step, so the probe tries it
    (once caught up, the draft is priced without it). Where catching up costs many steps, not."""
    seq = list(range(1000))
    for step_ms, probes in ((60.0, [2]), (2.0, [])):
        mem = memory({1: step_ms, 2: step_ms * 2.2, 4: step_ms * 3}, draft_step=0.5, alphas={"draft": 0.05})
        mem.costs.draft_per_token = 0.05  # 1,000 tokens: 50 ms
        model = CountingModel(synced=False)
        planner = DraftPlanner(mem, [model])
        for _ in range(PROBE_EVERY + 1):
            planner.propose(seq, 40)
        assert model.calls == probes, step_ms


def test_the_step_table_is_target_ms_at_every_width():
    """The planner prices widths from ``target_table``, made again whenever a timing moves: it
    must say what ``target_ms`` says, measured widths, between them and past the widest."""
    import random

    for trial in range(300):
        rng = random.Random(trial)
        costs = ForwardCosts(target={w: rng.uniform(0.01, 10.0) for w in rng.sample(range(1, 40), rng.randint(0, 8))})
        for widest in (rng.randint(1, 50), rng.randint(1, 50)):
            table = costs.target_table(widest)
            assert len(table) > widest
            assert table[1:] == [costs.target_ms(w) for w in range(1, len(table))]
        if costs.target:
            costs.record_target(rng.choice([1, *costs.target]), rng.uniform(0.01, 10.0))
            assert costs.target_table(8)[1:9] == [costs.target_ms(w) for w in range(1, 9)]


def test_a_draft_models_catch_up_is_what_a_full_compare_says_while_the_context_grows():
    """``KVCost.catch_up`` skips the compare while neither the draft's cache nor the decode loop's
    growing list moved in a way that could change it; over random growth, drafting, rollbacks and
    new lists it answers as the full compare does."""
    import random

    from specd.engine.caches import common_prefix
    from specd.engine.speculation.drafters import KVCost

    class State:
        def __init__(self):
            self.ids, self.forwards = [], 0

    for trial in range(300):
        rng = random.Random(trial)
        state = State()
        cost = KVCost("draft", state)
        seq = [rng.randrange(4) for _ in range(rng.randint(0, 30))]
        for _ in range(60):
            move = rng.random()
            if move < 0.35:  # the loop's tokens
                seq.extend(rng.randrange(4) for _ in range(rng.randint(1, 3)))
            elif move < 0.5:  # the draft model ran: it holds part of seq and drafts beyond
                state.ids = seq[:rng.randint(0, len(seq))] + [rng.randrange(4) for _ in range(rng.randint(0, 4))]
                state.forwards += 1
            elif move < 0.6:  # a rollback
                del state.ids[rng.randint(0, len(state.ids)):]
            elif move < 0.65:  # another request's list
                seq = list(seq)
            assert cost.catch_up(seq) == len(seq) - common_prefix(state.ids, seq)


def test_a_draft_model_that_stops_short_is_priced_at_what_it_delivers():
    """The draft model may stop a chain below its confidence: asked for 8 tokens, it gives 1,
    which stands. Learnt as 8 proposed and 1 standing, the planner's expected tokens for the
    chain fall to what such chains deliver; learnt as 1 of 1 (a perfect draft), it would keep
    choosing the model over a lookup draft that gives more, expecting 9 tokens a step."""

    class ShortModel(CountingModel):
        def propose(self, seq, k):
            super().propose(seq, k)
            return Draft([7], "draft", torch.full((1, 8), 1 / 8))

    mem = memory(CPU, draft_step=0.1, alphas={})
    mem.priors["draft"] = (0.95, 0.95)
    planner = DraftPlanner(mem, [ShortModel()])
    seq = list(range(100))
    draft = planner.propose(seq, 40)
    assert len(draft) == 1 and draft.asked == 8
    before = mem.of("draft").expected(8)
    for _ in range(20):
        planner.record(draft, 1, None)
    after = mem.of("draft").expected(8)
    assert before > 5.0 and after < 1.5, (before, after)
    assert planner.stats["draft"].proposed == 20 and planner.stats["draft"].accepted == 20  # counts stay true


def test_agreement_counts_first_tokens_and_those_after_an_agreement():
    from specd.engine.speculation.agreement import FLOOR, Agreement, AgreementSample

    target = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    draft = [1, 2, 0, 4, 5, 6, 0, 0, 9, 10]  # agree at 7 of 10; of the 6 positions after an agreement, 4 agree
    confidence = [0.9, 0.9, 0.9, 0.9, 0.2, 0.9, 0.9, 0.9, 0.9, 0.9]  # position 4 (which agrees) is below 0.3
    agreement = Agreement.of(AgreementSample(target, draft, confidence))
    assert agreement.first == pytest.approx(0.7) and agreement.then == pytest.approx(4 / 6)
    assert agreement.positions == 10
    # where the draft model is not confident enough to go on, the chain stops: no agreement after
    cautious = Agreement.of(AgreementSample(target, draft, confidence), confidence=0.3)
    assert cautious.first == pytest.approx(0.7) and cautious.then == pytest.approx(3 / 6)
    assert Agreement.of(AgreementSample(target, target, confidence)).prior == (1 - FLOOR, 1 - FLOOR)
    with pytest.raises(ValueError):
        Agreement.of(AgreementSample([], [], []))


def test_a_chains_own_second_tokens_set_then_where_they_were_measured():
    """A feature head's chain reads its own predicted states, so its second token is measured as
    a chain drafts it (``HeadState.chained_next``), kept only where the draft agreed and the code
    went on with that token (``with_chains``); ``then`` counts those, not the teacher-forced ones."""
    from specd.engine.speculation.agreement import Agreement, AgreementSample, with_chains

    ids = [5, 1, 2, 3, 4, 5, 9, 7, 8, 9]
    target = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]  # the target's next token at each position
    draft = [1, 2, 0, 4, 5, 6, 0, 8, 9, 10]
    chained = ([-1, 3, 0, 5, 6, 0, 0, 0, 10, 0], [0.0] + [0.9] * 9)
    sample = with_chains(AgreementSample(target, draft, [0.9] * 10), ids, chained)
    # kept: agreed, and the code's next token is the agreed one (positions 0, 1, 3, 4, 7, 8);
    # position 5 agreed but the code went on with 9, not 6; position 9 has no next in the sample
    assert sample.chained_next == [-1, 3, -1, 5, 6, -1, -1, 0, 10, -1]
    # of the 5 measured (position 0 is the head's -1: no state before it), 1, 3, 4 and 8 were right
    assert Agreement.of(sample).then == pytest.approx(4 / 5)
    wrong = with_chains(AgreementSample(target, draft, [0.9] * 10), ids, ([-1, 0, 0, 5, 0, 0, 0, 0, 0, 0], [0.0] + [0.9] * 9))
    assert Agreement.of(wrong).then == pytest.approx(1 / 5)
    # the teacher-forced count would have said otherwise
    assert Agreement.of(AgreementSample(target, draft, [0.9] * 10)).then == pytest.approx(5 / 7)


def test_the_chain_stopping_confidence_is_where_agreement_stops_paying():
    """Agreement rises with the draft's confidence; the threshold is the lowest confidence whose
    (monotone-fitted) agreement reaches the break-even chance, so a draft whose unsure tokens
    still mostly agree keeps drafting them where verify rows are cheap."""
    import random

    from specd.engine.speculation.agreement import AgreementSample, choose_confidence

    rng = random.Random(1)
    confidence = [rng.random() for _ in range(4000)]
    agree = [rng.random() < c for c in confidence]  # a calibrated draft: agrees as often as it is sure
    sample = AgreementSample([1] * len(agree), [1 if a else 0 for a in agree], confidence)
    for break_even in (0.2, 0.5, 0.8):
        assert choose_confidence(sample, break_even) == pytest.approx(break_even, abs=0.06), break_even
    sure = AgreementSample([1] * 100, [1] * 100, [rng.random() for _ in range(100)])  # agrees everywhere
    assert choose_confidence(sure, 0.3) == 0.0
    never = AgreementSample([1] * 100, [0] * 100, [rng.random() for _ in range(100)])
    assert choose_confidence(never, 0.3) == 1.0


def test_break_even_agreement_weighs_a_draft_step_and_a_verify_row_against_a_plain_step():
    costs = ForwardCosts(target={1: 10.0, 2: 11.0, 9: 18.0}, draft_step=0.5, draft_per_token=0.05)
    assert costs.break_even_agreement() == pytest.approx((0.5 + 1.0) / 10.0)
    tiny = ForwardCosts(target={1: 0.5, 2: 0.7, 9: 2.1}, draft_step=0.2, draft_per_token=0.05)
    assert tiny.break_even_agreement() == pytest.approx((0.2 + 0.2) / 0.5)  # 80%: most chain tokens do not pay


def test_calibration_measures_the_draft_models_agreement_on_the_code_it_reads():
    """With a context of code, both models read every position and the draft's greedy next
    tokens are compared with the target's; without one, nothing is learnt of agreement."""
    from specd.engine.speculation.agreement import Agreement
    from specd.engine.speculation.costs import CALIBRATION_CONTEXT, calibrate

    class Model:
        """Next token: (token + shift) % 50, or 0 where ``wrong`` says so; logits one-hot."""

        def __init__(self, wrong=lambda token: False):
            self.wrong, self.ids = wrong, []

        def extend(self, tokens, last_only=False):
            self.ids.extend(tokens)
            logits = torch.zeros(len(tokens), 60)
            for row, token in enumerate(tokens):
                logits[row, 0 if self.wrong(token) else (token + 1) % 50] = 1.0
            return logits[-1:] if last_only else logits

        def extend_rows(self, tokens):
            self.extend(tokens)

            class Rows:
                head_ms = 0.0

                def row(self, i):
                    return None
            return Rows()

        def rollback(self, length):
            del self.ids[length:]

        def chained_next(self, ids):
            return None  # a chain reads what the sample read

    context = [i % 50 for i in range(CALIBRATION_CONTEXT)]
    measured = calibrate(Model, lambda target: Model(wrong=lambda token: token % 4 == 0), vocab_size=50, max_width=8,
                         device=torch.device("cpu"), context=context, target_rows=50)
    agreement = Agreement.of(measured.sample)
    assert agreement.positions == CALIBRATION_CONTEXT
    assert agreement.first == pytest.approx(sum(t % 4 != 0 for t in context) / len(context))
    assert measured.costs.draft_step is not None and sorted(measured.costs.target) == [1, 2, 4, 8]
    assert calibrate(Model, lambda target: Model(), vocab_size=50, max_width=8, device=torch.device("cpu")).sample is None


def test_a_measured_agreement_lets_a_lagging_draft_model_run_from_the_first_request():
    """The real-shaped stand-in's figures (a 16 ms target step, a 0.6 ms draft step, 0.13 ms a
    catch-up token, a cache 1,000 tokens behind): at the old fixed guess of 50% the draft
    model is priced out and never runs, so it is never measured; at the agreement measured at
    load (its own un-widened target: 98%) it drafts a long chain at once."""
    seq = list(range(1000))
    shape = {1: 15.7, 2: 21.3, 4: 24.6, 8: 34.5, 16: 51.6}
    for prior, drafts in (((0.5, 0.5), False), ((0.98, 0.98), True)):
        mem = memory(shape, draft_step=0.6)
        mem.costs.draft_per_token = 0.13
        mem.priors["draft"] = prior
        model = CountingModel(synced=False)
        DraftPlanner(mem, [model]).propose(seq, 31)
        assert bool(model.calls) == drafts, prior
        if drafts:
            assert model.calls[0] >= 6


def test_a_requests_first_step_drafts_only_what_keeps_its_first_token_near_the_prompt_rows_alone():
    """The first forward also runs the prompt's new tokens, and the editor waits for its first
    token: where a row costs nearly a step, the draft waits for the second forward."""
    steep = {1: 10.0, 2: 18.6, 4: 29.0, 8: 50.0, 16: 90.0}
    planner = DraftPlanner(memory(steep, alphas={"lookup/trusted": 0.95}), [FixedLookup(list(range(16)))])
    assert planner.first_token_room(1, 40) == 0
    assert planner.propose([1, 2, 3], 40, lead=1).tokens == []
    assert planner.propose([1, 2, 3], 40, lead=4).tokens == []
    assert len(planner.propose([1, 2, 3], 40)) > 1  # the next steps price tokens per ms alone
    # Where width is nearly free (a GPU), the first forward carries the draft, as far as the slack goes.
    planner = DraftPlanner(memory(FLAT, alphas={"lookup/trusted": 0.95}), [FixedLookup(list(range(16)))])
    room = planner.first_token_room(1, 40)
    assert 4 <= room < 16
    assert len(planner.propose([1, 2, 3], 40, lead=1)) == room
    # Wider prompt rows leave room for more draft rows within the same slack.
    assert planner.first_token_room(8, 40) > room


def test_a_first_steps_token_tree_stays_within_the_first_tokens_room():
    from specd.engine.speculation.drafters import DraftTree
    planner = tree_planner(FLAT, contested_first=0.5)
    room = planner.first_token_room(1, 16)
    draft = planner.propose([0], 16, lead=1)
    assert len(draft) <= room
    assert isinstance(planner.propose([0], 16), DraftTree)
