"""Speculative sampling keeps the target's distribution exactly: chi-square tests of the first
two sampled tokens against the target's exact marginals, with a deliberately different draft
model and with deterministic (lookup-style) drafts."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from scipy.stats import chi2

from engine_helpers import make_engine
from specd.engine.decode import AdaptiveLength, DraftPlanner, speculative_decode
from specd.engine.drafters import Draft, ModelDrafter
from specd.engine.kvcache import KVState
from specd.engine.sampling import SamplingParams, probabilities

DRAWS = 1000
TEMPERATURE = 1.5  # spread the tiny model's peaked distributions so several tokens matter
ALPHA = 1e-4  # false-alarm rate per test: these tests must not flake


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


def chi_square_pvalue(counts: Counter, probs: torch.Tensor, draws: int) -> float:
    """Pearson chi-square over categories expected >= 5 times, the rest pooled into one."""
    expected = probs * draws
    big = (expected >= 5).nonzero().flatten().tolist()
    observed = [counts.get(t, 0) for t in big]
    exp = [expected[t].item() for t in big]
    rest_exp = draws - sum(exp)
    rest_obs = draws - sum(observed)
    if rest_exp >= 5:
        observed.append(rest_obs)
        exp.append(rest_exp)
    statistic = sum((o - e) ** 2 / e for o, e in zip(observed, exp))
    return float(chi2.sf(statistic, df=len(exp) - 1))


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
    planner = DraftPlanner(None, drafter, AdaptiveLength(3, 3), AdaptiveLength(3, 3))
    first, second = Counter(), Counter()
    for _ in range(DRAWS):
        target.rollback(len(prompt) - 1)
        planner.model_length.current = 3
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
