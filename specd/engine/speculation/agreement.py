"""How far the draft model agrees with the target, measured at load on a sample of code, and
what follows from it: the draft model's prior acceptance, and the confidence below which its
chains stop.

Both models read the same code (``code_sample``: a standard-library module's source) with
every row of logits (``costs.calibrate`` does this on its context, so the target's prefill
serves both), and their greedy next tokens are compared position by position (teacher-forced).

- ``Agreement``: how often they agree (``first``), and how often again right after an
  agreement where the draft is confident enough to draft on (``then``; for a feature head, whose
  chain reads its own predicted states, its chained second token: ``HeadState.chained_next``). It is the planner's
  prior for the draft model: a pair whose draft agrees 90% of the time is priced as such from
  its first request, not at a guess the planner could only correct by running it (a draft whose
  catch-up on a long prompt looks dear at a guessed 50% might never run to be measured).
- ``choose_confidence``: the draft model stops a chain where its top probability falls below a
  threshold. The right threshold is a property of the pair: small code drafts spread their
  probability thin, and on the development pairs tokens drafted at a top probability of 0.1-0.2
  still agree most of the time, below 0.1 about a third of it (docs/engine.md has the table). So
  with ``engine.draft_confidence = auto`` it is where the agreement, as a function of
  confidence, falls below what a chain token must reach to pay for itself
  (``ForwardCosts.break_even_agreement``).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch

# Whose source is the calibration's context where the tokenizer can read it: one of the modules the
# demo and development pairs never trained on (``specd.demo.heldout``), so their drafts are not
# judged on code they learnt. Of those, the one whose sample both the feature head and the small
# drafts agree on about as often as on held-out code of another project (docs/engine.md, "A
# feature head as the draft", has the figures); ordinary classes and methods, where textwrap's
# opens on one long docstring and reprlib's on near-repeated lines that flatter every draft.
SAMPLE_MODULE = "graphlib"
SAMPLE_TOKENS = 256  # tokens of it (costs.CALIBRATION_CONTEXT)
PIECE = 64  # tokens per forward when every row's logits are read (152k-token vocabularies: 39 MB)
FLOOR = 0.02  # a measured agreement is kept within [this, 1 - this] as a prior
NO_SAMPLE_CONFIDENCE = 0.3  # the threshold under ``auto`` when nothing could be measured


@dataclass(frozen=True)
class AgreementSample:
    """Both models' greedy next token at each position of the sample, and the draft model's
    probability of its own (its confidence, softmax at temperature 1)."""

    target_next: list[int]
    draft_next: list[int]
    draft_confidence: list[float]
    # For a draft whose chain reads its own predictions (a feature head): at each position where
    # it agreed and the code went on with that token, its next drafted token read as a chain
    # reads it, and its probability; -1 elsewhere. None: a chain reads what the sample read.
    chained_next: list[int] | None = None
    chained_confidence: list[float] | None = None

    @property
    def agree(self) -> list[bool]:
        return [a == b for a, b in zip(self.target_next, self.draft_next)]


@dataclass(frozen=True)
class Agreement:
    """The draft model's agreement with the target on the sample (module docstring): ``first``,
    at any position; ``then``, at a position after one where they agreed and where the draft's
    confidence reaches ``confidence`` (below it a chain stops, which the planner learns as a
    token that did not stand)."""

    first: float
    then: float
    positions: int  # next tokens compared
    confidence: float  # the chain-stopping threshold ``then`` was counted under

    @classmethod
    def of(cls, sample: AgreementSample, confidence: float = 0.0) -> "Agreement":
        agree = sample.agree
        if not agree:
            raise ValueError("no positions to compare")
        if sample.chained_next is not None:  # the chain's own second tokens, where measured
            after = [token == wanted and c >= confidence for token, wanted, c
                     in zip(sample.chained_next, sample.target_next[1:], sample.chained_confidence) if token >= 0]
        else:
            drafts_on = [c >= confidence for c in sample.draft_confidence]
            after = [b and on for a, b, on in zip(agree, agree[1:], drafts_on[1:]) if a]
        first = sum(agree) / len(agree)
        then = sum(after) / len(after) if after else first
        return cls(first, then, len(agree), confidence)

    @property
    def prior(self) -> tuple[float, float]:
        """(first, then) kept off 0 and 1, where no count could move an estimate."""
        return tuple(min(max(rate, FLOOR), 1.0 - FLOOR) for rate in (self.first, self.then))

    def describe(self) -> dict:
        return {"first": round(self.first, 3), "then": round(self.then, 3), "positions": self.positions,
                "confidence": round(self.confidence, 4)}

    def summary(self, aside: str = "") -> str:
        """One line for the load's log, ``specd doctor`` and the bench's table; ``aside`` in brackets."""
        return (f"agrees with the target on {self.first:.0%} of {self.positions} positions of code, {self.then:.0%} "
                f"right after an agreement; chains stop below confidence {self.confidence:.2f}"
                + (f" ({aside})" if aside else ""))


def choose_confidence(sample: AgreementSample, break_even: float) -> float:
    """The lowest draft confidence at which the draft's tokens still agree with the target at
    least ``break_even`` of the time, by a monotone fit of agreement against confidence; 0.0
    where even its least confident tokens do, and 1.0 (chains of one token) where none do."""
    order = np.argsort(sample.draft_confidence, kind="stable")
    confidence = np.asarray(sample.draft_confidence, dtype=np.float64)[order]
    fitted = _increasing_fit(np.asarray(sample.agree, dtype=np.float64)[order])
    paying = np.nonzero(fitted >= break_even)[0]
    if not len(paying):
        return 1.0
    return 0.0 if paying[0] == 0 else float(confidence[paying[0]])


def _increasing_fit(values: np.ndarray) -> np.ndarray:
    """The least-squares non-decreasing fit of ``values`` (pool adjacent violators): the agreement
    at each confidence, read from its neighbours where a handful of samples are noisy. A dozen
    lines here rather than a dependency (scikit-learn's ``IsotonicRegression``) for one call."""
    means: list[float] = []
    sizes: list[int] = []
    for value in values:
        means.append(float(value))
        sizes.append(1)
        while len(means) > 1 and means[-2] > means[-1]:
            size = sizes[-2] + sizes[-1]
            means[-2] = (means[-2] * sizes[-2] + means[-1] * sizes[-1]) / size
            sizes[-2] = size
            means.pop()
            sizes.pop()
    return np.repeat(means, sizes)


def code_sample(encode: Callable[[str], list[int]] | None, vocab_size: int) -> list[int] | None:
    """``SAMPLE_TOKENS`` token ids of real code (a standard-library module's source from its
    first class or function on, so any Python install has it), or None where it cannot be read
    or tokenized into ids both models embed."""
    if encode is None:
        return None
    try:
        text = Path(importlib.import_module(SAMPLE_MODULE).__file__).read_text(encoding="utf-8")
        start = min((i for i in (text.find("\nclass "), text.find("\ndef ")) if i >= 0), default=0)
        ids = encode(text[start + 1:])
    except Exception:  # a zipped or .pyc-only library, a tokenizer that refuses the text
        return None
    if len(ids) < SAMPLE_TOKENS or max(ids[:SAMPLE_TOKENS]) >= vocab_size:
        return None
    return ids[:SAMPLE_TOKENS]


def with_chains(sample: AgreementSample, ids: Sequence[int],
                chained: tuple[list[int], list[float]]) -> AgreementSample:
    """``sample`` with a draft's chained second tokens (``HeadState.chained_next`` over ``ids``),
    kept where a chain would draft them: the draft agreed at i, and the code went on with that
    token, so the target's next token in the sample is the one after the chain's first."""
    tokens, confidence = chained
    keep = [i + 1 < len(ids) and a == b and ids[i + 1] == a
            for i, (a, b) in enumerate(zip(sample.target_next, sample.draft_next))]
    return replace(sample, chained_next=[t if k else -1 for t, k in zip(tokens, keep)],
                   chained_confidence=[c if k else 0.0 for c, k in zip(confidence, keep)])


def next_tokens(state, ids: Sequence[int], rows: int) -> tuple[list[int], list[float]]:
    """Run ``ids`` into ``state`` (a ``KVState``; in pieces, so a large vocabulary's rows stay
    small) and give the greedy next token at each position and its probability, over the first
    ``rows`` logits (the target's rows: a draft with a larger vocabulary proposes only tokens
    the target has)."""
    greedy: list[int] = []
    confidence: list[float] = []
    for start in range(0, len(ids), PIECE):
        top = torch.softmax(state.extend(ids[start:start + PIECE])[:, :rows].float(), dim=-1).max(-1)
        greedy.extend(top.indices.tolist())
        confidence.extend(top.values.tolist())
    return greedy, confidence
