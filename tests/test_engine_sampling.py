"""Speculative sampling keeps the target's distribution exactly.

- ``verify`` alone: for given p and q rows, the law of its output (accepted count, own token)
  is known in closed form; checked over many draws, for model drafts, point masses (lookup) and
  the empty-residual branch.
- Model-draft chains with the shipped ``draft_max`` and a 0.3 ``draft_confidence``: a hand-built
  bigram target and draft whose p and q are exact, so the law of the first generated tokens is
  known by enumeration; the chain may stop on the draft's confidence, never on the token drawn.
- The tiny random-weight pair: chi-square tests of the first two sampled tokens against the
  target's exact marginals, with a model draft and a deterministic draft.
"""

from __future__ import annotations

import itertools
import math
import types
from collections import Counter

import pytest
import torch
from scipy.stats import chi2
from transformers import LlamaConfig

from engine_helpers import make_engine
from specd.engine.speculation import drafters
from specd.engine.speculation.loop import speculative_decode
from specd.engine.speculation.verify import verify
from specd.engine.speculation.drafters import Draft, ModelDrafter
from specd.engine.options import EngineOptions
from specd.engine.speculation.agreement import NO_SAMPLE_CONFIDENCE
from specd.engine.caches import KVState
from specd.engine.forward.path import BasicPath
from specd.engine.speculation.sampling import SamplingParams, probabilities
from specd.engine.types import SourceStats

DRAWS = 1000
TEMPERATURE = 1.5  # spread the tiny model's peaked distributions so several tokens matter
ALPHA = 1e-4  # false-alarm rate per check: these tests must not flake
SHIPPED = EngineOptions()  # draft_max 8, as a user gets it
# The chain cut-off: the shipped draft_confidence is auto, measured per pair at load
# (speculation.agreement); this is what auto falls back to with nothing measured.
CUT_OFF = NO_SAMPLE_CONFIDENCE


@pytest.fixture(scope="module")
def engine(llama_pair):
    target, draft = llama_pair
    return make_engine(target, draft)


def exact_marginals(model, prompt: list[int], sampling: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """p(t1) and p(t2) = sum over t1 of p(t1) p(t2 | t1), computed from the target directly."""
    with torch.no_grad():
        p1 = probabilities(model(torch.tensor([prompt])).logits[0, -1], sampling)
        support = (p1 > 1e-7).nonzero().flatten().tolist()
        batch = torch.tensor([prompt + [t] for t in support])
        p2_given = probabilities(model(batch).logits[:, -1], sampling)  # [len(support), V]
        p2 = (p1[support].unsqueeze(1) * p2_given).sum(0)
    return p1, p2


def chi_square_pvalue(counts: Counter, probs, draws: int) -> float:
    """Pearson chi-square over categories expected >= 5 times, the rest pooled into one.
    ``probs``: a tensor indexed by category, or a dict category -> probability."""
    items = probs.items() if isinstance(probs, dict) else enumerate(probs.tolist())
    expected = {c: float(pr) * draws for c, pr in items}
    big = [c for c, e in expected.items() if e >= 5]
    observed = [counts.get(c, 0) for c in big]
    exp = [expected[c] for c in big]
    rest_exp = draws - sum(exp)
    rest_obs = draws - sum(observed)
    if rest_exp >= 5:
        observed.append(rest_obs)
        exp.append(rest_exp)
    elif rest_exp > 1e-6:  # too rare to stand alone: pooled with the rarest big category
        i = min(range(len(exp)), key=exp.__getitem__)
        observed[i] += rest_obs
        exp[i] += rest_exp
    elif rest_obs:  # what the law rules out happened
        return 0.0
    if len(exp) == 1:  # a single possible category, and nothing else turned up
        return 1.0
    statistic = sum((o - e) ** 2 / e for o, e in zip(observed, exp))
    return float(chi2.sf(statistic, df=len(exp) - 1))


class FixedPlanner:
    """The speculative loop's planner cut down to one source at a fixed length, so these tests
    exercise the acceptance rule and the drafter, not the planner's choices."""

    def __init__(self, drafter, length: int):
        self.drafter = drafter
        self.length = length
        self.stats: dict[str, SourceStats] = {}
        self.chains: Counter = Counter()  # draft length -> how many steps proposed that many
        self.cut = 0  # steps whose draft came back shorter than asked

    def propose(self, seq, room, lead=0):  # drafts on the first step too: the rule under test is acceptance
        asked = min(room, self.length)
        draft = self.drafter.propose(seq, asked) if asked > 0 else Draft([], "none")
        self.chains[len(draft)] += 1
        self.cut += len(draft) < asked
        return draft

    def settle(self, first: int) -> None:
        pass  # no contests to measure: one source

    def record(self, draft: Draft, accepted: int, ms: float | None = None, head_row_ms: float = 0.0) -> None:
        if draft.tokens:
            stats = self.stats.setdefault(draft.source, SourceStats())
            stats.proposed += len(draft)
            stats.accepted += accepted
            stats.steps += 1


# -- verify alone: the closed-form law of its output ----------------------------------------

def verify_law(p: torch.Tensor, q: torch.Tensor | None, tokens: list[int]) -> dict[tuple[int, int], float]:
    """P(verify returns (n, own)) for draft ``tokens`` with target rows p [k + 1, V] and draft
    rows q [k, V] (None: point masses). Draft i is reached with the product of the earlier
    acceptance probabilities min(1, p(d)/q(d)); rejected, the own token follows
    norm(max(0, p - q)) (p itself when that is empty); all accepted, it follows p[k]."""
    p = p.double()
    law, reach = {}, 1.0
    for i, d in enumerate(tokens):
        qi = q[i].double() if q is not None else torch.nn.functional.one_hot(torch.tensor(d), p.shape[1]).double()
        accept = min(1.0, float(p[i, d] / qi[d]))
        residual = (p[i] - qi).clamp(min=0.0)
        residual = p[i] if residual.sum() <= 0 else residual
        for t, r in enumerate((residual / residual.sum()).tolist()):
            law[(i, t)] = reach * (1.0 - accept) * r
        reach *= accept
    for t, r in enumerate(p[len(tokens)].tolist()):
        law[(len(tokens), t)] = reach * r
    return law


def run_verify(logits: torch.Tensor, draft: Draft, draws: int, seed: int) -> Counter:
    sampling = SamplingParams(temperature=1.0)
    generator = torch.Generator().manual_seed(seed)
    return Counter(verify(logits, draft, sampling, generator) for _ in range(draws))


def rows(*values: list[float]) -> torch.Tensor:
    t = torch.tensor(values, dtype=torch.float32)
    return t / t.sum(-1, keepdim=True)


P_ROWS = rows([0.40, 0.25, 0.15, 0.10, 0.06, 0.04],
              [0.05, 0.10, 0.45, 0.20, 0.15, 0.05],
              [0.20, 0.20, 0.20, 0.20, 0.10, 0.10],
              [0.10, 0.30, 0.05, 0.05, 0.30, 0.20])
Q_ROWS = rows([0.20, 0.50, 0.10, 0.10, 0.05, 0.05],
              [0.05, 0.10, 0.30, 0.40, 0.10, 0.05],
              [0.60, 0.10, 0.10, 0.10, 0.05, 0.05])
VERIFY_DRAWS = 12_000


@pytest.mark.parametrize("case", ["model", "point-mass", "point-mass-certain", "p-equals-q", "empty-residual"])
def test_verify_output_follows_the_closed_form_law(case):
    p, q, tokens = P_ROWS, Q_ROWS, [1, 3, 0]  # drafts the target likes less than the drafter
    if case == "point-mass":
        q, tokens = None, [0, 2, 5]
    elif case == "point-mass-certain":  # p(d) = 1 (nothing left to resample) and p(d) = 0
        p = P_ROWS.clone()
        p[0] = torch.nn.functional.one_hot(torch.tensor(2), 6).float()
        p[1, 4] = 0.0
        p = p / p.sum(-1, keepdim=True)
        q, tokens = None, [2, 4, 1]
    elif case == "p-equals-q":  # the drafter is the target: every draft stands
        q = probabilities(P_ROWS.log(), SamplingParams(temperature=1.0))[:3]
    elif case == "empty-residual":  # q >= p everywhere (rounding can leave it so): resample from p
        q = P_ROWS[:3] * 1.25
    logits = p.log()  # softmax(log p) = p at temperature 1 (up to rounding: the law uses verify's p)
    draft = Draft(tokens, "draft" if q is not None else "lookup:current", q)
    law = verify_law(probabilities(logits, SamplingParams(temperature=1.0)), q, tokens)
    counts = run_verify(logits, draft, VERIFY_DRAWS, seed=11)
    assert chi_square_pvalue(counts, law, VERIFY_DRAWS) > ALPHA
    accepted = Counter()
    for (n, _), count in counts.items():
        accepted[n] += count
    accepted_law = {n: sum(v for (m, _), v in law.items() if m == n) for n in range(len(tokens) + 1)}
    assert chi_square_pvalue(accepted, accepted_law, VERIFY_DRAWS) > ALPHA
    if case == "p-equals-q":
        assert set(accepted) == {len(tokens)}
    if case == "point-mass-certain":
        assert set(accepted) == {1}  # the first always stands, the second never


@pytest.mark.parametrize("kind", ["model", "point-mass"])
def test_verify_keeps_the_target_distribution_of_the_first_token(kind):
    """Draft d ~ q (or any fixed d for a point mass): the first token out is exactly ~ p."""
    p, q = P_ROWS[:2], Q_ROWS[:1]
    generator = torch.Generator().manual_seed(5)
    sampling = SamplingParams(temperature=1.0)
    if kind == "model":
        drafts = torch.multinomial(q[0], VERIFY_DRAWS, replacement=True, generator=generator).tolist()
    else:
        drafts = [i % 6 for i in range(VERIFY_DRAWS)]
    first = Counter()
    for d in drafts:
        n, own = verify(p.log(), Draft([d], "draft", q if kind == "model" else None), sampling, generator)
        first[d if n else own] += 1
    assert chi_square_pvalue(first, p[0], VERIFY_DRAWS) > ALPHA


# -- model-draft chains with the shipped settings ---------------------------------------------

class Bigram(torch.nn.Module):
    """A causal LM whose next-token distribution is a fixed row per current token: p and q are
    known exactly. Its cache holds the token ids, so KVState's extend / crop work as usual."""

    def __init__(self, table: torch.Tensor):
        super().__init__()
        self.table = table
        self.config = LlamaConfig(vocab_size=table.shape[1], hidden_size=8, intermediate_size=8,
                                  num_hidden_layers=1, num_attention_heads=1, num_key_value_heads=1)
        self.device = torch.device("cpu")

    def forward(self, input_ids, past_key_values=None, use_cache=True, position_ids=None):
        ids = input_ids.float()[:, None, :, None]  # k, v: [1, 1, T, 1]
        past_key_values.update(ids, ids, 0)
        return types.SimpleNamespace(logits=self.table[input_ids].log())  # [1, T, V]


# Rows: the distribution after each token. The draft's rows have a top token at or above the
# shipped confidence (0.3) and others below it, except row 2 (every q < 0.3: the chain stops
# there); the draft is under-confident (row 0), over-confident (row 4) or prefers other tokens
# (rows 1, 3), so both acceptance and rejection are common.
BIGRAM_P = rows([0.55, 0.15, 0.10, 0.10, 0.10],
                [0.10, 0.20, 0.50, 0.10, 0.10],
                [0.15, 0.15, 0.15, 0.40, 0.15],
                [0.30, 0.10, 0.10, 0.10, 0.40],
                [0.20, 0.20, 0.20, 0.20, 0.20])
BIGRAM_Q = rows([0.45, 0.20, 0.15, 0.10, 0.10],
                [0.10, 0.40, 0.25, 0.15, 0.10],
                [0.22, 0.20, 0.20, 0.20, 0.18],
                [0.35, 0.05, 0.10, 0.20, 0.30],
                [0.10, 0.10, 0.10, 0.10, 0.60])
CHAIN_DRAWS = 3000
CHAIN_TOKENS = 3  # the law of the first three tokens is checked
CHAIN_MAX_TOKENS = 5  # room for a first chain of 4 drafts


def bigram_law(prompt_last: int, n: int) -> dict[tuple[int, ...], float]:
    """P(first n tokens) after a prompt ending in ``prompt_last``, by enumeration."""
    table = BIGRAM_P.double()
    law = {}
    for tokens in itertools.product(range(table.shape[0]), repeat=n):
        prob, last = 1.0, prompt_last
        for t in tokens:
            prob, last = prob * float(table[last, t]), t
        law[tokens] = prob
    return law


def test_model_draft_chains_keep_the_target_distribution():
    """Chains of 4 drafts with the shipped confidence cut-off: the joint law of the first three
    tokens and each one's marginal match the target's exactly. (The old cut-off, on the drawn
    token's own probability, skewed the second token by ~10 points here.)"""
    sampling = SamplingParams(temperature=1.0)
    target, draft_state = KVState(Bigram(BIGRAM_P)), KVState(Bigram(BIGRAM_Q))
    prompt = [3, 0]
    target.extend(prompt[:-1])
    generator = torch.Generator().manual_seed(2024)
    drafter = ModelDrafter(draft_state, BIGRAM_P.shape[1], sampling, CUT_OFF, generator)
    planner = FixedPlanner(drafter, SHIPPED.draft_max)
    joint, marginals = Counter(), [Counter() for _ in range(CHAIN_TOKENS)]
    for _ in range(CHAIN_DRAWS):
        target.rollback(len(prompt) - 1)
        out = speculative_decode(target, list(prompt), planner, sampling, max_tokens=CHAIN_MAX_TOKENS,
                                 stop=lambda t: None, deadline=math.inf, generator=generator)
        first = tuple(out.tokens[:CHAIN_TOKENS])
        joint[first] += 1
        for i, t in enumerate(first):
            marginals[i][t] += 1
    stats = planner.stats["draft"]
    law = bigram_law(prompt[-1], CHAIN_TOKENS)
    assert chi_square_pvalue(joint, law, CHAIN_DRAWS) > ALPHA
    for i in range(CHAIN_TOKENS):
        marginal = {}
        for tokens, prob in law.items():
            marginal[tokens[i]] = marginal.get(tokens[i], 0.0) + prob
        assert chi_square_pvalue(marginals[i], marginal, CHAIN_DRAWS) > ALPHA, f"token {i + 1}"
    assert 0 < stats.accepted < stats.proposed, "both acceptance and rejection must occur"
    assert planner.chains[CHAIN_MAX_TOKENS - 1] > CHAIN_DRAWS // 4, "chains of 4 drafts must be common"
    assert planner.cut > CHAIN_DRAWS // 10, "the confidence cut-off must fire too"


class FirstTokenIn:
    """A constraint like token healing's, on a bigram vocabulary: the first output token must be
    one of ``allowed``; nothing binds after it."""

    def __init__(self, allowed: set[int]):
        self.allowed = allowed

    def row(self, logits, before):
        if before:
            return logits
        out = torch.full_like(logits, float("-inf"))
        keep = sorted(self.allowed)
        out[keep] = logits[keep]
        return out

    def rows(self, logits, before, draft):
        return torch.stack([self.row(logits[0], before), *logits[1:]]) if not before else logits

    def settled(self, generated):
        return len(generated) > 0

    def allows(self, generated, draft):
        return len(draft) if generated or not draft or draft[0] in self.allowed else 0


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_model_draft_chains_under_a_constraint_keep_the_constrained_law(temperature):
    """Under token healing the draft model drafts from q restricted to what the constraint
    allows (so its first token re-types the cut text as the target's will); verification
    divides by that q, so the output keeps the target's constrained law: the first token ~
    p restricted to the allowed set, the next ones ~ p. Greedy: exactly the target's greedy
    under the constraint, and the first draft token always allowed."""
    sampling = SamplingParams(temperature=temperature)
    allowed = {1, 3}  # the draft prefers 0 after token 0; the target's own favourite is 0 too
    prompt = [3, 0]
    target, draft_state = KVState(Bigram(BIGRAM_P)), KVState(Bigram(BIGRAM_Q))
    target.extend(prompt[:-1])
    generator = torch.Generator().manual_seed(77)
    drafter = ModelDrafter(draft_state, BIGRAM_P.shape[1], sampling, 0.0, generator,
                           constraint=FirstTokenIn(allowed), prompt_length=len(prompt))
    planner = FixedPlanner(drafter, 3)
    first_drafts, joint = Counter(), Counter()
    draws = CHAIN_DRAWS if temperature > 0 else 3
    for _ in range(draws):
        target.rollback(len(prompt) - 1)
        out = speculative_decode(target, list(prompt), planner, sampling, max_tokens=4, stop=lambda t: None,
                                 deadline=math.inf, generator=generator, constraint=FirstTokenIn(allowed))
        joint[tuple(out.tokens[:2])] += 1
        draft = drafter.propose(list(prompt), 1)
        first_drafts[draft.tokens[0]] += 1
        assert torch.count_nonzero(draft.probs[0]) == len(allowed) and float(draft.probs[0].sum()) == pytest.approx(1.0)
    assert set(first_drafts) <= allowed
    law = {}
    p1 = BIGRAM_P[0].double()
    restricted = sum(float(p1[t]) for t in allowed)
    for (a, b), prob in bigram_law(0, 2).items():
        if a in allowed:
            law[(a, b)] = prob / restricted
    if temperature > 0:
        assert chi_square_pvalue(joint, law, draws) > ALPHA
        stats = planner.stats["draft"]
        assert 0 < stats.accepted < stats.proposed
    else:
        greedy = max(allowed, key=lambda t: float(p1[t]))
        assert set(joint) == {(greedy, int(BIGRAM_P[greedy].argmax()))}
        assert planner.stats["draft"].accepted > 0


def test_a_constrained_chain_with_no_allowed_mass_drafts_nothing():
    """top-p keeps only the draft's favourite; where the constraint rules it out, q has no
    allowed token left: the draft model proposes nothing (a plain step), it does not fail."""
    sampling = SamplingParams(temperature=1.0, top_p=0.01)
    drafter = ModelDrafter(KVState(Bigram(BIGRAM_Q)), BIGRAM_Q.shape[1], sampling, 0.0,
                           torch.Generator().manual_seed(1), constraint=FirstTokenIn({1, 3}), prompt_length=2)
    assert drafter.propose([3, 0], 4).tokens == []  # after token 0 the draft's favourite is 0


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_point_mass_draft_the_constraint_rules_out_is_cut_before_the_verify(temperature):
    """A lookup draft whose first token the constraint masks could only be rejected: the loop
    verifies the step without it (one row, not k + 1), and the output is the same law."""

    class Lookup:
        def propose(self, seq, k):
            return Draft([0, 0, 0][:k], "lookup:current")

    class Recording(FixedPlanner):
        def __init__(self, drafter, length):
            super().__init__(drafter, length)
            self.verified: list[list[int]] = []  # each step's draft as verified

        def record(self, draft, accepted, ms=None, head_row_ms=0.0):
            self.verified.append(list(draft.tokens))
            super().record(draft, accepted, ms, head_row_ms)

    sampling = SamplingParams(temperature=temperature)
    prompt = [3, 0]
    target = KVState(Bigram(BIGRAM_P))
    target.extend(prompt[:-1])
    planner = Recording(Lookup(), 3)
    out = speculative_decode(target, list(prompt), planner, sampling, max_tokens=4, stop=lambda t: None,
                             deadline=math.inf, generator=torch.Generator().manual_seed(3),
                             constraint=FirstTokenIn({1, 3}))
    assert planner.verified[0] == []  # 0 is not allowed first: a plain step
    assert out.tokens[0] in {1, 3}
    assert any(planner.verified[1:]), "after the first token nothing binds: drafts are verified again"


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_draft_chain_stops_on_confidence_not_on_the_token_drawn(monkeypatch, temperature):
    """Exact, draw-free: the chain goes on iff the draft's top probability reaches the cut-off,
    whatever token is drawn. (At temperature 0 the token drawn is the argmax, so this is the
    argmax's probability, as it always was.)"""
    sampling = SamplingParams(temperature=temperature)
    confident = rows(*[[0.45, 0.25, 0.15, 0.10, 0.05]] * 5)  # top >= 0.3, the rest below it
    unsure = rows(*[[0.28, 0.27, 0.20, 0.15, 0.10]] * 5)  # every token below 0.3
    if temperature > 0:  # draw the least likely token every time
        monkeypatch.setattr(drafters.model, "sample", lambda q, params, generator: int(q.argmin()))
    drawn = 4 if temperature > 0 else 0
    for table, chain in ((confident, SHIPPED.draft_max), (unsure, 1)):
        drafter = ModelDrafter(KVState(Bigram(table)), 5, sampling, CUT_OFF)
        draft = drafter.propose([1, 2], SHIPPED.draft_max)
        assert draft.tokens == [drawn] * chain
        assert torch.allclose(draft.probs, table[:1].expand(chain, -1))


# -- the tiny random-weight pair --------------------------------------------------------------

class FixedDrafter:
    """A deterministic drafter (what prompt lookup is): always proposes the same chain."""

    source = "lookup:current"

    def __init__(self, chain: list[int]):
        self.chain = chain

    def propose(self, seq, k):
        return Draft(self.chain[:k], self.source, None, 4)


def sample_two_tokens(engine, prompt: list[int], drafter, sampling, seed: int) -> tuple[Counter, Counter, dict]:
    target = KVState(engine.pair.target)
    target.extend(prompt[:-1], last_only=True)
    generator = torch.Generator().manual_seed(seed)
    if drafter == "model":
        drafter = ModelDrafter(KVState(engine.pair.draft), engine.vocab_size, sampling, 0.0, generator)
    planner = FixedPlanner(drafter, 3)
    first, second = Counter(), Counter()
    for _ in range(DRAWS):
        target.rollback(len(prompt) - 1)
        out = speculative_decode(target, list(prompt), planner, sampling, max_tokens=2, stop=lambda t: None,
                                 deadline=math.inf, generator=generator)
        first[out.tokens[0]] += 1
        second[out.tokens[1]] += 1
    return first, second, planner.stats


@pytest.mark.parametrize("draft_kind", ["model", "fixed"])
def test_speculative_sampling_matches_target_distribution(engine, sample_source, draft_kind):
    prompt = engine.prompts.encode(sample_source[:400])
    sampling = SamplingParams(temperature=TEMPERATURE)
    p1, p2 = exact_marginals(engine.pair.target, prompt, sampling)
    if draft_kind == "fixed":
        # Propose the target's likeliest first token (often accepted) then an unlikely one
        # (often rejected), so both branches of the point-mass rule are exercised.
        drafter = FixedDrafter([int(p1.argmax()), int(p1.argmin()), int(p1.argmax())])
    else:
        drafter = "model"
    first, second, stats = sample_two_tokens(engine, prompt, drafter, sampling, seed=1234)
    source = stats[next(iter(stats))]
    assert 0 < source.accepted < source.proposed, "both acceptance and rejection must occur"
    assert chi_square_pvalue(first, p1, DRAWS) > ALPHA
    assert chi_square_pvalue(second, p2, DRAWS) > ALPHA


def test_chi_square_detects_a_biased_sampler(engine, sample_source):
    """The test has teeth: greedy-biased draws (always the argmax half the time) fail it."""
    prompt = engine.prompts.encode(sample_source[:400])
    sampling = SamplingParams(temperature=TEMPERATURE)
    p1, _ = exact_marginals(engine.pair.target, prompt, sampling)
    generator = torch.Generator().manual_seed(7)
    draws = torch.multinomial(p1, DRAWS, replacement=True, generator=generator).tolist()
    biased = Counter(draws[: DRAWS // 2] + [int(p1.argmax())] * (DRAWS - DRAWS // 2))
    assert chi_square_pvalue(biased, p1, DRAWS) < ALPHA


# -- token trees ------------------------------------------------------------------------------

class BigramTreePath(BasicPath):
    """A forward path over a bigram table that runs token trees (``KVState.extend_tree``): a
    bigram's row depends on a node's own token only, so what a tree test checks is that each
    node's row is read where it belongs and the kept path is the one that stood."""

    name = "bigram"
    trees = True

    def __init__(self, table: torch.Tensor):
        self.table = table

    def new_cache(self) -> list:
        return []

    def forward(self, input_ids, cache, last_only=False, parents=None):
        cache.extend(input_ids[0].tolist())
        logits = self.table[input_ids[0]].log()
        return logits[-1:] if last_only else logits

    def crop(self, cache, length):
        del cache[length:]

    def keep(self, cache, start, slots):
        cache[start:] = [cache[slot] for slot in slots]

    def consistent(self, cache, length):
        return len(cache) == length

    def nbytes(self, cache):
        return 0


class TreePlanner(FixedPlanner):
    """A draft-model chain and two fixed lookup drafts, one starting as the chain may, one not,
    verified as one tree every step."""

    def __init__(self, drafter, length: int, lookups: list[list[int]]):
        super().__init__(drafter, length)
        self.lookups = lookups
        self.trees = 0

    def propose(self, seq, room, lead=0):
        asked = min(room, self.length)
        if asked <= 0:
            return Draft([], "none")
        branches = [self.drafter.propose(seq, asked)]
        branches += [Draft(tokens[:asked], "lookup:open") for tokens in self.lookups]
        self.trees += 1
        return drafters.DraftTree.of(branches)

    def record_tree(self, tree, accepted, ms=None, head_row_ms=0.0):
        for draft in tree.branches:
            self.record(draft, sum(1 for a, b in zip(draft.tokens, accepted) if a == b))


def test_token_trees_keep_the_target_distribution():
    """Sampled decoding where every step verifies a tree of a draft-model chain and two lookup
    drafts (one shares the target's likeliest start, one not): the joint law of the first three
    tokens matches the target's exactly."""
    sampling = SamplingParams(temperature=1.0)
    target = KVState(Bigram(BIGRAM_P), BigramTreePath(BIGRAM_P))
    draft_state = KVState(Bigram(BIGRAM_Q))
    prompt = [3, 0]
    target.extend(prompt[:-1])
    generator = torch.Generator().manual_seed(7)
    drafter = ModelDrafter(draft_state, BIGRAM_P.shape[1], sampling, 0.0, generator)
    planner = TreePlanner(drafter, 3, lookups=[[0, 2, 3], [4, 4]])
    joint = Counter()
    for _ in range(CHAIN_DRAWS):
        target.rollback(len(prompt) - 1)
        out = speculative_decode(target, list(prompt), planner, sampling, max_tokens=CHAIN_TOKENS,
                                 stop=lambda t: None, deadline=math.inf, generator=generator)
        joint[tuple(out.tokens[:CHAIN_TOKENS])] += 1
        assert target.ids == prompt + out.tokens[:-1]  # the cache kept the path that stood
    assert chi_square_pvalue(joint, bigram_law(prompt[-1], CHAIN_TOKENS), CHAIN_DRAWS) > ALPHA
    assert planner.stats["lookup:open"].accepted > 0 and planner.stats["draft"].accepted > 0


def test_a_biased_tree_rule_is_caught(monkeypatch):
    """The same check fails when the rule is wrong: here, when no draft stands, the lookup
    draft that was just rejected comes out as the target's own token a third of the time (as if
    a rejected point mass were left in p)."""
    from specd.engine.speculation import verify as verification

    original = verification.verify_tree

    def biased(rows, tree, sampling, generator, out, constraint=None):
        path, own = original(rows, tree, sampling, generator, out, constraint)
        if not path and torch.rand((), generator=generator).item() < 1 / 3:
            return [], tree.branches[-1].tokens[0]  # the lookup draft, rejected, drawn anyway
        return path, own

    monkeypatch.setattr(verification, "verify_tree", biased)
    sampling = SamplingParams(temperature=1.0)
    target = KVState(Bigram(BIGRAM_P), BigramTreePath(BIGRAM_P))
    prompt = [3, 0]
    target.extend(prompt[:-1])
    generator = torch.Generator().manual_seed(7)
    drafter = ModelDrafter(KVState(Bigram(BIGRAM_Q)), BIGRAM_P.shape[1], sampling, 0.0, generator)
    planner = TreePlanner(drafter, 1, lookups=[[4]])
    first = Counter()
    for _ in range(CHAIN_DRAWS):
        target.rollback(len(prompt) - 1)
        out = speculative_decode(target, list(prompt), planner, sampling, max_tokens=2,
                                 stop=lambda t: None, deadline=math.inf, generator=generator)
        first[out.tokens[0]] += 1
    assert planner.trees >= CHAIN_DRAWS
    assert chi_square_pvalue(first, BIGRAM_P[0], CHAIN_DRAWS) < ALPHA
