"""transformers' own forward as a ``ForwardPath``: serves every architecture, over a
``DynamicCache`` (every version-sensitive call through ``specd.engine.compat``)."""

from __future__ import annotations

import torch
from transformers import DynamicCache, PreTrainedModel

from specd.engine.compat import cache_nbytes, crop_layers, forward, layer_lengths, new_cache


class HFForward:
    """transformers' own forward over a ``DynamicCache``: serves every architecture. The
    interface ``KVState`` drives (shared with ``lean.LeanForward``)."""

    name = "hf"

    def __init__(self, model: PreTrainedModel):
        self.model = model

    def new_cache(self) -> DynamicCache:
        return new_cache(self.model)

    def forward(self, input_ids: torch.Tensor, cache: DynamicCache, last_only: bool = False) -> torch.Tensor:
        return forward(self.model, input_ids, cache, last_only=last_only)

    def crop(self, cache: DynamicCache, length: int) -> None:
        crop_layers(cache, length)

    def consistent(self, cache: DynamicCache, length: int) -> bool:
        """Every layer holds ``length`` positions (a forward that failed midway grew only some)."""
        return all(held == length for held in layer_lengths(cache))

    def nbytes(self, cache: DynamicCache) -> int:
        return cache_nbytes(cache)
