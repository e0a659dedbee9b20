"""One daemon ``complete`` as specd-lsp makes it: its params and options from the settings,
the counts it feeds (``Stats``), and which of its failures the user hears of
(``FailureNotices``). The completer, its streams, its alternatives and its prefetch all ask
through ``DaemonCalls.complete``.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from specd.protocol.errors import ErrorCode, RpcError

from specd_lsp.documents import DocumentStore
from specd_lsp.options import Settings

log = logging.getLogger("specd_lsp.completer")

# Completion errors the user is not told of: the request was moot (cancelled, superseded), the
# link mends it by itself (a document the daemon lost is sent again; busy), or the link's own
# state already says it, once per outage (unavailable, connection lost, shutting down).
QUIET_ERRORS = frozenset(code.value for code in (
    ErrorCode.CANCELLED, ErrorCode.UNKNOWN_DOCUMENT, ErrorCode.BUSY, ErrorCode.DAEMON_UNAVAILABLE,
    ErrorCode.CONNECTION_LOST, ErrorCode.SHUTTING_DOWN))
# Reported in ``lastError`` but not shown: a slow answer on a busy machine, or a file kept out
# (it would come back each time the user returns to that file).
UNSHOWN_ERRORS = frozenset(code.value for code in (ErrorCode.TIMEOUT, ErrorCode.DOCUMENT_TOO_LARGE))


@dataclass
class Stats:
    requests: int = 0
    daemon_requests: int = 0
    shown: int = 0
    accepted: int = 0
    accepted_partial: int = 0  # a word or a line of a suggestion taken (each counted)
    accepted_chars: int = 0
    cache_hits: int = 0
    prefetches: int = 0
    streamed: int = 0  # automatic requests answered with their first line while the rest came
    grew: int = 0  # suggestions the editor was told grew after they were shown
    cancelled: int = 0
    failed: int = 0
    last_latency_ms: float | None = None
    last_stop_reason: str | None = None
    last_error: str | None = None  # the last failed completion's error, until one succeeds
    acceptance: dict[str, dict[str, int]] = field(default_factory=dict)  # per drafting source

    def add_sources(self, sources: Any) -> None:
        if not isinstance(sources, dict):
            return
        for name, counts in sources.items():
            if isinstance(counts, dict):
                total = self.acceptance.setdefault(str(name), {"proposed": 0, "accepted": 0})
                total["proposed"] += int(counts.get("proposed", 0) or 0)
                total["accepted"] += int(counts.get("accepted", 0) or 0)

    def to_dict(self) -> dict[str, Any]:
        acceptance = {
            name: {**counts, "rate": round(counts["accepted"] / counts["proposed"], 3) if counts["proposed"] else 0.0}
            for name, counts in self.acceptance.items()
        }
        return {
            "requests": self.requests, "daemonRequests": self.daemon_requests, "shown": self.shown,
            "accepted": self.accepted, "acceptedPartial": self.accepted_partial, "acceptedChars": self.accepted_chars, "cacheHits": self.cache_hits,
            "prefetches": self.prefetches, "streamed": self.streamed, "grew": self.grew, "cancelled": self.cancelled, "failed": self.failed,
            "lastLatencyMs": self.last_latency_ms, "lastStopReason": self.last_stop_reason,
            "lastError": self.last_error,
            "acceptance": acceptance,
        }


class FailureNotices:
    """Which completion failures to show: each distinct message once, and again only after a
    completion succeeded in between (a broken model must not pop up on every keystroke)."""

    def __init__(self) -> None:
        self._shown: set[str] = set()

    def failed(self, message: str) -> bool:
        """True when ``message`` should be shown now."""
        if message in self._shown:
            return False
        self._shown.add(message)
        return True

    def succeeded(self) -> None:
        self._shown.clear()


class DaemonCalls:
    def __init__(self, documents: DocumentStore, link: Any, settings: Callable[[], Settings], stats: Stats,
                 on_result: Callable[[], None] | None = None, on_failure: Callable[[str], None] | None = None):
        self.documents = documents
        self.link = link
        self._settings = settings
        self.stats = stats
        self._on_result = on_result
        self._on_failure = on_failure  # called with a failure's message when the user should see it
        self.notices = FailureNotices()
        self._busy: collections.Counter[str] = collections.Counter()  # calls in flight per document

    def busy(self, uri: str) -> bool:
        """Whether a daemon complete for ``uri`` is in flight."""
        return self._busy[uri] != 0

    def forget(self, uri: str) -> None:
        self._busy.pop(uri, None)

    def options(self, temperature: float = 0.0, seed: int | None = None) -> dict[str, Any]:
        """A complete's options from the settings: greedy unless a temperature (and seed) is given."""
        settings = self._settings()
        options: dict[str, Any] = {"max_tokens": settings.max_tokens, "single_line": settings.single_line,
                                   "temperature": temperature}
        if seed is not None:
            options["seed"] = seed
        if settings.time_budget_ms:
            options["time_budget_ms"] = settings.time_budget_ms
        return options

    async def complete(self, uri: str, text: str, offset: int, version: int, options: dict[str, Any],
                       virtual: bool, on_progress: Callable[[dict[str, Any]], None] | None = None
                       ) -> dict[str, Any] | None:
        """One daemon complete; the document's own buffer unless the text is not the editor's
        (``virtual``, or the document moved on). None when it failed (counted, and told to the
        user when it should be); raises only ``CancelledError``."""
        doc = self.documents.get(uri)
        params: dict[str, Any] = {"uri": uri, "cursor": {"offset": offset}, "options": options}
        if virtual or doc is None or doc.version != version or doc.text is not text:
            params["text"] = text  # keyed by uri still, so the daemon reuses the document's KV cache
        timeout = self._settings().daemon.request_timeout_ms / 1000
        self.stats.daemon_requests += 1
        started = time.monotonic()
        self._busy[uri] += 1
        try:
            if on_progress is None:
                result = await self.link.complete(params, timeout)
            else:
                result = await self.link.complete(params, timeout, on_progress)
        except RpcError as err:
            if err.code == ErrorCode.CANCELLED.value:
                self.stats.cancelled += 1
            elif err.code == ErrorCode.UNKNOWN_DOCUMENT.value and "text" not in params:
                log.info("the daemon lost %s; sending it again", uri)
                if doc is not None:
                    self.link.open(doc)
                self.stats.failed += 1
            else:
                self.stats.failed += 1
                log.info("completion failed: %s", err)
                self._failed(err)
            return None
        except asyncio.CancelledError:
            self.stats.cancelled += 1
            raise
        except (TypeError, ValueError) as err:  # text the socket cannot carry (a lone surrogate)
            self.stats.failed += 1
            log.warning("cannot ask the daemon: %s", err)
            return None
        finally:
            self._busy[uri] -= 1
        self.stats.last_latency_ms = round(result.get("latency_ms") or (time.monotonic() - started) * 1000, 1)
        self.stats.last_stop_reason = result.get("stop_reason")
        self.stats.add_sources(result.get("sources"))
        self.stats.last_error = None
        self.notices.succeeded()
        if self._on_result is not None:
            self._on_result()
        return result

    def _failed(self, err: RpcError) -> None:
        if err.code in QUIET_ERRORS:
            return
        self.stats.last_error = f"{err.code}: {err.message}"
        if err.code not in UNSHOWN_ERRORS and self.notices.failed(self.stats.last_error) and self._on_failure:
            self._on_failure(self.stats.last_error)
