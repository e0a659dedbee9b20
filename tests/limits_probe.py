"""The hostile-client probes, against a real `specd serve` (fake engine), printing
the figures docs/reliability.md quotes. Not a test: run it by hand.

    PYTHONPATH=tests .venv/bin/python tests/limits_probe.py

Each probe runs on a fresh daemon with the default limits (16 MiB frames, 8 MiB documents) and
reports the daemon's RSS before and after.
"""

from __future__ import annotations

import socket
import struct
import sys
import tempfile
import threading
import time
from pathlib import Path

import msgpack

from daemon_helpers import DaemonProcess, raw_connect, read_all, wait_for
from specd.client import Client
from specd.protocol import pack

MiB = 1 << 20


def daemon(root: Path, **config) -> DaemonProcess:
    return DaemonProcess(root, config={"log.level": "warning", **config}, env={"SPECD_TEST_SLOW_S": "0.5"}).start()


def report(name: str, **figures) -> None:
    print(f"{name}: " + ", ".join(f"{key}={value}" for key, value in figures.items()), flush=True)


def streamed_strings(d: DaemonProcess) -> None:
    before = d.rss_mb()
    with raw_connect(d.socket_path) as sock:
        sock.sendall(b"\x94\x00\x01\xa6status\xdc" + struct.pack(">H", 400))
        sent = 0
        try:
            for _ in range(400):
                sock.sendall(msgpack.packb("s" * MiB))
                sent += 1
        except OSError:
            pass
        reply = read_all(sock, timeout=5)
        peak = d.rss_mb()
    code = list(msgpack.Unpacker(raw=False))
    unpacker = msgpack.Unpacker(raw=False)
    unpacker.feed(reply)
    code = [m for m in unpacker]
    report("400 x 1 MiB strings in one request", strings_sent=sent, reply=code[-1][2][0]["code"] if code else None,
           rss=f"{before:.0f}->{peak:.0f} MiB")


def nested_headers(d: DaemonProcess, connections: int = 20) -> None:
    before = d.rss_mb()
    header = b"\xdd" + struct.pack(">I", (1 << 24) - 1)
    socks = [raw_connect(d.socket_path) for _ in range(connections)]
    for sock in socks:
        sock.sendall(b"\x91" + header * 1000)
    time.sleep(1.0)
    held = d.rss_mb()
    for sock in socks:
        sock.close()
    report(f"1,000 nested 16M-element array headers x {connections} connections", rss=f"{before:.0f}->{held:.0f} MiB")


def closed_connections(d: DaemonProcess, connections: int = 20) -> None:
    before = d.rss_mb()
    socks = []
    for _ in range(connections):
        sock = raw_connect(d.socket_path)
        sock.sendall(b"\x92\xdb" + struct.pack(">I", 16 * MiB - 64) + b"q" * (15 * MiB))
        socks.append(sock)
    time.sleep(1.0)
    held = d.rss_mb()
    for sock in socks:
        sock.close()
    with d.client() as c:
        wait_for(lambda: c.status()["connections"] == 1, 20, message="connections closed")
    time.sleep(0.5)
    report(f"{connections} connections with a 15 MiB partial message, then closed",
           rss=f"{before:.0f}->{held:.0f} (held)->{d.rss_mb():.0f} MiB (closed, no gc)")


def unread_answers(d: DaemonProcess, requests: int = 60_000) -> None:
    before = d.rss_mb()
    frame = pack([0, 1, "status", [{}]])
    with raw_connect(d.socket_path) as sock:
        sock.setblocking(False)
        sent, stalled_since = 0, None
        while sent < requests:
            try:
                sock.send(frame)
                sent += 1
                stalled_since = None
            except BlockingIOError:
                stalled_since = stalled_since or time.monotonic()
                if time.monotonic() - stalled_since > 3:
                    break
                time.sleep(0.01)
        held = d.rss_mb()
    report(f"{requests:,} status requests, answers never read", accepted=sent, rss=f"{before:.0f}->{held:.0f} MiB")


def superseded_completes(d: DaemonProcess, count: int = 150) -> None:
    with d.client() as busy, d.client() as c:
        busy.open_document("file:///slow.py", "#slow\n")
        slow = busy.send_request("complete", {"uri": "file:///slow.py", "cursor": 6})[1]
        before = d.rss_mb()
        futures = [c.send_request("complete", {"uri": "file:///big.py", "text": f"#{n}\n" + "z" * (4 * MiB), "cursor": 3})[1]
                   for n in range(count)]
        peak = d.rss_mb()
        queued = c.status()["requests"]["queued"]
        for future in futures:
            try:
                future.result(60)
            except Exception:
                pass
        slow.result(60)
    report(f"{count} superseded 4 MiB completes behind a slow one", queued_in_status=queued, rss=f"{before:.0f}->{peak:.0f} MiB")


def fairness(d: DaemonProcess, hog_requests: int = 16) -> None:
    with d.client() as hog, d.client() as polite:
        futures = [hog.send_request("complete", {"text": "#slow\n", "cursor": 6})[1] for _ in range(hog_requests)]
        wait_for(lambda: polite.status()["requests"]["queued"] >= hog_requests - 3, 10, message="queued")
        started = time.monotonic()
        polite.complete(text="ab", cursor=2)
        waited = time.monotonic() - started
        for future in futures:
            future.result(120)
    report(f"a 2-token complete behind another connection's {hog_requests} queued completes (0.5 s each)",
           waited=f"{waited:.2f} s")


def edit_storm(d: DaemonProcess) -> None:
    line = "x = compute(alpha, beta)  # e\n"
    text = line * (MiB // len(line))
    edits = [{"range": {"start": {"line": n * 50, "character": 4}, "end": {"line": n * 50 + 1, "character": 2}},
              "text": f"y{n}\n  "} for n in range(400)]
    with d.client() as c, d.client() as other:
        c.open_document("file:///storm.py", text)
        result = {}

        def storm():
            started = time.monotonic()
            c.change_document("file:///storm.py", edits=edits, encoding="utf-16")
            result["change_s"] = time.monotonic() - started

        thread = threading.Thread(target=storm)
        thread.start()
        worst = 0.0
        while thread.is_alive():
            started = time.monotonic()
            other.status()
            worst = max(worst, time.monotonic() - started)
        thread.join()
    report("400 ranged edits in one frame on a 1 MiB file", change=f"{result['change_s']:.2f} s",
           other_client_worst_status=f"{worst * 1000:.0f} ms")


def utf8_column(d: DaemonProcess) -> None:
    text = "é" * 3_000_000 + "\n"
    with d.client() as c:
        c.open_document("file:///wide.py", text)
        started = time.monotonic()
        c.complete("file:///wide.py", {"line": 0, "character": 2 * 2_999_999, "encoding": "utf-8"})
        report("UTF-8 column on a 3M-character non-ASCII line", complete=f"{time.monotonic() - started:.2f} s")


def tcp_preauth(root: Path) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    d = DaemonProcess(root, config={"daemon.tcp_token": "s3cret", "log.level": "warning"},
                      args=("--tcp", f"127.0.0.1:{port}")).start()
    try:
        before = d.rss_mb()
        idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(70)]
        for sock in idle:
            try:
                sock.sendall(b"\x92\xdb" + struct.pack(">I", 16 * MiB - 64) + b"q" * (1 * MiB))
            except OSError:
                pass
        time.sleep(1)
        held = d.rss_mb()
        with Client.connect_unix(d.socket_path) as owner:
            owner_ok = owner.status()["state"] == "ready"
        with Client.connect_tcp("127.0.0.1", port, token="s3cret") as tcp_owner:
            tcp_ok = tcp_owner.status()["state"] == "ready"
        for sock in idle:
            sock.close()
        guesses, started = 0, time.monotonic()
        while time.monotonic() - started < 5:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
                    guess = Client(sock)
                    try:
                        guess.hello(token=f"guess{guesses}")
                    except Exception:
                        pass
                    guess.close()
                guesses += 1
            except OSError:
                time.sleep(0.05)
        report("70 unauthenticated TCP connections sending 1 MiB each", rss=f"{before:.0f}->{held:.0f} MiB",
               owner_unix_served=owner_ok, owner_tcp_served=tcp_ok)
        report("wrong-token guesses", per_second=f"{guesses / (time.monotonic() - started):.1f}")
    finally:
        d.stop()


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        probes = [streamed_strings, nested_headers, closed_connections, unread_answers, superseded_completes,
                  fairness, edit_storm, utf8_column]
        chosen = sys.argv[1:] or [p.__name__ for p in probes] + ["tcp_preauth"]
        for number, probe in enumerate(probes):
            if probe.__name__ not in chosen:
                continue
            d = daemon(root / f"d{number}")
            try:
                probe(d)
            finally:
                d.stop()
        if "tcp_preauth" in chosen:
            tcp_preauth(root / "tcp")


if __name__ == "__main__":
    main()
