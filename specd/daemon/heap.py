"""Giving freed memory back to the system after large documents close.

CPython hands a large string's memory to the C allocator, and glibc keeps what is freed inside
its heaps for reuse: after a user closes a few hundred MiB of documents the process stays that
large. ``malloc_trim(0)`` returns the free pages of every glibc arena; elsewhere (musl, macOS)
there is nothing to call and nothing is done. It walks the heap holding the allocator's lock, so
it runs on the document mirror's thread after a batch of closes, never per close and never on
the event loop.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import time
from typing import Callable

log = logging.getLogger("specd.heap")

# Trim once this many characters of closed documents are freed since the last trim.
TRIM_AFTER_CLOSED_CHARS = 4 * 1024 * 1024


def _malloc_trim() -> Callable[[int], int] | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim  # glibc only
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


_TRIM = _malloc_trim()


def trim_heap() -> bool:
    """Return the C allocator's free pages to the system; False where that cannot be asked."""
    if _TRIM is None:
        return False
    started = time.monotonic()
    _TRIM(0)
    log.debug("heap trimmed in %.1f ms", (time.monotonic() - started) * 1000)
    return True


class ClosedMemory:
    """Counts the characters of documents closed since the last trim, and trims once enough
    are freed and the caller is between batches."""

    def __init__(self, threshold: int = TRIM_AFTER_CLOSED_CHARS, trim: Callable[[], bool] = trim_heap):
        self.threshold = threshold
        self._trim = trim
        self.freed = 0  # characters closed since the last trim
        self.trims = 0

    def closed(self, chars: int) -> None:
        self.freed += chars

    def settle(self) -> None:
        """Between batches: trim if enough was closed since the last time."""
        if self.freed >= self.threshold:
            self.freed = 0
            self.trims += self._trim()
