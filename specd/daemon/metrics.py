"""What ``status`` reports about the process: latency percentiles, memory, and the engine's
figures as last fetched."""

from __future__ import annotations

import collections
import sys
import time
from typing import Any

LATENCY_WINDOW = 1000  # completions the latency percentiles are computed over


class LatencyWindow:
    def __init__(self, size: int = LATENCY_WINDOW):
        self.samples: collections.deque[float] = collections.deque(maxlen=size)

    def add(self, ms: float) -> None:
        self.samples.append(ms)

    def summary(self) -> dict[str, Any]:
        ordered = sorted(self.samples)
        if not ordered:
            return {"count": 0, "p50": None, "p95": None, "max": None}

        def pick(q: float) -> float:
            return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 2)

        return {"count": len(ordered), "p50": pick(0.50), "p95": pick(0.95), "max": round(ordered[-1], 2)}


def process_memory() -> dict[str, Any]:
    """This process's resident memory, MiB (current and peak)."""
    out: dict[str, Any] = {}
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith(("VmRSS:", "VmHWM:")):
                    key = "rss_mb" if line.startswith("VmRSS") else "peak_rss_mb"
                    out[key] = round(int(line.split()[1]) / 1024, 1)
    except OSError:
        import resource

        out["peak_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    return out


def device_memory() -> dict[str, Any]:
    """Accelerator memory in MiB, when the engine has put torch on a CUDA device."""
    torch = sys.modules.get("torch")  # never imported here just to report
    try:
        if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
            return {}
        return {
            "device_allocated_mb": round(torch.cuda.memory_allocated() / 2**20, 1),
            "device_reserved_mb": round(torch.cuda.memory_reserved() / 2**20, 1),
            "device_peak_mb": round(torch.cuda.max_memory_allocated() / 2**20, 1),
        }
    except Exception:  # reporting must never fail status
        return {}


class EngineFigures:
    """The engine's last ``stats()``, kept on the event loop so that ``status`` need not fetch
    them from a thread every time (a thread hop costs loop turns and a GIL handoff, the larger
    part of a ``status`` answered while another client's long change is applied: see
    ``handlers.documents.EDIT_STEP_S``).

    Figures are reused while younger than ``max_age_s``, taken from the same source (the
    engine and the worker's state: a load or a release means new figures) and not invalidated
    since; the daemon invalidates them when something it knows of changed them (a completion
    ended). The age counts from when the fetch began, and a fetch that began before an
    invalidation is not kept."""

    def __init__(self, max_age_s: float):
        self.max_age_s = max_age_s
        self._figures: dict[str, Any] | None = None
        self._source: tuple[Any, ...] = ()
        self._fetched_at = 0.0
        self._generation = 0

    def fresh(self, source: tuple[Any, ...]) -> dict[str, Any] | None:
        """The figures last fetched from ``source``, if recent enough to answer with."""
        if self._figures is None or self._source != source:
            return None
        if time.monotonic() - self._fetched_at > self.max_age_s:
            return None
        return self._figures

    def begin(self) -> tuple[int, float]:
        """A fetch starts now: the token ``keep`` takes."""
        return self._generation, time.monotonic()

    def keep(self, token: tuple[int, float], source: tuple[Any, ...], figures: dict[str, Any]) -> None:
        generation, started = token
        if generation == self._generation:
            self._figures, self._source, self._fetched_at = figures, source, started

    def invalidate(self) -> None:
        self._generation += 1
        self._figures, self._source = None, ()
