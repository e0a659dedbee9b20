"""What forwards cost on this machine, timed on a forward path itself: the measuring that both
``specd bench`` (its forward-cost tables, ``specd.bench.costs``) and the engine's choice of a
forward at load (``auto``) run.

Every figure: one warm-up forward (first calls of a shape allocate), then the median of up to
``repeats`` timed forwards, each after a crop back to where it started (not timed). A
``budget_ms`` stops the repeats early once that much time went into timed forwards (at least
one always runs), so a model whose forwards take a second each is measured in bounded time.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Sequence

import torch


def median_ms(run: Callable[[], object], reset: Callable[[], None], repeats: int,
              synchronize: Callable[[], None], budget_ms: float | None = None) -> float:
    """One warm-up, then the median of up to ``repeats`` timed calls of ``run``, each after
    ``reset``; no more once ``budget_ms`` went into them."""
    reset()
    run()
    synchronize()
    times: list[float] = []
    while len(times) < repeats and (budget_ms is None or not times or sum(times) < budget_ms):
        reset()
        synchronize()
        started = time.perf_counter()
        run()
        synchronize()
        times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times)


class PathProbe:
    """One cache on ``path`` and the forwards a measurement runs on it: ``run`` new tokens
    after what it holds, ``crop`` back."""

    def __init__(self, path, device: torch.device):
        self.path = path
        self.device = device
        self.cache = path.new_cache()
        self.length = 0

    def run(self, ids: Sequence[int], last_only: bool = False, rows: int | None = None) -> None:
        """A forward of ``ids``; ``rows``: on a path that computes logits on demand
        (``lazy_head``), the final hidden states and then that many rows of logits, as
        verification reads them."""
        input_ids = torch.tensor([list(ids)], dtype=torch.long, device=self.device)
        if rows is not None and self.path.lazy_head:
            hidden = self.path.forward(input_ids, self.cache, head=False)  # hidden: [T, D]
            for i in range(rows):
                self.path.head(hidden[i:i + 1])
        else:
            self.path.forward(input_ids, self.cache, last_only=last_only)
        self.length += len(ids)

    def crop(self, length: int) -> None:
        if length < self.length:
            self.path.crop(self.cache, length)
            self.length = length


def measure_path(model, path, ids: Sequence[int], contexts: Sequence[int], widths: Sequence[int],
                 prefill_tokens: int, repeats: int, synchronize: Callable[[], None],
                 last_only: bool = False, verify_rows: int | None = 1,
                 budget_ms: float | None = None) -> dict[str, Any]:
    """ms of forwards on one path: ``forward_ms[context][width]`` (``last_only``: logits of the
    last token only, as a draft step asks; else every row), on a path that computes rows on
    demand also ``verify_rows_ms[context][width]``, the forward and ``verify_rows`` rows of
    logits (what a verify costs that reads them: 1 when its first drafted token is rejected;
    None: not measured), and a ``prefill_tokens`` prefill from empty (0: none)."""
    probe = PathProbe(path, model.device)
    forward_ms: dict[str, dict[str, float]] = {}
    verify_ms: dict[str, dict[str, float]] = {}
    lazy = not last_only and path.lazy_head and verify_rows is not None

    def timed(run: Callable[[], object], back_to: int) -> float:
        return round(median_ms(run, lambda: probe.crop(back_to), repeats, synchronize, budget_ms), 3)

    for context in sorted(contexts):
        if probe.length < context:  # keeps the shorter context already held, runs the rest
            probe.run(ids[probe.length:context], last_only=True)
        row = forward_ms.setdefault(str(context), {})
        for width in widths:
            new = list(ids[context:context + width])
            row[str(width)] = timed(lambda: probe.run(new, last_only=last_only), context)
            if lazy:
                verify_ms.setdefault(str(context), {})[str(width)] = timed(
                    lambda: probe.run(new, rows=min(verify_rows, width)), context)
    out: dict[str, Any] = {"forward_ms": forward_ms}
    if verify_ms:
        out["verify_rows_ms"] = verify_ms
    if prefill_tokens:
        prompt = list(ids[:prefill_tokens])
        prefill_ms = timed(lambda: probe.run(prompt, last_only=True), 0)
        out.update(prefill_ms=prefill_ms, prefill_ms_per_1k=round(prefill_ms * 1000 / prefill_tokens, 3))
    probe.crop(0)
    return out
