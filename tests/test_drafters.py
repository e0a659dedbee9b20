"""A drafter is one class and one registry line: a drafter defined here, registered, drafts a
real completion through ``Engine``; the output is still the target's greedy one, and the planner
prices and records its drafts under the drafter's own source and kind."""

from __future__ import annotations

from typing import Sequence

from engine_helpers import assert_lossless, make_engine
from specd.engine import CompletionRequest
from specd.engine.speculation import drafters
from specd.engine.speculation.drafters import Draft, Drafter, DrafterInputs
from tiny import make_tiny_pair

MAX_TOKENS = 16
WRONG_AT = 5  # the chain's token that the target does not write


class FixedChain(Drafter):
    """Proposes a fixed token sequence after a fixed prompt: its rest from where the output is."""

    source = "fixed"
    priors = {"fixed/chain": (0.9, 0.9)}
    chain: list[int] = []  # set by the test: the target's greedy continuation, one token wrong
    prompt_length = 0

    @staticmethod
    def kind(draft: Draft) -> str:
        return "fixed/chain"

    @classmethod
    def for_request(cls, inputs: DrafterInputs) -> "FixedChain":
        return cls()

    def propose(self, seq: Sequence[int], k: int) -> Draft:
        done = len(seq) - self.prompt_length
        return Draft(self.chain[done:done + k], self.source)


def test_a_drafter_added_to_the_registry_drafts_and_the_output_is_the_targets(tiny_root, sample_source, monkeypatch):
    engine = make_engine(*make_tiny_pair(tiny_root / "llama", "llama"), prefix_tokens=384, suffix_tokens=128)
    offset = sample_source.index("    def sell")
    request = CompletionRequest(uri="file:///fixed.py", text=sample_source, offset=offset, max_tokens=MAX_TOKENS,
                                stop_at_block_end=False, kv_reuse=False, use_draft_model=False, use_lookup=False)
    plain = engine.complete(request)  # no drafter: its prompt, and what the target writes after it
    assert_lossless(engine, plain, MAX_TOKENS)
    assert plain.stop_reason == "max_tokens" and not plain.sources
    written = plain.token_ids

    wrong = (written[WRONG_AT] + 1) % engine.vocab_size
    monkeypatch.setattr(FixedChain, "prompt_length", len(plain.prompt_ids))
    monkeypatch.setattr(FixedChain, "chain", [*written[:WRONG_AT], wrong, *written[WRONG_AT + 1:]])
    monkeypatch.setattr(drafters, "REGISTRY", (*drafters.REGISTRY, FixedChain.for_request))
    result = engine.complete(request)

    assert result.prompt_ids == plain.prompt_ids
    assert_lossless(engine, result, MAX_TOKENS)  # transformers' generate(do_sample=False)
    assert result.token_ids == written
    assert set(result.sources) == {"fixed"}
    fixed = result.sources["fixed"]
    assert fixed.accepted == MAX_TOKENS - 2 and fixed.proposed > fixed.accepted  # all but the wrong token and the last
    assert result.target_forwards == 2  # up to the wrong token, then the rest
    assert engine.planning.priors["fixed/chain"] == (0.9, 0.9)
    assert engine.planning.acceptance["fixed/chain"].first > 0.9  # learnt: both drafts' first tokens stood
    assert engine.stats()["acceptance"]["fixed"]["accepted"] == fixed.accepted


def test_the_draft_models_agreement_is_measured_at_load_and_is_its_prior(llama_pair):
    """The engine measures at load how often the draft model's greedy next token is the target's
    on a sample of code, and prices the draft model from that before any request: the target as
    its own draft agrees everywhere, a random draft of another shape far less."""
    target, draft = llama_pair
    itself = make_engine(target, target, free_drafting=False, draft_confidence=0.0)
    other = make_engine(target, draft, free_drafting=False)
    assert itself.agreement.first == 1.0 and itself.agreement.then == 1.0
    assert other.agreement.first < 0.5
    # auto: the draft agrees everywhere, so its chains go on wherever a chain token pays at all
    auto = make_engine(target, target, free_drafting=False)
    assert auto.draft_confidence == (0.0 if auto.planning.costs.break_even_agreement() <= 1.0 else 1.0)
    assert auto.agreement.confidence == auto.draft_confidence
    for engine in (itself, other):
        assert engine.planning.of("draft").first == engine.agreement.prior[0]
        assert engine.stats()["planner"]["draft_agreement"]["positions"] == engine.agreement.positions > 100
    assert make_engine(target, None, free_drafting=False).agreement is None
