"""The first suggestion in a document whose prompt is not prefilled yet.

A real model prefills a full prompt (prefix, suffix and other files' chunks: about 2,000 tokens)
in seconds on a laptop CPU. A completion that would have to wait for that answers instead from a
narrower window: as many prompt tokens as this machine prefills within
``engine.first_suggestion_ms``, measured from the engine's own prefills, never guessed. The full
prompt keeps prefilling in idle time in the document's own cache, which the narrow window's
requests never touch, so nothing computed is thrown away; once what is left of it fits the
same budget (for a document answering from a window: an idle piece's worth), requests answer
from the full prompt again.

A document keeps its window's size while the measured speed still affords it within a margin,
so successive keystrokes ask for the same window, whose start stays put, and reuse its cache as
the full prompt's requests do.

Where the editor says where its cursor came to rest (the socket's ``focus``: a document just
opened, or a jump), idle prefill fills that window first, then the full prompt, so the first
keystroke there finds the window ready.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

log = logging.getLogger(__name__)

MIN_SAMPLE_TOKENS = 16  # prefills shorter than this say more about a step's fixed cost than a token's
SMOOTHING = 0.3  # weight of the newest prefill in the running per-token cost
MIN_WINDOW = 64  # the narrowest window, however slow the machine: fewer tokens give too little to go on
WINDOW_STEP = 64  # window sizes are multiples of this
KEEP_MARGIN = 1.5  # a document keeps its window while it costs at most this times the budget
SLICE_WAIT_MS = 150  # idle prefill runs in pieces of about this long: what a new request may wait for one
SLICE_TOKENS = (4, 256)  # ... within these bounds (smaller pieces cost more per token)
NARROW_SUFFIX = "\x00window"  # a document's narrow-window cache sits in the cache store under uri + this


@dataclass
class Window:
    """The narrow window a request answers from: its size in prompt tokens, and what the full
    prompt would have made it prefill (for the logs and ``status``)."""

    tokens: int
    full_pending: int


class ColdStart:
    """Prefill speed as measured, and the window a cold request may afford. Thread-safe: the
    worker records and decides, ``stats`` may read from the daemon's loop."""

    def __init__(self, budget_ms: int):
        self.budget_ms = budget_ms
        self._ms_per_token: float | None = None
        self._lock = threading.Lock()
        self.narrow_answers = 0  # requests answered from a narrow window
        self.windows_ahead = 0  # narrow windows idle prefill filled before a request there
        self.last_window: Window | None = None

    def seed(self, ms_per_token: float | None) -> None:
        """A first estimate before any prefill ran: the load's calibration of a few-row forward,
        which costs more per token than a long prefill does (so the first window errs narrow)."""
        with self._lock:
            if self._ms_per_token is None and ms_per_token and ms_per_token > 0:
                self._ms_per_token = ms_per_token

    def observe(self, tokens: int, seconds: float) -> None:
        """A prefill of ``tokens`` that took ``seconds`` (a request's, or a slice of idle work)."""
        if tokens < MIN_SAMPLE_TOKENS or seconds <= 0:
            return
        ms = seconds * 1000 / tokens
        with self._lock:
            old = self._ms_per_token
            self._ms_per_token = ms if old is None else old + SMOOTHING * (ms - old)

    @property
    def ms_per_token(self) -> float | None:
        with self._lock:
            return self._ms_per_token

    def affordable(self) -> int | None:
        """Prompt tokens this machine prefills within the budget; None with no budget or no measurement."""
        per_token = self.ms_per_token
        if self.budget_ms <= 0 or per_token is None:
            return None
        return int(self.budget_ms / per_token)

    def piece_tokens(self) -> int:
        """Tokens per idle prefill piece: about ``SLICE_WAIT_MS`` of prefill at the measured speed."""
        per_token = self.ms_per_token
        if per_token is None:
            return SLICE_TOKENS[0]
        return max(SLICE_TOKENS[0], min(SLICE_TOKENS[1], int(SLICE_WAIT_MS / per_token)))

    def window(self, pending: int, prompt_tokens: int, current: int | None = None) -> Window | None:
        """The narrow window for a request whose full prompt (``prompt_tokens`` long) still needs
        ``pending`` tokens prefilled; None where the full prompt fits the budget (or narrowing
        would not shorten it). ``current``: the size of the document's window so far, kept while
        the budget still affords it within ``KEEP_MARGIN`` (and it is not under half of what the
        budget affords), so its cache serves the next keystroke. A document with a window goes
        back to its full prompt only once what is left of it takes no longer than an idle piece
        (``piece_tokens``): its warm window answers a keystroke sooner than most of a budget's
        prefill would."""
        affordable = self.affordable()
        if affordable is None:
            return None
        if pending <= (affordable if current is None else min(affordable, self.piece_tokens())):
            return None
        size = max(MIN_WINDOW, affordable // WINDOW_STEP * WINDOW_STEP)
        if current is not None and affordable / 2 <= current <= max(MIN_WINDOW, affordable * KEEP_MARGIN):
            size = current
        if size >= prompt_tokens:
            return None
        return Window(size, pending)

    def prefilled_ahead(self, window: int, uri: str) -> None:
        """Idle prefill filled a ``window``-token narrow window at a document's cursor."""
        with self._lock:
            self.windows_ahead += 1
        log.debug("%s: a %d-token window prefilled at the cursor ahead of its first request", uri, window)

    def answered(self, window: Window, uri: str) -> None:
        with self._lock:
            self.narrow_answers += 1
            first = self.last_window is None or self.last_window.tokens != window.tokens
            self.last_window = window
        (log.info if first else log.debug)(
            "%s: %d prompt tokens to prefill would take %.1f s; answering from a %d-token window "
            "while the full prompt prefills in idle time (engine.first_suggestion_ms = %d)",
            uri, window.full_pending, window.full_pending * (self.ms_per_token or 0) / 1000,
            window.tokens, self.budget_ms)

    def stats(self) -> dict:
        per_token, affordable = self.ms_per_token, self.affordable()
        with self._lock:
            last = self.last_window
            return {"budget_ms": self.budget_ms,
                    "prefill_tokens_per_s": round(1000 / per_token, 1) if per_token else None,
                    "affordable_tokens": affordable,
                    "narrow_answers": self.narrow_answers,
                    "windows_prefilled_ahead": self.windows_ahead,
                    "last_window_tokens": last.tokens if last else None}


def narrow_key(uri: str) -> str:
    """Where a document's narrow-window cache is kept in the cache store."""
    return uri + NARROW_SUFFIX
