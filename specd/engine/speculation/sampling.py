"""Token choice from logits: greedy at temperature 0, else tempered (and top-p) sampling."""

from __future__ import annotations

from dataclasses import dataclass

import torch


# The smallest temperature divided by: float32 keeps 1e-30 (its smallest normal is ~1.2e-38),
# and any logit gap over 1e-30 x 3.4e38 is -inf after the division, which softmax handles.
MIN_TEMPERATURE = 1e-30


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution tokens are drawn from: softmax(logits / T), restricted to the top-p set.
    Greedy uses T = 1 here (only the argmax matters; the probabilities serve confidence checks).

    Safe for every value the options accept, so an extreme one cannot make ``multinomial`` fail:
    - the logits are shifted by their maximum before dividing by T, so the top logit is exactly 0
      at any temperature (a tiny T sends the rest to -inf, which softmax maps to 0, instead of
      dividing inf by inf), and T is floored where float32 would round it to 0;
    - the top-p set always keeps the most probable token (a top_p below float32's smallest value
      compares as 0 and would drop them all);
    - a row that still holds no mass (logits that were all -inf or NaN) becomes its argmax."""
    temperature = max(params.temperature, MIN_TEMPERATURE) if not params.greedy else 1.0
    logits = logits.float()
    shifted = logits - logits.amax(dim=-1, keepdim=True)
    probs = torch.softmax(shifted / temperature, dim=-1)
    if params.top_p < 1.0 and not params.greedy:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # keep the smallest set whose mass reaches top_p, the first token always
        drop = sorted_probs.cumsum(-1) - sorted_probs >= params.top_p
        drop[..., 0] = False
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
        probs = probs / probs.sum(-1, keepdim=True)
    empty = ~(probs.sum(-1, keepdim=True) > 0)  # NaN compares False: caught here too
    if bool(empty.any()):
        top = torch.nan_to_num(logits, nan=-torch.inf).argmax(-1, keepdim=True)
        fallback = torch.zeros_like(probs).scatter(-1, top, 1.0)
        probs = torch.where(empty, fallback, probs.nan_to_num(0.0))
    return probs


def sample(probs: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """argmax when greedy, else one draw from ``probs`` [V]."""
    if params.greedy:
        return int(probs.argmax())
    return int(torch.multinomial(probs, 1, generator=generator))
