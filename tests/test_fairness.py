"""Fair service between connections, through the real daemon and the shipped demo pair.

A polite client sends a small ``complete`` (32 tokens) every ~0.4 s and a ``status`` every
~0.05 s. Each test measures its idle figures and the same while another connection:

- ``long_jobs``: keeps 64 completes of 4,096 tokens (boundaries off, a 600 s time budget) in
  flight, re-sending what comes back ``busy`` after the hint in the error's data; the first
  jobs of each prompt must then finish with the token ids of the same request on the idle
  daemon (greedy);
- ``edit_storm``: sends changes of 400 ranged edits on a 1 MiB document, one after another;
- ``big_documents``: opens 64 documents of 1 MiB, closes them, and again;
- ``unread_requests``: sends up to 60,000 requests (status, hello, small completes) and reads
  no answer.

Goals (the daemon's, not loosened here): the polite ``complete`` p95 at most 2x its idle p95
+ 50 ms, its ``status`` p95 at most 2x idle + 5 ms. Each phase lasts 10 s, as the goals were
stated (25 completes and ~150 statuses: a p95 of fewer samples is little more than the one
slowest), and two long jobs must finish, not 64, to keep the file to a few minutes. The last
three loads come and go, so their idle and loaded figures come from five alternating 2 s
windows: the development machine is shared, and a neighbour's burst would otherwise land in
one of the two only (the edit storm and the big documents pause between operations; the unread
requests come on a new connection each loaded window). Run with ``-s`` to see the figures
(docs/reliability.md keeps them).
"""

from __future__ import annotations

import random
import socket
import threading
import time

import pytest

from big_documents_load import Figures, p95
from daemon_helpers import DaemonProcess, raw_connect, wait_for
from specd.engine.front.boundaries import NO_BOUNDARIES
from specd.protocol.errors import RpcError
from specd.protocol.framing import pack

pytestmark = pytest.mark.slow

PHASE_S = 10.0
WINDOWS = 5  # idle and loaded windows alternate, 2 s each (see _alternating)
POLITE_PERIOD_S = 0.4  # one small complete per period
STATUS_PERIOD_S = 0.05
MiB = 1 << 20

LONG = {"max_tokens": 4096, "time_budget_ms": 600_000, **NO_BOUNDARIES}
LONG_PROMPTS = ("import os\n\n\ndef main():\n    ", "class Stack:\n    def __init__(self):\n        ")
LONG_JOBS = 64
LONG_JOBS_THAT_MUST_FINISH = 2  # one of each prompt


@pytest.fixture(scope="module")
def demo_daemon(tmp_path_factory):
    proc = DaemonProcess(tmp_path_factory.mktemp("fairness"), engine="real", config={"log.level": "info",
                                                                                  "model.target": "demo"})
    proc.start(timeout=240)
    yield proc
    proc.stop()


def polite(daemon: DaemonProcess, seconds: float) -> Figures:
    """The polite client for ``seconds``: a small complete each period, status in between."""
    figures = Figures()
    with daemon.client() as client:
        client.hello(client="polite")
        ends = time.monotonic() + seconds
        number = 0
        while time.monotonic() < ends:
            period_ends = time.monotonic() + POLITE_PERIOD_S
            text = f"def add_{number}(a, b):\n    return "
            began = time.monotonic()
            client.complete(text=text, cursor=len(text), options={"max_tokens": 32}, timeout=60)
            figures.complete_ms.append((time.monotonic() - began) * 1000)
            number += 1
            while (now := time.monotonic()) < period_ends:
                began = now
                client.status(timeout=60)
                figures.status_ms.append((time.monotonic() - began) * 1000)
                time.sleep(max(0.0, min(STATUS_PERIOD_S, period_ends - time.monotonic())))
    return figures


def quiet(daemon: DaemonProcess) -> None:
    """Wait until no completion is queued or running and the hostile connection is gone."""
    with daemon.client() as client:
        wait_for(lambda: (info := client.status())["requests"]["queued"] == 0
                 and info["requests"]["running"] is None and info["connections"] == 1,
                 timeout=60, interval=0.1, message="a quiet daemon")


def check(name: str, idle: Figures, loaded: Figures) -> None:
    print()
    print(idle.line("idle"))
    print(loaded.line(name))
    assert len(loaded.complete_ms) >= 0.75 * len(idle.complete_ms), "the polite client got too few answers"
    assert p95(loaded.complete_ms) <= 2 * p95(idle.complete_ms) + 50, "complete p95 over 2x idle + 50 ms"
    assert p95(loaded.status_ms) <= 2 * p95(idle.status_ms) + 5, "status p95 over 2x idle + 5 ms"


class Hostile(threading.Thread):
    """Another connection's load, on a thread, until ``stop``; ``PAUSES``: it can be paused
    between two operations (``gate``)."""

    PAUSES = True

    def __init__(self, daemon: DaemonProcess):
        super().__init__(daemon=True)
        self.daemon_proc = daemon
        self.stopping = threading.Event()
        self.going = threading.Event()  # cleared: the load pauses between two of its operations
        self.going.set()
        self.idle = threading.Event()  # set while paused there
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.load()
        except BaseException as err:  # reported by stop()
            if not self.stopping.is_set():
                self.error = err

    def load(self) -> None:
        raise NotImplementedError

    def gate(self) -> bool:
        """Between two operations: wait while paused; False once stopping."""
        if not self.going.is_set():
            self.idle.set()
            while not self.going.wait(0.05):
                if self.stopping.is_set():
                    return False
            self.idle.clear()
        return not self.stopping.is_set()

    def pause(self) -> None:
        """Stop loading once the operation in progress is done (and answered)."""
        self.going.clear()
        assert self.idle.wait(60), "the hostile client did not pause"

    def resume(self) -> None:
        self.idle.clear()
        self.going.set()

    def stop(self) -> None:
        self.stopping.set()
        self.going.set()
        self.join(60)
        assert not self.is_alive(), "the hostile client did not stop"
        if self.error is not None:
            raise self.error


def one_mebibyte(seed: int) -> str:
    rng = random.Random(seed)
    lines = []
    size = 0
    while size < MiB:
        line = f"value_{rng.randrange(10**6)} = compute({rng.randrange(100)}, 'x{seed}')\n"
        lines.append(line)
        size += len(line)
    return "".join(lines)


# -- the phases ------------------------------------------------------------------------------


class LongJobs(Hostile):
    def __init__(self, daemon: DaemonProcess):
        super().__init__(daemon)
        self.results: list[tuple[int, dict]] = []  # (prompt number, result), in finishing order
        self.busy = 0
        self.hints: list[int] = []

    def load(self) -> None:
        with self.daemon_proc.client() as client:
            client.hello(client="long jobs")
            in_flight: list[tuple[int, object]] = []
            retry_at: list[tuple[float, int]] = [(0.0, n % len(LONG_PROMPTS)) for n in range(LONG_JOBS)]
            while not self.stopping.is_set():
                now = time.monotonic()
                for at, prompt in [item for item in retry_at if item[0] <= now]:
                    retry_at.remove((at, prompt))
                    text = LONG_PROMPTS[prompt]
                    _, future = client.send_request("complete", {"text": text, "cursor": len(text), "options": LONG})
                    in_flight.append((prompt, future))
                for prompt, future in [item for item in in_flight if item[1].done()]:
                    in_flight.remove((prompt, future))
                    try:
                        self.results.append((prompt, future.result()))
                    except RpcError as err:
                        assert err.code == "busy", err
                        self.busy += 1
                        hint = (err.data or {}).get("retry_after_ms")
                        assert isinstance(hint, int) and hint > 0, err.data
                        self.hints.append(hint)
                    retry_at.append((time.monotonic() + (self.hints[-1] if self.hints else 100) / 1000, prompt))
                time.sleep(0.01)


class EditStorm(Hostile):
    """Paused, its document is closed (nothing of it left to index while the polite client is
    measured alone); it is opened again, as it was first, when the storm resumes."""

    URI = "file:///hostile/storm.py"

    def load(self) -> None:
        text = one_mebibyte(1)
        lines = text.count("\n")
        rng = random.Random(2)
        self.changes = 0
        with self.daemon_proc.client() as client:
            client.hello(client="edit storm")
            while self.gate():
                client.open_document(self.URI, text, version=1, timeout=60)
                version = 1
                while self.going.is_set() and not self.stopping.is_set():
                    edits = []
                    for _ in range(400):
                        line = rng.randrange(lines)
                        edits.append({"range": {"start": {"line": line, "character": 0},
                                                "end": {"line": line, "character": 1}}, "text": "v"})
                    version += 1
                    client.change_document(self.URI, version, edits=edits, timeout=60)
                    self.changes += 1
                client.close_document(self.URI, timeout=60)


class BigDocuments(Hostile):
    """Pauses after a round's closes, so none of its documents is open while paused."""

    COUNT = 64

    def load(self) -> None:
        texts = [f"# document {n}\n" + one_mebibyte(n % 4) for n in range(self.COUNT)]
        self.opened = 0
        with self.daemon_proc.client() as client:
            client.hello(client="big documents")
            while self.gate():
                for number, text in enumerate(texts):
                    client.open_document(f"file:///hostile/big{number}.py", text, version=1, timeout=60)
                    self.opened += 1
                for number in range(self.COUNT):
                    client.close_document(f"file:///hostile/big{number}.py", timeout=60)


class UnreadRequests(Hostile):
    PAUSES = False
    COUNT = 60_000

    def __init__(self, daemon: DaemonProcess):
        super().__init__(daemon)
        self.sock = raw_connect(daemon.socket_path)
        self.sock.settimeout(None)  # sendall blocks once the daemon stops reading: stop() shuts it down
        self.sent = 0

    def load(self) -> None:
        text = "def f(x):\n    return "
        kinds = ([0, 0, "status", [{}]], [0, 0, "hello", [{"client": "unread"}]],
                 [0, 0, "complete", [{"text": text, "cursor": len(text), "options": {"max_tokens": 32}}]])
        while self.sent < self.COUNT and not self.stopping.is_set():
            batch = []
            for number in range(self.sent, min(self.COUNT, self.sent + 100)):
                message = list(kinds[number % len(kinds)])
                message[1] = number + 1
                batch.append(pack(message))
            self.sock.sendall(b"".join(batch))
            self.sent += len(batch)

    def stop(self) -> None:
        self.stopping.set()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        super().stop()
        self.sock.close()


def _references(daemon: DaemonProcess) -> list[list[int]]:
    """Each long prompt's token ids on the idle daemon."""
    with daemon.client() as client:
        return [client.complete(text=text, cursor=len(text), options=LONG, timeout=300)["token_ids"]
                for text in LONG_PROMPTS]


def test_long_jobs_of_another_connection(demo_daemon):
    references = _references(demo_daemon)
    assert all(len(ids) > 256 for ids in references), [len(ids) for ids in references]
    quiet(demo_daemon)
    idle = polite(demo_daemon, PHASE_S)
    hostile = LongJobs(demo_daemon)
    hostile.start()
    time.sleep(0.5)
    loaded = polite(demo_daemon, PHASE_S)
    with demo_daemon.client() as client:  # status shows each connection's share
        queues = {queue["client"]: queue for queue in client.status()["queues"]}
    assert queues["long jobs"]["waiting"] > 0 and queues["long jobs"]["started"], queues
    assert queues["long jobs"]["batch"] is False and queues["long jobs"]["model_s"] > 0, queues
    try:
        wait_for(lambda: {prompt for prompt, _ in hostile.results} >= set(range(len(LONG_PROMPTS)))
                 or hostile.error, timeout=120, interval=0.1, message="the first long jobs to finish")
    finally:
        hostile.stop()
    print(f"\nlong jobs: {len(hostile.results)} finished, {hostile.busy} busy answers, "
          f"retry hints {min(hostile.hints, default=0)}-{max(hostile.hints, default=0)} ms")
    first = {}
    for prompt, result in hostile.results:
        first.setdefault(prompt, result)
    assert len(first) >= LONG_JOBS_THAT_MUST_FINISH
    for prompt, result in first.items():
        assert result["token_ids"] == references[prompt], prompt
    assert hostile.busy > 0  # the connection's queue was full: the bound and its hint were exercised
    quiet(demo_daemon)
    check("long jobs", idle, loaded)


@pytest.mark.parametrize("phase", [EditStorm, BigDocuments, UnreadRequests],
                         ids=["edit_storm", "big_documents", "unread_requests"])
def test_another_connections_load(demo_daemon, phase):
    quiet(demo_daemon)
    idle, loaded, hostiles = _alternating(demo_daemon, phase)
    for what in ("changes", "opened", "sent"):
        if hasattr(hostiles[0], what):
            print(f"\n{phase.__name__}: {what} {sum(getattr(hostile, what) for hostile in hostiles)}")
    with demo_daemon.client() as client:
        assert client.status()["state"] == "ready"
    quiet(demo_daemon)
    check(phase.__name__, idle, loaded)


def _alternating(daemon: DaemonProcess, phase: type[Hostile]) -> tuple[Figures, Figures, list[Hostile]]:
    """Idle and loaded figures from ``WINDOWS`` alternating windows (``PHASE_S`` of each in
    all): whatever else runs on the machine meanwhile weighs on both alike. A load that pauses
    between operations is paused for the idle windows; one that cannot (unread requests: once
    unread, they stay) comes on a new connection each loaded window, closed after it."""
    idle, loaded = Figures(), Figures()
    hostiles = [phase(daemon)] if phase.PAUSES else []
    if phase.PAUSES:
        hostiles[0].start()
    try:
        for _window in range(WINDOWS):
            if phase.PAUSES:
                hostiles[0].pause()
            time.sleep(0.3)  # what the last operation left to the mirror and idle work
            idle.add(polite(daemon, PHASE_S / WINDOWS))
            if phase.PAUSES:
                hostiles[0].resume()
            else:
                hostiles.append(phase(daemon))
                hostiles[-1].start()
            time.sleep(0.3)
            loaded.add(polite(daemon, PHASE_S / WINDOWS))
            if not phase.PAUSES:
                hostiles[-1].stop()
    finally:
        for hostile in hostiles:
            if hostile.is_alive():
                hostile.stop()
    return idle, loaded, hostiles


def test_max_tokens_is_capped_and_hello_says_so(demo_daemon):
    """A max_tokens over daemon.max_tokens_cap is lowered to it, not refused."""
    with demo_daemon.client() as client:
        assert client.hello()["limits"]["max_tokens_cap"] == 4096
        text = "def add(a, b):\n    return "
        result = client.complete(text=text, cursor=len(text), options={"max_tokens": 60_000}, timeout=120)
        assert len(result["token_ids"]) <= 4096
