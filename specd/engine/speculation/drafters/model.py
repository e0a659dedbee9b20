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
from specd.engine.speculation.sampling import SamplingParams, probabilities, sample


class ModelDrafter(Drafter):
    """Chain from the draft model; stops early when its confidence (the top probability of its
    next-token distribution, known before the draw) falls below a threshold."""

    source = "draft"
    priors = {source: (0.5, 0.5)}

    def __init__(self, state: KVState, vocab_size: int, sampling: SamplingParams, confidence: float,
                 generator: torch.Generator | None = None, longest: int = EngineOptions.draft_max):
        self.state = state
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
                   inputs.generator, inputs.options.draft_max)

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
            # Greedy draws the argmax, so this is the argmax's confidence there.
            if tokens and q.max().item() < self.confidence:
                break
            token = sample(q, self.sampling, self.generator)
            tokens.append(token)
            probs.append(q)
            if len(tokens) == k:
                break
            logits = self.state.extend([token], last_only=True)
        return Draft(tokens, self.source, torch.stack(probs))
