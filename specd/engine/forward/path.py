"""The one interface every forward path offers ``specd.engine.caches.KVState``."""

from __future__ import annotations

from typing import Any, Protocol

import torch


class ForwardPath(Protocol):
    """How a model runs over its cache: ``transformers.HFForward`` (every architecture),
    ``lean.LeanForward`` (Llama- and GPT-2-family models, a static cache)."""

    name: str

    def new_cache(self) -> Any: ...
    def forward(self, input_ids: torch.Tensor, cache: Any, last_only: bool = False) -> torch.Tensor: ...
    def crop(self, cache: Any, length: int) -> None: ...
    def consistent(self, cache: Any, length: int) -> bool: ...
    def nbytes(self, cache: Any) -> int: ...
