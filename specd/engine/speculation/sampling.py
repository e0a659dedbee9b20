"""Token choice from logits: greedy at temperature 0, else tempered (and top-p) sampling."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution tokens are drawn from: softmax(logits / T), restricted to the top-p set.
    Greedy uses T = 1 here (only the argmax matters; the probabilities serve confidence checks)."""
    temperature = params.temperature if not params.greedy else 1.0
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if params.top_p < 1.0 and not params.greedy:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # keep the smallest set whose mass reaches top_p (the first token always stays)
        drop = sorted_probs.cumsum(-1) - sorted_probs >= params.top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """argmax when greedy, else one draw from ``probs`` [V]."""
    if params.greedy:
        return int(probs.argmax())
    return int(torch.multinomial(probs, 1, generator=generator))
