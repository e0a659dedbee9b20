"""Every transformers call whose spelling changes between versions lives here.

transformers itself is imported only where a call needs it (``new_cache``), so importing the
engine, and serving a GGUF model on llama.cpp's forward, never loads transformers' model
machinery (``transformers.modeling_utils`` and what it pulls in: seconds of start-up).

Supported: transformers 5.x. Known differences handled:
- the cache keyword of ``forward``: ``past_key_values`` (5.0 - 5.2x) became ``cache`` (later 5.x);
- ``DynamicCache.crop`` takes a negative count of tokens to drop in 5.x (4.x took a length);
- per-layer caches: ``cache.layers``, each with its own ``get_seq_length`` and ``crop`` (5.x);
- ``DynamicCache(config=...)`` builds per-layer caches (sliding-window layers included).
"""

from __future__ import annotations

import functools
import inspect
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from transformers import DynamicCache, PreTrainedModel


@functools.lru_cache(maxsize=None)
def _cache_kwarg(model_cls: type) -> str:
    params = inspect.signature(model_cls.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def cache_keyword(model: PreTrainedModel) -> str:
    """The keyword ``forward`` (and so ``generate()``) takes a cache by for this model."""
    return _cache_kwarg(type(model))


@functools.lru_cache(maxsize=None)
def _accepts(model_cls: type, name: str) -> bool:
    return name in inspect.signature(model_cls.forward).parameters


def new_cache(model: PreTrainedModel) -> DynamicCache:
    """A cache with a layer per decoder layer (from the model's config) whose layers keep every
    position: a sliding window's layer would drop what falls out of the window and then refuse
    to roll back past it (``crop`` raises once the window is full), and every rejected draft is a
    rollback. The model's attention mask still slides, so the logits are the same."""
    from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer

    cache = DynamicCache(config=model.config)
    cache.layers = [DynamicLayer() if isinstance(layer, DynamicSlidingWindowLayer) else layer
                    for layer in cache.layers]
    return cache


def cache_length(cache: DynamicCache) -> int:
    return int(cache.get_seq_length())


def crop_cache(cache: DynamicCache, length: int) -> None:
    """Keep the first ``length`` positions. A rollback is a crop, never a recompute."""
    drop = cache_length(cache) - length
    if drop < 0:
        raise ValueError(f"cannot crop a cache of {cache_length(cache)} tokens to {length}")
    if drop:
        cache.crop(-drop)


def layer_lengths(cache: DynamicCache) -> list[int]:
    """Positions each layer holds: all equal, except after a forward that failed part-way."""
    return [int(layer.get_seq_length()) for layer in cache.layers]


def crop_layers(cache: DynamicCache, length: int) -> None:
    """Keep the first ``length`` positions of every layer, each cropped by its own count. A
    forward that failed part-way leaves the layers it reached longer than the rest, where one
    count for all layers (``DynamicCache.crop``) would cut the rest short."""
    lengths = layer_lengths(cache)
    if min(lengths, default=length) < length:
        raise ValueError(f"cannot crop cache layers of {lengths} tokens to {length}")
    for layer, held in zip(cache.layers, lengths):
        if held > length:
            layer.crop(length - held)  # 5.x: a negative count of tokens to drop


def cache_nbytes(cache: DynamicCache) -> int:
    total = 0
    for layer in getattr(cache, "layers", []):
        for name in ("keys", "values"):
            tensor = getattr(layer, name, None)
            if isinstance(tensor, torch.Tensor):
                total += tensor.numel() * tensor.element_size()
    return total


@torch.inference_mode()
def forward(model: PreTrainedModel, input_ids: torch.Tensor, cache: DynamicCache, last_only: bool = False) -> torch.Tensor:
    """Run ``input_ids`` [1, T] after what ``cache`` holds; return float32 logits [T, V] (or [1, V])."""
    past = cache_length(cache)
    positions = torch.arange(past, past + input_ids.shape[1], device=input_ids.device).unsqueeze(0)
    kwargs = {_cache_kwarg(type(model)): cache, "use_cache": True, "position_ids": positions}
    if last_only and _accepts(type(model), "logits_to_keep"):
        kwargs["logits_to_keep"] = 1
    out = model(input_ids=input_ids, **kwargs)
    logits = out.logits[0]
    return (logits[-1:] if last_only else logits).float()


def is_oom(err: BaseException) -> bool:
    return isinstance(err, torch.OutOfMemoryError) or "out of memory" in str(err).lower()
