"""What ``status`` reports about the process: latency percentiles and memory."""

from __future__ import annotations

import collections
import sys
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
