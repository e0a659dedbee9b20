"""The draft model as a drafter: a chain sampled from the small model of the pair, stopped early
when its confidence falls. Drafting runs the model's forwards on its own KV cache, so the planner
prices a chain before drafting it (``KVCost``: the tokens the cache must catch up on, the
forwards it ran) and runs it only when it pays."""

from __future__ import annotations

from typing import Sequence

import torch

from specd.engine.caches import KVState
from specd.engine.options import EngineOptions
from specd.engine.speculation.drafters.base import EMPTY, Draft, Drafter, DrafterInputs, KVCost
from specd.engine.speculation.healing import Constraint
from specd.engine.speculation.sampling import SamplingParams, probabilities, sample


class ModelDrafter(Drafter):
    """Chain from the draft model; stops early when its confidence (the top probability of its
    next-token distribution, known before the draw) falls below a threshold."""

    source = "draft"
    priors = {source: (0.5, 0.5)}

    def __init__(self, state: KVState, vocab_size: int, sampling: SamplingParams, confidence: float,
                 generator: torch.Generator | None = None, longest: int = EngineOptions.draft_max,
                 constraint: Constraint | None = None, prompt_length: int = 0):
        """``constraint``: token healing's (``healing.Constraint``), which the target's first tokens
        obey: the chain draws from q under it too, so its first token re-types the cut text as the
        target's will (unconstrained, the draft's favourite often skips it and is rejected).
        ``prompt_length``: where the output starts in the ``seq`` a chain is drafted after."""
        self.state = state
        self.constraint = constraint
        self.prompt_length = prompt_length
        self.vocab_size = vocab_size  # the target's: q must index the same token ids as p
        self.sampling = sampling
        self.confidence = confidence
        self.generator = generator
        self.longest = longest
        self.cost = KVCost(self.source, state)

    @classmethod
    def for_request(cls, inputs: DrafterInputs) -> "ModelDrafter | None":
        if not inputs.use_draft:
            return None
        return cls(inputs.state.draft, inputs.vocab_size, inputs.sampling, inputs.draft_confidence,
                   inputs.generator, inputs.options.draft_max, inputs.constraint, inputs.prompt_length)

    def _fit_vocab(self, q: torch.Tensor) -> torch.Tensor:
        if q.shape[-1] == self.vocab_size:
            return q
        if q.shape[-1] > self.vocab_size:
            q = q[..., : self.vocab_size]
            return q / q.sum(-1, keepdim=True)
        return torch.nn.functional.pad(q, (0, self.vocab_size - q.shape[-1]))

    def _constrained(self, q: torch.Tensor, before: list[int]) -> torch.Tensor | None:
        """q under the constraint after the output ``before``: zero where it disallows, renormalised
        (q itself once the cut text is re-typed); None where no allowed token has mass."""
        free = torch.zeros_like(q)
        mask = self.constraint.row(free, before)
        if mask is free or not bool(torch.isinf(mask).any()):  # ``row`` hands an unconstrained row back
            return q
        q = q.masked_fill(torch.isinf(mask), 0.0)
        total = q.sum()
        return q / total if total > 0 else None

    def propose(self, seq: Sequence[int], k: int) -> Draft:
        if k <= 0:
            return EMPTY
        # Once the output has re-typed the cut text nothing binds (a walk of its first tokens).
        constrained = self.constraint is not None and not self.constraint.settled(seq[self.prompt_length:])
        logits = self.state.logits_after(seq)  # [1, V]
        tokens: list[int] = []
        probs: list[torch.Tensor] = []
        while True:
            q = self._fit_vocab(probabilities(logits[-1], self.sampling))  # [V]
            if constrained:
                q = self._constrained(q, [*seq[self.prompt_length:], *tokens])
                if q is None:  # no allowed token has any mass: nothing this chain could add stands
                    break
            # Stop on q alone, before drawing: a cut that depended on the drawn token would
            # skew the drafted tokens away from q, and verification divides by q (not lossless).
            # Greedy draws the argmax, so this is the argmax's confidence there.
            if tokens and q.max().item() < self.confidence:
                break
            token = sample(q, self.sampling, self.generator)
            tokens.append(token)
            probs.append(q)
            if len(tokens) == k:
                break
            logits = self.state.extend([token], last_only=True)
        if not tokens:  # the constraint left the first token no mass (top-p kept only masked ones)
            return EMPTY
        return Draft(tokens, self.source, torch.stack(probs))
