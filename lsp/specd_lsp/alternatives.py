"""The items of an invoked request: the greedy completion, then sampled alternatives until
enough distinct items would show.

A sample that shows as an item already drawn (texts that differ only past where
post-processing cuts them), or as nothing, is drawn again, at most ``EXTRA_DRAWS`` times in
all: a peaked model repeats its greedy item at any temperature. Sampled alternatives are not
bit for bit repeatable (docs/lsp.md).
"""

from __future__ import annotations

from typing import Callable

from specd_lsp.completion import context_at
from specd_lsp.daemon_calls import DaemonCalls
from specd_lsp.options import Settings
from specd_lsp.proposals import CompletionQuery, place

SEED_BASE = 1  # sampled alternatives use seeds 1, 2, ...
EXTRA_DRAWS = 2  # samples drawn past `alternatives` when some would show nothing, or a shown item again


async def ask_alternatives(calls: DaemonCalls, settings: Callable[[], Settings], query: CompletionQuery,
                           text: str, offset: int, version: int, alternatives: int,
                           current: Callable[[], bool]) -> list[str] | None:
    """Raw completions at ``offset`` of ``text``, greedy first, until ``alternatives`` distinct
    items would show; None when superseded (``current()`` turned False) or the daemon fails
    before any."""
    ctx = context_at(text, offset)
    raws: list[str] = []
    shown: set[tuple[int, str]] = set()
    draws = alternatives + (EXTRA_DRAWS if alternatives > 1 else 0)
    for number in range(draws):
        if len(shown) >= alternatives:
            break
        if not current():
            return None  # a newer request for this document took over
        temperature = 0.0 if number == 0 else settings().temperature
        options = calls.options(temperature, SEED_BASE + number - 1 if number else None)
        result = await calls.complete(query.uri, text, offset, version, options, query.selected is not None)
        if not current():
            return None  # cancelled for a newer request: a partial list would stand as the answer
        if result is None:
            return raws or None
        raw = result.get("text")
        if not isinstance(raw, str):
            continue
        placed = place(query, ctx, offset, raw, settings().single_line)
        if not number or (placed is not None and placed.shown not in shown):
            raws.append(raw)  # the greedy one always: the type-through cache serves it as typed
        if placed is not None:
            shown.add(placed.shown)
    return raws
