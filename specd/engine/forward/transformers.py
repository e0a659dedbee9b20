"""transformers' own forward as a ``ForwardPath``: serves every architecture, over a
``DynamicCache`` (every version-sensitive call through ``specd.engine.compat``, looked up there at
each call, so a test that replaces one there reaches this path)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from specd.engine import compat
from specd.engine.forward.path import BasicPath

if TYPE_CHECKING:
    from transformers import DynamicCache, PreTrainedModel


class HFForward(BasicPath):
    """transformers' own forward over a ``DynamicCache``: serves every architecture. The
    interface ``KVState`` drives (``path.ForwardPath``), none of the optional capabilities:
    logits come with the forward, no token trees, nothing recorded."""

    name = "hf"

    def __init__(self, model: PreTrainedModel):
        self.model = model

    def new_cache(self) -> DynamicCache:
        return compat.new_cache(self.model)

    def forward(self, input_ids: torch.Tensor, cache: DynamicCache, last_only: bool = False) -> torch.Tensor:
        return compat.forward(self.model, input_ids, cache, last_only=last_only)

    def crop(self, cache: DynamicCache, length: int) -> None:
        compat.crop_layers(cache, length)

    def consistent(self, cache: DynamicCache, length: int) -> bool:
        """Every layer holds ``length`` positions (a forward that failed midway grew only some)."""
        return all(held == length for held in compat.layer_lengths(cache))

    def nbytes(self, cache: DynamicCache) -> int:
        return compat.cache_nbytes(cache)
