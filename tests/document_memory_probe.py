"""What open documents cost the daemon: RSS while one client opens many large documents and
after it closes them, and another client's ``status`` latency meanwhile. Runs the real daemon
with its default engine (the shipped demo pair) and default limits; not a test: run it by hand.

    PYTHONPATH=tests .venv/bin/python tests/document_memory_probe.py [documents] [kind] [connection MiB]

``kind``: ``short`` (1 MiB of ~6-byte lines, 175k lines), ``assign`` (1 MiB of ``a_i = i``
lines) or ``both`` (the default); ``connection MiB``: daemon.max_open_bytes_per_connection and
daemon.max_open_bytes for the run (default: theirs). Prints one line per phase;
docs/reliability.md quotes them.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from daemon_helpers import DaemonProcess
from specd.protocol.errors import RpcError

MiB = 1 << 20
SETTLE_S = 10.0  # how long after the last close RSS is read again


def document(number: int, kind: str) -> str:
    """About 1 MiB of text, distinct per document, cut at a line end."""
    if kind == "short":
        lines = (f"v={(i * 7 + number) % 997}" for i in range(200_000))
    else:
        lines = (f"a_{i} = {i + number}" for i in range(100_000))
    text = "\n".join(lines)[:MiB]
    return text[:text.rfind("\n") + 1]


class StatusWatch:
    """Another client asking ``status`` every few milliseconds, latencies kept by phase."""

    def __init__(self, daemon: DaemonProcess):
        self.client = daemon.client()
        self.phase = "idle"
        self.samples: dict[str, list[float]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.perf_counter()
            self.client.status()
            self.samples.setdefault(self.phase, []).append((time.perf_counter() - started) * 1000)
            self._stop.wait(0.01)

    def start(self) -> "StatusWatch":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.client.close()

    def summary(self, phase: str) -> str:
        values = sorted(self.samples.get(phase, [0.0]))
        p95 = values[min(len(values) - 1, int(len(values) * 0.95))]
        return f"status p50 {statistics.median(values):.1f} ms, p95 {p95:.1f} ms, max {values[-1]:.1f} ms ({len(values)} calls)"


def probe(count: int, kind: str, budget_mib: int | None) -> None:
    config = {"log.level": "warning", "model.target": "demo"}
    if budget_mib is not None:
        config.update({"daemon.max_open_bytes": budget_mib * MiB, "daemon.max_open_bytes_per_connection": budget_mib * MiB})
    with tempfile.TemporaryDirectory() as root:
        daemon = DaemonProcess(Path(root), engine="real", config=config).start(timeout=180)
        try:
            run(daemon, count, kind)
        finally:
            daemon.stop()


def run(daemon: DaemonProcess, count: int, kind: str) -> None:
    time.sleep(5.0)  # start-up's idle work done
    baseline = daemon.rss_mb()
    watch = StatusWatch(daemon).start()
    time.sleep(3.0)
    texts = [document(n, kind) for n in range(count)]
    accepted, refused, accepted_bytes = [], {}, 0
    watch.phase = "open"
    started = time.monotonic()
    with daemon.client() as client:
        for number, text in enumerate(texts):
            uri = f"file:///probe/{kind}_{number}.py"
            try:
                client.open_document(uri, text, version=1)
            except RpcError as err:
                refused.setdefault(err.code, err.message)
                continue
            accepted.append(uri)
            accepted_bytes += len(text.encode())
        opened_s = time.monotonic() - started
        # A completion in the last document: the engine indexes what requests touch.
        client.complete(accepted[-1], {"line": 10, "character": 0}, timeout=60)
        watch.phase = "held"
        time.sleep(5.0)
        held = daemon.rss_mb()
        watch.phase = "close"
        for uri in accepted:
            client.close_document(uri)
    watch.phase = "after close"
    time.sleep(SETTLE_S)
    after = daemon.rss_mb()
    watch.stop()
    text_mib = accepted_bytes / MiB
    print(f"{kind}: {count} documents of 1 MiB offered, {len(accepted)} accepted ({text_mib:.0f} MiB of text) "
          f"in {opened_s:.1f} s; refused: {refused or 'none'}", flush=True)
    print(f"{kind}: RSS baseline {baseline:.0f} MiB, held {held:.0f} MiB (+{held - baseline:.0f} MiB, "
          f"{(held - baseline) / max(text_mib, 1e-9):.2f}x the text), {SETTLE_S:.0f} s after closing all "
          f"{after:.0f} MiB (+{after - baseline:.0f} MiB)", flush=True)
    for phase in ("idle", "open", "held", "close", "after close"):
        print(f"{kind}: {phase}: {watch.summary(phase)}", flush=True)


def main() -> None:
    count = int(sys.argv[1]) if len(sys.argv) > 1 else 300
    kind = sys.argv[2] if len(sys.argv) > 2 else "both"
    budget_mib = int(sys.argv[3]) if len(sys.argv) > 3 else None
    for each in (("short", "assign") if kind == "both" else (kind,)):
        probe(count, each, budget_mib)


if __name__ == "__main__":
    main()
