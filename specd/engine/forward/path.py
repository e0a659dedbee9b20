"""The one interface every forward path offers ``specd.engine.caches.KVState`` and the engine:
what each path must do, and every optional capability, declared here once.

A path declares each capability itself: ``LeanForward`` sets every one it has, and paths without
them (transformers', llama.cpp's) take ``BasicPath``'s, which say "not here". Callers read the
attributes directly, never ``getattr(path, name, default)``, so a renamed capability fails loudly
(an AttributeError, and ``isinstance(path, ForwardPath)`` turns false) instead of quietly reading
as absent.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol, Sequence, runtime_checkable

import numpy as np
import torch


@runtime_checkable
class ForwardPath(Protocol):
    """How a model runs over its cache: ``transformers.HFForward`` (every architecture),
    ``lean.LeanForward`` (the lean families, a static cache), ``llamacpp.LlamaCppForward``
    (llama.cpp's kernels on a GGUF file)."""

    name: str  # "hf", "lean", "llamacpp": in logs, stats and bench reports
    description: str  # what ``specd doctor`` and the stats say of this path beyond its name ("": nothing)
    # forward(..., head=False) returns the final hidden states [T, D] and head() turns rows of
    # them into logits, so verification computes only the rows it reads (caches.LazyRows)
    lazy_head: bool
    # forward(..., rows_from=i) computes logits only for rows i.. (prompt tokens that ride with a
    # decode step need none), so a keystroke's new tokens run with the first step in one forward
    rows_from: bool
    trees: bool  # forward(..., parents=...) runs a token tree; keep() keeps one root-to-leaf path of it
    recordings: int  # forwards recorded for replay so far (such a forward is no measure of its width)
    replays: bool  # narrow forwards replay recorded graphs (CUDA graphs, see forward/graphs.py)
    # forward_ids() takes the ids as a list and gives float32 logits as a numpy array: a decode
    # step that never touches torch (on llama.cpp a torch tensor in and out of each step cost a
    # tenth of a small model's forward: docs/llamacpp.md)
    host_ids: bool
    # forward(..., head=False) returns the final hidden states [T, D] on any device, and head()
    # turns them into logits: a feature head (``specd.engine.feature_head``) can read them
    gives_hidden: bool

    def new_cache(self) -> Any: ...
    def forward(self, input_ids: torch.Tensor, cache: Any, last_only: bool = False) -> torch.Tensor: ...
    def crop(self, cache: Any, length: int) -> None: ...
    def consistent(self, cache: Any, length: int) -> bool: ...
    def nbytes(self, cache: Any) -> int: ...

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits [T, V] of final hidden states [T, D] (only where ``lazy_head``)."""
        ...

    def forward_ids(self, ids: list[int], cache: Any, last_only: bool = False, rows_from: int = 0) -> np.ndarray:
        """``forward`` of ``ids`` with the logits as a float32 numpy array (only where ``host_ids``)."""
        ...

    def keep(self, cache: Any, start: int, slots: Sequence[int]) -> None:
        """After a tree forward from ``start``: keep the first ``start`` positions and then the
        K/V of ``slots`` (a root-to-leaf path), moved into place (only where ``trees``)."""
        ...

    def prepare(self, cache: Any, ahead: int) -> int:
        """Idle work for ``cache``: room for ``ahead`` more positions and the recordings the next
        request will want; how many were recorded."""
        ...

    def forget_uses(self) -> None:
        """Forget which kinds of forward were asked for so far (the engine calls it after its
        load-time checks and calibration, which say nothing of what requests will ask)."""
        ...

    def add_reclaimer(self, reclaim: Callable[[], bool]) -> None:
        """Where a path holds its caches' memory in a pool of its own (llama.cpp's contexts) and
        the pool is full, it calls ``reclaim()`` (a cache store's: evict the least recently used
        document, False when none is left) until a cache frees; elsewhere a cache's memory is the
        store's to bound after each request, and this does nothing."""
        ...


class BasicPath:
    """The capabilities of a path that has none of the optional ones: logits come with the
    forward, no token trees, nothing recorded or replayed, no idle work. Subclasses set ``name``
    and the five required methods."""

    name: str
    description = ""
    lazy_head = False
    rows_from = False
    trees = False
    recordings = 0
    replays = False
    host_ids = False
    gives_hidden = False

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        raise TypeError(f"the {self.name} forward computes its logits within the forward (no lazy head)")

    def forward_ids(self, ids: list[int], cache: Any, last_only: bool = False, rows_from: int = 0) -> np.ndarray:
        raise TypeError(f"the {self.name} forward takes and gives torch tensors (no host ids)")

    def keep(self, cache: Any, start: int, slots: Sequence[int]) -> None:
        raise TypeError(f"the {self.name} forward runs no token trees")

    def prepare(self, cache: Any, ahead: int) -> int:
        return 0

    def forget_uses(self) -> None:
        return None

    def add_reclaimer(self, reclaim: Callable[[], bool]) -> None:
        return None
