"""A polite client measured while another connection opens and edits 8 MiB documents.

The polite client asks ``status`` every 20 ms and, every 10th request, a small ``complete`` on
a small open document. The hostile connection runs in its own process (its msgpack packing of
8 MiB frames must not take the polite client's interpreter), opening documents of
``HOSTILE_MIB`` MiB, typing into them (changes of a few ranged edits), replacing one whole and
closing the oldest, keeping ``OPEN_AT_ONCE`` open. It pauses between two rounds with all its
documents closed, so idle and loaded windows can alternate on one daemon.

Used by ``scripts/fairness-big-docs`` and ``tests/test_fairness_big_documents.py``; also the
hostile process's entry point (``python tests/big_documents_load.py SOCKET MIB``, commands on
stdin: ``go``, ``pause``, ``stop``; replies on stdout: ``going``, ``paused N``, ``stopped N``).
"""

from __future__ import annotations

import math
import os
import random
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MiB = 1 << 20
HOSTILE_MIB = 8
OPEN_AT_ONCE = 3  # hostile documents held open together
TYPING_CHANGES = 8  # small changes per document and round, as a person typing
STATUS_PERIOD_S = 0.02
COMPLETE_EVERY = 10  # every 10th polite request is a complete
POLITE_URI = "file:///polite/small.py"
POLITE_TEXT = "import os\n\n\ndef add(a, b):\n    return a + b\n\n\ndef main():\n    \n"
POLITE_CURSOR = {"line": 8, "character": 4}
POLITE_OPTIONS = {"max_tokens": 16}

TESTS = Path(__file__).resolve().parent


def daemon_config(mib: int = HOSTILE_MIB) -> dict[str, Any]:
    """Limits that let one connection hold a few documents of ``mib`` MiB and replace them whole."""
    return {
        "daemon.max_document_bytes": mib * MiB + 64 * 1024,
        "daemon.max_frame_bytes": 2 * mib * MiB,
        "daemon.max_open_bytes_per_connection": (OPEN_AT_ONCE + 2) * (mib + 1) * MiB,
        "daemon.max_open_bytes": (OPEN_AT_ONCE + 4) * (mib + 1) * MiB,
    }


def p95(values: list[float]) -> float:
    """Nearest-rank 95th percentile."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.95 * len(ordered)) - 1)]


@dataclass
class Figures:
    complete_ms: list[float] = field(default_factory=list)
    status_ms: list[float] = field(default_factory=list)

    def add(self, other: Figures) -> None:
        self.complete_ms += other.complete_ms
        self.status_ms += other.status_ms

    def summary(self) -> dict[str, float]:
        c, s = self.complete_ms, self.status_ms
        return {"complete_p50": statistics.median(c), "complete_p95": p95(c), "complete_n": len(c),
                "status_p50": statistics.median(s), "status_p95": p95(s), "status_n": len(s)}

    def line(self, name: str) -> str:
        f = self.summary()
        return (f"{name:>8}: complete p50 {f['complete_p50']:6.1f} p95 {f['complete_p95']:6.1f} ms "
                f"(n={f['complete_n']}); status p50 {f['status_p50']:5.1f} p95 {f['status_p95']:5.1f} ms "
                f"(n={f['status_n']})")


def meets_goal(idle: Figures, loaded: Figures) -> list[str]:
    """What the loaded figures miss of the goal, against idle (empty: met)."""
    misses = []
    if p95(loaded.complete_ms) > 2 * p95(idle.complete_ms) + 50:
        misses.append(f"complete p95 {p95(loaded.complete_ms):.1f} ms over 2x idle "
                      f"{p95(idle.complete_ms):.1f} + 50 ms")
    if p95(loaded.status_ms) > 2 * p95(idle.status_ms) + 5:
        misses.append(f"status p95 {p95(loaded.status_ms):.1f} ms over 2x idle {p95(idle.status_ms):.1f} + 5 ms")
    return misses


# -- the polite client ---------------------------------------------------------------------------


class Polite:
    """One connection, its small document open; ``measure`` runs the request pattern."""

    def __init__(self, client: Any):
        self.client = client
        client.hello(client="polite")
        client.open_document(POLITE_URI, POLITE_TEXT, version=1)
        self.client.complete(uri=POLITE_URI, cursor=POLITE_CURSOR, options=POLITE_OPTIONS, timeout=120)  # warm

    def measure(self, seconds: float) -> Figures:
        figures = Figures()
        ends = time.monotonic() + seconds
        number = 0
        while time.monotonic() < ends:
            began = time.monotonic()
            number += 1
            if number % COMPLETE_EVERY == 0:
                self.client.complete(uri=POLITE_URI, cursor=POLITE_CURSOR, options=POLITE_OPTIONS, timeout=120)
                figures.complete_ms.append((time.monotonic() - began) * 1000)
            else:
                self.client.status(timeout=60)
                figures.status_ms.append((time.monotonic() - began) * 1000)
            time.sleep(max(0.0, began + STATUS_PERIOD_S - time.monotonic()))
        return figures


def alternating(client: Any, socket_path: Path, windows: int, window_s: float,
                mib: int = HOSTILE_MIB) -> tuple[Figures, Figures, int]:
    """Idle and loaded figures from ``windows`` alternating windows of ``window_s`` each:
    whatever else runs on the machine meanwhile weighs on both alike. Returns (idle, loaded,
    the hostile connection's requests)."""
    polite = Polite(client)
    hostile = HostileProcess(socket_path, mib)
    idle, loaded = Figures(), Figures()
    try:
        for _window in range(windows):
            idle.add(polite.measure(window_s))
            hostile.go()
            loaded.add(polite.measure(window_s))
            hostile.pause()
    finally:
        hostile.stop()
    return idle, loaded, hostile.operations


# -- the hostile connection, in its own process ----------------------------------------------


def big_text(seed: int, mib: int) -> str:
    """``mib`` MiB of plausible code lines, distinct per seed."""
    rng = random.Random(seed)
    names = [f"value_{seed}_{n}" for n in range(512)]
    lines = []
    size = 0
    target = mib * MiB
    while size < target:
        line = f"    {rng.choice(names)} = compute({rng.randrange(1000)}, {rng.choice(names)})  # {seed}\n"
        lines.append(line)
        size += len(line)
    return "".join(lines)[:target]


class HostileProcess:
    """The hostile connection as a child process, driven over its stdin."""

    def __init__(self, socket_path: Path, mib: int = HOSTILE_MIB):
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(TESTS.parent), str(TESTS), env.get("PYTHONPATH", "")])
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), str(socket_path), str(mib)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self._expect("ready")
        self.operations = 0

    def _send(self, command: str) -> None:
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()

    def _expect(self, word: str) -> str:
        line = self.proc.stdout.readline().strip()
        if not line.startswith(word):
            raise AssertionError(f"hostile process said {line!r}, expected {word!r} (exit {self.proc.poll()})")
        return line

    def go(self) -> None:
        """Start loading; returns once its first request has been answered."""
        self._send("go")
        self._expect("going")

    def pause(self) -> None:
        """Stop between two rounds, every document of it closed; returns once there."""
        self._send("pause")
        self.operations = int(self._expect("paused").split()[1])

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self._send("stop")
                self.operations = int(self._expect("stopped").split()[1])
            except (OSError, AssertionError, ValueError):
                pass
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


def _hostile_main(socket_path: str, mib: int) -> None:
    from specd.client import Client

    texts = [big_text(seed, mib) for seed in range(2)]
    commands: list[str] = []
    changed = threading.Condition()

    def read_commands() -> None:
        for line in sys.stdin:
            with changed:
                commands.append(line.strip())
                changed.notify_all()
        with changed:
            commands.append("stop")
            changed.notify_all()

    threading.Thread(target=read_commands, daemon=True).start()
    rng = random.Random(7)
    operations = 0
    with Client.connect_unix(socket_path, timeout=30) as client:
        client.hello(client="big documents")
        print("ready", flush=True)
        state = "paused"
        while True:
            with changed:
                while state == "paused" and not commands:
                    changed.wait()
                command = commands.pop(0) if commands else None
            if command == "stop":
                break
            if command == "go":
                state = "going"
                announce = True
            elif command == "pause":
                state = "paused"
                print(f"paused {operations}", flush=True)
                continue
            open_uris: list[str] = []
            versions: dict[str, int] = {}
            number = 0
            while True:  # rounds until a command arrives
                uri = f"file:///hostile/big{number}.py"
                text = texts[number % len(texts)]
                client.open_document(uri, text, version=1, timeout=120)
                operations += 1
                if announce:
                    print("going", flush=True)
                    announce = False
                open_uris.append(uri)
                versions[uri] = 1
                lines = text.count("\n", 0, 4096 * 80)
                for _typing in range(TYPING_CHANGES):
                    line = rng.randrange(lines)
                    versions[uri] += 1
                    edits = [{"range": {"start": {"line": line, "character": 4}, "end": {"line": line, "character": 4}},
                              "text": "x"}]
                    client.change_document(uri, versions[uri], edits=edits, timeout=120)
                    operations += 1
                versions[uri] += 1
                client.change_document(uri, versions[uri], text=texts[(number + 1) % len(texts)], timeout=120)
                operations += 1
                while len(open_uris) > OPEN_AT_ONCE:
                    client.close_document(open_uris.pop(0), timeout=60)
                    operations += 1
                number += 1
                with changed:
                    if commands:
                        break
            for uri in open_uris:
                client.close_document(uri, timeout=60)
                operations += 1
    print(f"stopped {operations}", flush=True)


if __name__ == "__main__":
    _hostile_main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else HOSTILE_MIB)
