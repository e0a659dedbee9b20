"""What one client can make the daemon hold: bounded per message, per connection, per queue.

Each test asserts a bound (bytes, objects, count, or "did not stall for seconds" with a wide
margin) on one way a hostile or careless client can push: streamed or nested messages, half a
message left hanging, answers never read, superseded completes, queues, edit storms, huge
lines, unauthenticated TCP connections, and the files the daemon opens.
"""

from __future__ import annotations

import asyncio
import gc
import os
import random
import socket
import stat
import struct
import threading
import time
import tracemalloc
import weakref
from pathlib import Path

import msgpack
import pytest

from daemon_helpers import (DaemonProcess, InProcessDaemon, apply_edits, edit_index, free_port, raw_connect, read_all,
                            resolve_cursor, wait_for)
from specd.client import Client
from specd.daemon.buffers import TextIndex
from specd.daemon.listeners import RuntimeLock, StartupError, prepare_private_dir
from specd.daemon.scheduler import Job, Scheduler
from specd.protocol import ErrorCode, RpcError, pack
from specd.protocol.framing import FrameDecoder, FrameError
from specd.protocol.positions import TextIndex as SharedTextIndex
from specd.protocol.session import MAX_CONCURRENT_REQUESTS, WRITE_HIGH_WATER

MiB = 1 << 20


def replies(data: bytes) -> list:
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=False)
    unpacker.feed(data)
    return list(unpacker)


# -- per message: framing ------------------------------------------------------------------------


def test_a_message_streamed_as_many_strings_is_bounded_by_the_frame_limit():
    """400 strings of 1 KiB in one message count together toward a 64 KiB limit."""
    limit = 64 * 1024
    decoder = FrameDecoder(limit)
    decoder.feed(b"\x94\x00\x01\xa6status\xdc" + struct.pack(">H", 400))
    fed = 0
    with pytest.raises(FrameError) as info:
        for _ in range(400):
            decoder.feed(msgpack.packb("x" * 1024))
            fed += 1027
            assert decoder.pending_bytes <= limit
    assert info.value.code == "frame_too_large"
    assert fed <= limit + 1027


def test_nested_huge_array_headers_allocate_nothing():
    """A header declaring more items than the limit has bytes left is refused at once (1,000
    nested headers of 16M-1 elements are 5 KB on the wire), and headers that fit both the bytes
    and the element cap are only bytes waiting for the rest of a message."""
    huge = b"\xdd" + struct.pack(">I", (1 << 24) - 1)
    with pytest.raises(FrameError) as info:
        FrameDecoder(16 * MiB).feed(b"\x91" + huge * 1000)
    assert info.value.code == "frame_too_large"
    fitting = b"\xdd" + struct.pack(">I", 250)  # 900 of them: 225,000 elements, under the cap
    tracemalloc.start()
    try:
        decoders = []
        for _ in range(5):
            decoder = FrameDecoder(16 * MiB)
            assert decoder.feed(b"\x91" + fitting * 900) == []
            decoders.append(decoder)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 * MiB, f"{peak / MiB:.1f} MiB for 5 connections"


def test_a_small_message_of_many_containers_is_refused():
    with pytest.raises(FrameError) as info:
        FrameDecoder(1 * MiB).feed(pack([0, 1, "status", [[[]] * 100_000]]))
    assert info.value.code == "frame_too_large" and "arrays and maps" in info.value.message
    # a request with 1,000 ranged edits stays far under the cap
    edit = {"range": {"start": {"line": 1, "character": 2}, "end": {"line": 1, "character": 3}}, "text": "x"}
    message = [0, 1, "change", [{"uri": "u", "edits": [edit] * 1000}]]
    assert FrameDecoder(1 * MiB).feed(pack(message)) == [message]


def test_a_declared_length_over_the_limit_is_refused_at_the_header():
    for header in (b"\xdb\xff\xff\xff\xff", b"\xc6\x7f\xff\xff\xff", b"\xdd\x7f\xff\xff\xff", b"\xdf\x00\x10\x00\x00"):
        with pytest.raises(FrameError) as info:
            FrameDecoder(1 * MiB).feed(header)
        assert info.value.code == "frame_too_large"


# -- event loop: edits and positions ---------------------------------------------------------------


@pytest.mark.parametrize("lines_per_block", [1, 3, 256])
def test_incremental_line_index_matches_a_fresh_one(monkeypatch, lines_per_block):
    from specd.protocol import positions

    monkeypatch.setattr(positions, "LINES_PER_BLOCK", lines_per_block)
    rng = random.Random(7)
    pieces = ["a", "b", "\r", "\n", "\r\n", "é", "😀"]
    for _ in range(1000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 40)))
        index = SharedTextIndex(text)
        index.line_starts  # noqa: B018 - built, so replace carries it
        for _ in range(4):
            start = rng.randint(0, len(text))
            end = rng.randint(start, len(text))
            new = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 5)))
            index = index.replace(start, end, new)
            text = text[:start] + new + text[end:]
            # Read through pieces (the text is joined only at the end): an edited index keeps
            # its text as one piece per block until then.
            assert index.length == len(text)
            fresh = SharedTextIndex(text)
            assert index.line_starts == fresh.line_starts
            for offset in range(len(text) + 1):
                assert index.position(offset, "utf-16") == fresh.position(offset, "utf-16")
                assert index.slice(offset, min(len(text), offset + 3)) == text[offset:offset + 3]
            assert [index.line_text(n) for n in range(index.line_count)] == \
                [fresh.line_text(n) for n in range(fresh.line_count)]
        assert index.text == text


def _naive_apply(text: str, edits: list[dict]) -> str:
    for edit in edits:
        index = TextIndex(text)
        start = resolve_cursor(index, edit["range"]["start"], "utf-16")
        end = resolve_cursor(index, edit["range"]["end"], "utf-16")
        text = text[:start] + edit["text"] + text[end:]
    return text


def test_four_hundred_ranged_edits_on_a_mebibyte_do_not_stall():
    """One change frame of 400 ranged edits on a 1 MiB file froze every client for 24.8 s
    (a full line index per edit). Now one pass; the bound here is "not seconds"."""
    line = "x = compute(alpha, beta)  # é\n"
    text = line * (MiB // len(line))
    rng = random.Random(3)
    lines = text.count("\n")
    edits = []
    for number in range(400):
        at = rng.randrange(lines - 2)
        edits.append({"range": {"start": {"line": at, "character": 4}, "end": {"line": at + 1, "character": 2}},
                      "text": f"y{number}\n  "})
    started = time.perf_counter()
    result = edit_index(TextIndex(text), edits, "utf-16")
    elapsed = time.perf_counter() - started
    assert elapsed < 3.0, f"{elapsed:.2f} s for 400 edits"
    assert apply_edits(text, edits[:40], "utf-16") == _naive_apply(text, edits[:40])
    assert result.line_starts == SharedTextIndex(result.text).line_starts


@pytest.mark.parametrize("encoding", ["utf-8", "utf-16"])
def test_a_column_on_a_huge_non_ascii_line_is_not_quadratic(encoding):
    """A UTF-8 column (Neovim) at the end of a 3M-character non-ASCII line took 2.5 s."""
    text = "é" * 3_000_000 + "\nnext"
    index = TextIndex(text)
    column = 2 * 2_999_999 if encoding == "utf-8" else 2_999_999
    started = time.perf_counter()
    offset = resolve_cursor(index, {"line": 0, "character": column, "encoding": encoding})
    elapsed = time.perf_counter() - started
    assert offset == 2_999_999
    assert elapsed < 1.0, f"{elapsed:.2f} s"


# -- per queue: the scheduler -------------------------------------------------------------------


def _job(label: str, payload: object = None) -> Job:
    return Job(fn=lambda engine, cancel: (engine, payload), label=label)


def _run_one(queue: Scheduler, model_s: float = 0.01) -> Job | None:
    """What the worker does with the scheduler's next job: one step of ``model_s``, its last."""
    job = queue.next_job(0)
    if job is not None:
        queue.charge(job, model_s)
        queue.ended(job)
        job.future.set_result(None)
    return job


def test_queue_serves_connections_in_turn():
    """Behind another connection's 64 queued completes, a 2-token complete waited 114 s."""
    queue = Scheduler(max_queued_chars=10 * MiB, max_per_connection=64)
    for number in range(40):
        queue.put(1, _job(f"a{number}"), 10)
    started = queue.next_job(0)  # a0 starts; b0 comes while it runs
    queue.put(2, _job("b0"), 10)
    queue.charge(started, 0.01)
    queue.ended(started)
    started.future.set_result(None)
    order = [started.label]
    while (job := _run_one(queue)) is not None:
        order.append(job.label)
    assert order.index("b0") == 1  # served next: its connection has had no model time
    assert sorted(order) == sorted([f"a{n}" for n in range(40)] + ["b0"])


def test_the_next_step_goes_to_the_lane_with_the_least_model_time():
    """A started long job and another connection's new one: the new one's steps go first until
    its lane has had as much model time; interactive before batch; a cancelled job first."""
    queue = Scheduler(max_queued_chars=MiB)
    queue.put(1, _job("long"), 10)
    long = queue.next_job(0)
    queue.charge(long, 0.5)
    queue.put(2, _job("new"), 10)
    new = queue.next_job(0)
    assert new.label == "new" and queue.next_job(0) is new  # started, and still the least served
    queue.charge(new, 1.0)
    assert queue.next_job(0) is long
    queue.put(3, Job(fn=lambda engine, cancel: None, label="batch", batch=True), 10)
    assert queue.next_job(0) is long  # batch work waits while interactive work is started
    new.request_cancel("superseded")
    assert queue.next_job(0) is new  # its step ends it, freeing what it holds


def test_the_retry_hint_of_a_long_running_job_is_not_another_clients_service_time():
    """A connection whose only job has run 3 s, with no finished job of its own yet, was told
    to retry in 20 ms (a quarter of another client's 80 ms completes): 1,000 retries a second."""
    queue = Scheduler(max_queued_chars=MiB)
    queue._service_all_s = 0.08  # the others' completes, as _served_in averages them
    queue.put(1, _job("long"), 10)
    queue.put(2, _job("fresh"), 10)
    long = queue.next_job(0)
    queue.charge(long, 0.01)  # its first step: the other connection's job is next
    fresh = queue.next_job(0)
    assert (long.label, fresh.label) == ("long", "fresh")
    long.started_at, fresh.started_at = time.monotonic() - 3.0, time.monotonic() - 0.01
    long_hint, fresh_hint = queue.retry_after_ms(1), queue.retry_after_ms(2)
    assert 700 <= long_hint <= 800, long_hint  # a quarter of what it has run so far
    assert 60 <= fresh_hint <= 75, fresh_hint  # the usual service time, less what it has had


def test_cancelled_jobs_leave_the_queue_with_what_they_hold():
    """150 superseded completes of 4 MiB grew RSS 428 -> 1,069 MiB: queued jobs kept their text."""
    class Payload:
        pass

    queue = Scheduler(max_queued_chars=10 * MiB)
    queue.put(1, _job("running"), 1)
    queue.next_job(0)
    queue.put(1, _job("next"), 1)  # waits behind it
    refs = []
    for number in range(10):
        payload = Payload()
        refs.append(weakref.ref(payload))
        job = _job(f"w{number}", payload)
        del payload
        queue.put(2, job, 1)
        job.request_cancel("superseded")
        queue.discard(job)
        del job
    assert len(queue) == 1  # "next" only
    assert all(ref() is None for ref in refs), "a cancelled job's request outlived it"
    # cancelled while waiting, and nobody discards it: its work is dropped all the same
    held = Payload()
    ref = weakref.ref(held)
    waiting = _job("waiting", held)
    del held
    queue.put(3, waiting, 1)
    waiting.request_cancel("superseded")
    del waiting
    assert ref() is None


def test_queue_bounds_count_and_text_per_connection():
    queue = Scheduler(max_queued_chars=1000, max_per_connection=4)
    for number in range(1 + 4):  # one for the worker, four waiting
        queue.put(1, _job(f"a{number}"), 10)
    with pytest.raises(RpcError) as info:
        queue.put(1, _job("one too many"), 10)
    assert info.value.code == ErrorCode.BUSY.value
    queue.put(2, _job("b0"), 10)  # another connection is not affected: b0 is next for the worker
    queue.put(2, _job("b1"), 900)
    with pytest.raises(RpcError) as info:
        queue.put(2, _job("b2"), 200)
    assert info.value.code == ErrorCode.BUSY.value and "characters" in info.value.message


# -- per connection: an in-process daemon ----------------------------------------------------------


class LocalDaemon(InProcessDaemon):
    """An in-process daemon with 4 MiB frames, the TCP token ``token`` and the ``limits`` set on it."""

    def __init__(self, root: Path, tcp: str | None = None, token: str = "", **limits: float):
        environ = {"SPECD_DAEMON_MAX_FRAME_BYTES": str(4 * MiB)}
        if token:
            environ["SPECD_DAEMON_TCP_TOKEN"] = token
        super().__init__(root, environ, tcp=tcp)
        for name, value in limits.items():
            setattr(self.daemon, name, value)


def test_half_a_message_is_not_kept_forever(tmp_path):
    with LocalDaemon(tmp_path, partial_message_timeout_s=0.5) as d:
        with raw_connect(d.socket_path) as sock:
            frame = pack([0, 1, "status", [{}]])
            sock.sendall(frame[:-3])
            started = time.monotonic()
            data = read_all(sock, timeout=10)
            waited = time.monotonic() - started
        assert replies(data)[-1][1] == "specd/error" and replies(data)[-1][2][0]["code"] == "timeout"
        assert waited < 5
        wait_for(lambda: not d.daemon.connections, 5, message="the connection to be gone")


def test_closed_connections_are_freed_without_a_garbage_collection(tmp_path):
    """20 closed connections held +775 MiB until gc.collect() (a Session<->Connection cycle)."""
    with LocalDaemon(tmp_path) as d:
        gc.collect()
        gc.disable()
        try:
            sessions = []
            for _ in range(5):
                sock = raw_connect(d.socket_path)
                sock.sendall(b"\x92\xdb" + struct.pack(">I", 3 * MiB) + b"y" * (2 * MiB))  # partial: 2 MiB held
                wait_for(lambda: d.daemon.connections and any(c.session and c.session._decoder.pending_bytes >= 2 * MiB
                                                              for c in d.daemon.connections.values()), 5,
                         message="the partial message buffered")
                sessions += d.on_loop(lambda: [weakref.ref(c.session) for c in d.daemon.connections.values()])
                sock.close()
                wait_for(lambda: not d.daemon.connections, 10, message="the connection to close")
            wait_for(lambda: all(ref() is None for ref in sessions), 5, message="closed sessions to be freed")
        finally:
            gc.enable()


def test_a_client_that_never_reads_stops_being_read(tmp_path):
    """60,000 unread status requests grew the daemon by +334 MiB, linearly."""
    request = pack([0, 1, "status", [{}]])
    with LocalDaemon(tmp_path) as d:
        with raw_connect(d.socket_path) as sock:
            sock.setblocking(False)
            sent = 0
            last_progress = time.monotonic()
            while sent < 60_000 and time.monotonic() - last_progress < 2.0:
                try:
                    sock.send(request)
                    sent += 1
                    last_progress = time.monotonic()
                except BlockingIOError:
                    time.sleep(0.01)
            state = d.on_loop(lambda: [(c.session.write_buffer_size(), len(c.session._tasks))
                                       for c in d.daemon.connections.values() if c.session])
        assert sent < 60_000, "the daemon kept reading from a client that reads nothing"
        (buffered, tasks), = state
        assert tasks <= MAX_CONCURRENT_REQUESTS
        assert buffered <= WRITE_HIGH_WATER + MAX_CONCURRENT_REQUESTS * 16 * 1024


def test_long_uris_are_refused(tmp_path):
    with LocalDaemon(tmp_path) as d, Client.connect_unix(d.socket_path) as c:
        with pytest.raises(RpcError) as info:
            c.open_document("file:///" + "a" * 20_000, "x")
        assert info.value.code == "invalid_params" and "uri" in info.value.message
        assert c.status()["documents"]["open"] == 0


# -- TCP before authentication ----------------------------------------------------------------------


def test_unauthenticated_tcp_cannot_lock_the_owner_out(tmp_path):
    """A full pre-auth pool makes room by closing its oldest connection, never by refusing the
    newcomer: the owner with the token gets in over TCP, and over Unix."""
    from specd.daemon import admission

    port = free_port()
    with LocalDaemon(tmp_path, tcp=f"127.0.0.1:{port}", token="s3cret") as d:
        idle = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(admission.MAX_PREAUTH_CONNECTIONS)]
        try:
            wait_for(lambda: len(d.daemon.connections) == admission.MAX_PREAUTH_CONNECTIONS, 5, message="pre-auth connections")
            with Client.connect_tcp("127.0.0.1", port, token="s3cret") as owner:
                assert owner.status()["state"] == "ready"
            evicted = replies(read_all(idle[0], timeout=5))
            assert evicted and evicted[0][2][0]["code"] == "too_many_connections", evicted
            assert "make room" in evicted[0][2][0]["message"]
            with Client.connect_unix(d.socket_path) as owner:
                assert owner.status()["connections"] >= 1
        finally:
            for sock in idle:
                sock.close()


@pytest.mark.parametrize("listener", ["unix", "tcp"])
def test_silent_connections_never_delay_a_client_that_says_hello(tmp_path, listener):
    """64 connections that never send a message, then clients that say hello at once: each is
    answered without waiting or failing, however full the pending pool; the silent ones are
    closed (the oldest first, to make room; the rest at the first-message deadline)."""
    from specd.daemon import admission

    port = free_port()
    with LocalDaemon(tmp_path, tcp=f"127.0.0.1:{port}", token="s3cret",
                     hello_deadline_s=2.0) as d:
        def connect_silent():
            if listener == "tcp":
                return socket.create_connection(("127.0.0.1", port), timeout=5)
            return raw_connect(d.socket_path)

        def client():
            if listener == "tcp":
                return Client.connect_tcp("127.0.0.1", port, token="s3cret")
            return Client.connect_unix(d.socket_path)

        silent = [connect_silent() for _ in range(64)]
        try:
            waits = []
            for _ in range(10):
                started = time.monotonic()
                with client() as c:
                    assert c.hello(client="polite")["state"] == "ready"
                waits.append(time.monotonic() - started)
                silent.append(connect_silent())  # more keep coming between the clients
            pool = admission.MAX_PENDING_UNIX if listener == "unix" else admission.MAX_PREAUTH_CONNECTIONS
            pending = d.on_loop(lambda: sum(1 for c in d.daemon.connections.values() if c.pending))
            assert pending <= pool
            assert max(waits) < 1.0, f"a hello waited {max(waits):.2f} s"
        finally:
            for sock in silent:
                sock.close()


def test_a_unix_connection_that_says_nothing_is_closed_at_the_deadline(tmp_path):
    with LocalDaemon(tmp_path, first_message_deadline_s=0.5) as d:
        with raw_connect(d.socket_path) as sock:
            started = time.monotonic()
            got = replies(read_all(sock, timeout=5))
            took = time.monotonic() - started
        assert got and got[-1][2][0]["code"] == "timeout" and "no request within 0.5 s" in got[-1][2][0]["message"]
        assert took < 3
        with Client.connect_unix(d.socket_path) as c:  # a client that speaks is not cut
            c.hello()
            time.sleep(0.8)
            assert c.status()["state"] == "ready"


def test_pre_auth_messages_are_small_and_hello_has_a_deadline(tmp_path):
    from specd.daemon import admission

    port = free_port()
    with LocalDaemon(tmp_path, tcp=f"127.0.0.1:{port}", token="s3cret", hello_deadline_s=0.5) as d:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            sock.sendall(pack([0, 1, "hello", [{"client": "x" * (admission.PREAUTH_MAX_FRAME_BYTES + 10)}]]))
            got = replies(read_all(sock, timeout=5))
        assert got[-1][2][0]["code"] == "frame_too_large"
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            started = time.monotonic()
            data = read_all(sock, timeout=10)
            assert time.monotonic() - started < 5
        assert replies(data)[-1][2][0]["code"] == "unauthorized" and "within 0.5 s" in replies(data)[-1][2][0]["message"]
        with Client.connect_tcp("127.0.0.1", port, token="s3cret") as c:  # a large message once authenticated
            assert c.request("status", {"pad": "x" * (admission.PREAUTH_MAX_FRAME_BYTES * 2)})["state"] == "ready"


def test_wrong_tokens_back_off(tmp_path, monkeypatch):
    from specd.daemon import admission

    monkeypatch.setattr(admission, "AUTH_BACKOFF_BASE_S", 0.2)
    port = free_port()
    with LocalDaemon(tmp_path, tcp=f"127.0.0.1:{port}", token="s3cret"):
        waits = []
        for _ in range(3):
            with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
                client = Client(sock)
                started = time.monotonic()
                with pytest.raises(RpcError) as info:
                    client.hello(token="guess")
                waits.append(time.monotonic() - started)
                assert info.value.code == "unauthorized"
                client.close()
        assert waits[0] >= 0.2 and waits[1] >= 0.4 and waits[2] >= 0.8, waits
        with Client.connect_tcp("127.0.0.1", port, token="s3cret") as c:  # the right token resets it
            assert c.status()["state"] == "ready"


# -- a daemon process: resident memory -------------------------------------------------------------


@pytest.fixture(scope="module")
def memory_daemon(tmp_path_factory):
    d = DaemonProcess(tmp_path_factory.mktemp("memory-daemon"), config={
        "daemon.max_frame_bytes": 8 * MiB, "daemon.max_document_bytes": 4 * MiB, "log.level": "info",
    }, env={"SPECD_TEST_SLOW_S": "60"})  # held until cancelled
    d.start()
    yield d
    d.stop()


def test_superseded_completes_do_not_keep_their_text(memory_daemon):
    """150 superseded completes of 1 MiB each, queued behind a slow one: RSS stays flat."""
    with memory_daemon.client() as busy, memory_daemon.client() as c:
        c.status()
        busy.open_document("file:///slow.py", "#slow\n")
        slow = busy.send_request("complete", {"uri": "file:///slow.py", "cursor": 6})[1]
        wait_for(lambda: busy.status()["requests"]["running"], 5, message="the slow complete to run")
        before = memory_daemon.rss_mb()
        futures = []
        for number in range(150):
            text = f"# {number}\n" + "z" * MiB
            futures.append(c.send_request("complete", {"uri": "file:///big.py", "text": text, "cursor": 3})[1])
            del text
        for future in futures[:-1]:
            with pytest.raises(RpcError) as info:
                future.result(30)
            assert info.value.code == "cancelled"
        grown = memory_daemon.rss_mb() - before
        assert busy.status()["requests"]["queued"] == 1
        busy.cancel(uri="file:///slow.py")
        with pytest.raises(RpcError):
            slow.result(30)
        assert futures[-1].result(30)["text"]
    assert grown < 48, f"+{grown:.0f} MiB"


def test_connections_close_and_memory_returns(memory_daemon):
    """Partial 7 MiB messages on 10 connections; once they close, RSS is back near baseline."""
    before = memory_daemon.rss_mb()
    socks = []
    for _ in range(10):
        sock = raw_connect(memory_daemon.socket_path)
        sock.sendall(b"\x92\xdb" + struct.pack(">I", 8 * MiB - 64) + b"q" * (7 * MiB))
        socks.append(sock)
    with memory_daemon.client() as c:
        wait_for(lambda: c.status()["connections"] >= 11, 10, message="all connections held")
        for sock in socks:
            sock.close()
        wait_for(lambda: c.status()["connections"] == 1, 10, message="the connections to close")
    grown = memory_daemon.rss_mb() - before
    assert grown < 32, f"+{grown:.0f} MiB after the connections closed"


def test_fair_service_between_connections(tmp_path):
    """A 2-token complete behind another connection's queued completes waits for one, not all."""
    d = DaemonProcess(tmp_path / "d", env={"SPECD_TEST_SLOW_S": "0.3"}).start()
    try:
        with d.client() as hog, d.client() as polite:
            order: list[str] = []
            lock = threading.Lock()

            def record(label):
                def done(_future):
                    with lock:
                        order.append(label)
                return done

            hog_futures = []
            for number in range(8):
                future = hog.send_request("complete", {"text": "#slow\n", "cursor": 6})[1]
                future.add_done_callback(record(f"hog{number}"))
                hog_futures.append(future)
            wait_for(lambda: polite.status()["requests"]["queued"] >= 5, 5, message="the hog's completes queued")
            mine = polite.send_request("complete", {"text": "abc", "cursor": 3})[1]
            mine.add_done_callback(record("polite"))
            assert mine.result(30)["text"] == "[abc]"
            for future in hog_futures:
                future.result(30)
        assert order.index("polite") <= 2, order
    finally:
        d.stop()


# -- files -------------------------------------------------------------------------------------------


def test_a_private_dir_is_created_0700(tmp_path):
    target = tmp_path / "fresh" / "specd"
    prepare_private_dir(target)
    assert stat.S_IMODE(target.stat().st_mode) == 0o700


@pytest.mark.parametrize("mode", [0o755, 0o1777])
def test_an_existing_shared_dir_is_refused_and_left_alone(tmp_path, mode):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, mode)
    with pytest.raises(StartupError) as info:
        prepare_private_dir(shared)
    assert "chmod 700" in str(info.value) and "\n" not in str(info.value)
    assert stat.S_IMODE(shared.stat().st_mode) == mode


def test_a_symlinked_runtime_dir_is_refused(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o755)
    os.chmod(elsewhere, 0o755)
    link = tmp_path / "specd"
    link.symlink_to(elsewhere)
    with pytest.raises(StartupError) as info:
        prepare_private_dir(link)
    assert "symlink" in str(info.value)
    assert stat.S_IMODE(elsewhere.stat().st_mode) == 0o755


def test_a_planted_lock_symlink_is_not_followed(tmp_path):
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    (run / "specd.sock.lock").symlink_to(victim)
    lock = RuntimeLock(run / "specd.sock")
    with pytest.raises(StartupError) as info:
        lock.acquire()
    assert "symlink" in str(info.value)
    assert victim.read_text() == "precious\n"


def test_log_files_are_private_and_never_followed(tmp_path):
    import logging

    from specd.logs import open_private, setup_logging

    log_file = tmp_path / "state" / "specd.log"
    root = logging.getLogger()
    saved = list(root.handlers), root.level
    try:
        setup_logging("info", log_file, stderr=False)
        logging.getLogger("specd.test").info("context of a completion")
    finally:
        for handler in list(root.handlers):
            root.removeHandler(handler)
            handler.close()
        for handler in saved[0]:
            root.addHandler(handler)
        root.setLevel(saved[1])
    assert "context of a completion" in log_file.read_text()
    assert stat.S_IMODE(log_file.stat().st_mode) == 0o600
    assert stat.S_IMODE(log_file.parent.stat().st_mode) == 0o700
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    (tmp_path / "planted.log").symlink_to(victim)
    with pytest.raises(OSError):
        open_private(tmp_path / "planted.log")
    assert victim.read_text() == "precious\n"


def test_the_walker_finds_every_message_end_however_the_bytes_are_cut():
    """Values of every msgpack type, packed back to back, fed in random pieces."""
    rng = random.Random(11)

    def value(depth: int = 0):
        pick = rng.randrange(12 if depth < 4 else 9)
        if pick == 0:
            return rng.choice([0, 1, 127, 128, 255, 256, 65535, 65536, 2**32, 2**63, 2**64 - 1])
        if pick == 1:
            return rng.choice([-1, -32, -33, -128, -129, -32768, -32769, -2**31 - 1, -2**63])
        if pick == 2:
            return rng.choice([None, True, False, 0.5, -1e300])
        if pick == 3:
            return "é" * rng.choice([0, 1, 15, 16, 40, 200, 40_000])
        if pick == 4:
            return bytes(rng.choice([0, 1, 300, 70_000]))
        if pick == 5:
            return msgpack.ExtType(5, bytes(rng.choice([1, 2, 4, 8, 16, 3, 300, 70_000])))
        if pick in (6, 7, 8):
            return "x" * rng.randrange(40)
        if pick in (9, 10):
            return [value(depth + 1) for _ in range(rng.choice([0, 1, 3, 15, 16, 20]))]
        return {f"k{n}": value(depth + 1) for n in range(rng.choice([0, 1, 3, 15, 16, 20]))}

    for _ in range(30):
        values = [value() for _ in range(rng.randrange(1, 6))]
        stream = b"".join(msgpack.packb(v, use_bin_type=True) for v in values)
        decoder = FrameDecoder(4 * MiB)
        got, at = [], 0
        while at < len(stream):
            step = rng.choice([1, 2, 3, 7, 100, 5000, 100_000])
            got += decoder.feed(stream[at:at + step])
            at += step
        assert got == [msgpack.unpackb(msgpack.packb(v, use_bin_type=True), raw=False, strict_map_key=False) for v in values]
        assert decoder.pending_bytes == 0


def test_specd_complete_gives_up_quickly_on_a_stopped_daemon(tmp_path, monkeypatch):
    """`specd complete` waited 300 s on a SIGSTOPped daemon."""
    import signal

    from specd import client as client_module
    from specd.client import DaemonUnavailable, complete_via_daemon

    monkeypatch.setattr(client_module, "RESPONSIVE_TIMEOUT_S", 1.0)
    d = DaemonProcess(tmp_path / "d").start()
    try:
        os.kill(d.pid, signal.SIGSTOP)
        cfg = type("Cfg", (), {"socket_path": str(d.socket_path)})()
        started = time.monotonic()
        with pytest.raises(DaemonUnavailable) as info:
            complete_via_daemon(cfg, "abc", offset=3, spawn=False)
        assert time.monotonic() - started < 10
        assert "did not answer" in info.value.message
    finally:
        os.kill(d.pid, signal.SIGCONT)
        d.stop()


def _fuzz_frame(rng: random.Random) -> bytes:
    """One structure-aware hostile frame: nested headers, streamed strings, partial or huge ones."""
    kind = rng.randrange(8)
    if kind == 0:  # a well-formed request
        method = rng.choice(["status", "hello", "open", "complete", "change", "close", "cancel", "nope"])
        params = rng.choice([{}, {"uri": "file:///f.py", "text": "abc"}, {"text": "abc", "cursor": 3},
                             {"uri": "file:///f.py", "edits": [{"start": 0, "end": 1, "text": "z"}]}, {"msgid": 7}])
        return pack([0, rng.randrange(2**32), method, [params]])
    if kind == 1:  # nested array headers declaring many elements
        size = rng.choice([15, 65535, (1 << 24) - 1, (1 << 32) - 1])
        return b"\x91" + (b"\xdd" + struct.pack(">I", size)) * rng.randrange(1, 1200)
    if kind == 2:  # a message streamed as many strings
        return b"\x94\x00\x01\xa6status\xdc" + struct.pack(">H", 400) + msgpack.packb("s" * 4096) * rng.randrange(1, 40)
    if kind == 3:  # a request cut anywhere
        frame = pack([0, 1, "open", [{"uri": "file:///cut.py", "text": "t" * rng.randrange(100_000)}]])
        return frame[: rng.randrange(1, len(frame))]
    if kind == 4:  # a header declaring more than the limit
        return rng.choice([b"\xdb", b"\xc6", b"\xdd", b"\xdf", b"\xc9"]) + struct.pack(">I", rng.randrange(1 << 24, 1 << 32))
    if kind == 5:  # deep nesting
        return b"\x91" * rng.randrange(1, 3000)
    if kind == 6:  # many containers in one small message
        return pack([0, 1, "status", [[[]] * rng.randrange(1, 80_000)]])
    return bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64)))


@pytest.mark.slow
def test_ten_thousand_hostile_frames_and_memory_returns(memory_daemon):
    """10,000 structure-aware frames on 200 connections (10 at a time): no crash, a well-behaved
    client is served throughout, and RSS is back within 32 MiB once the connections close."""
    with memory_daemon.client() as c:
        c.status()
        before = memory_daemon.rss_mb()
        peak = before

        def hammer(seed: int) -> None:
            rng = random.Random(seed)
            for _ in range(20):
                try:
                    with raw_connect(memory_daemon.socket_path, timeout=2) as sock:
                        for _ in range(50):
                            sock.sendall(_fuzz_frame(rng))
                except OSError:
                    pass  # the daemon closed it after a bad frame: expected

        threads = [threading.Thread(target=hammer, args=(seed,)) for seed in range(10)]
        for thread in threads:
            thread.start()
        served = 0
        while any(thread.is_alive() for thread in threads):
            assert c.status(timeout=10)["state"] == "ready"
            served += 1
            peak = max(peak, memory_daemon.rss_mb())
            time.sleep(0.05)
        for thread in threads:
            thread.join()
        wait_for(lambda: c.status()["connections"] == 1, 30, message="the fuzz connections to close")
        after = memory_daemon.rss_mb()
    print(f"fuzz: RSS {before:.0f} -> peak {peak:.0f} -> {after:.0f} MiB; {served} status answers meanwhile")
    assert memory_daemon.proc.poll() is None
    assert served > 0
    assert after - before < 32, f"RSS {before:.0f} -> {after:.0f} MiB"


def test_an_edit_storm_is_applied_in_steps_and_in_order(tmp_path):
    """Another client is served between the steps of a 400-edit change; requests pipelined after
    the change on the same document see its result."""
    line = "x = compute(alpha, beta)  # é\n"
    text = line * (MiB // len(line))
    edits = [{"range": {"start": {"line": n * 50, "character": 0}, "end": {"line": n * 50, "character": 1}},
              "text": "y"} for n in range(400)]
    with LocalDaemon(tmp_path) as d, Client.connect_unix(d.socket_path) as c, Client.connect_unix(d.socket_path) as other:
        c.open_document("file:///storm.py", text, version=1)
        change = c.send_request("change", {"uri": "file:///storm.py", "version": 2, "edits": edits, "encoding": "utf-16"})[1]
        after = c.send_request("complete", {"uri": "file:///storm.py", "cursor": {"line": 0, "character": 1}})[1]
        second = c.send_request("change", {"uri": "file:///storm.py", "version": 3,
                                           "edits": [{"start": 0, "end": 1, "text": "z"}]})[1]
        worst = 0.0
        while not change.done():
            started = time.monotonic()
            other.status()
            worst = max(worst, time.monotonic() - started)
        assert change.result(30)["version"] == 2
        assert after.result(30)["text"] == "[y]" and after.result()["version"] == 2
        assert second.result(30)["version"] == 3
        assert d.on_loop(lambda: d.daemon.buffers.get("file:///storm.py").text[:3]) == "z ="
        assert d.on_loop(lambda: len(d.daemon._document_locks)) == 0
    print(f"edit storm: another client's slowest status {worst * 1000:.0f} ms")
    assert worst < 1.0


def test_the_engine_hears_where_a_ranged_change_left_the_cursor(tmp_path):
    """Idle prefill warms the cache where the user types. From two texts alone that place is
    ambiguous when the edit repeats the text around it (Enter before an empty line, a space
    after spaces); a ranged change says it exactly, and the daemon passes it on."""
    text = "def f():\n    x = 1\n\n    return x\n"
    line_end = text.index("\n\n")
    with LocalDaemon(tmp_path) as d, Client.connect_unix(d.socket_path) as c:
        engine = d.daemon.worker.engine
        c.open_document("file:///cursor.py", text, version=1)
        # The engine holds the document before the changes come (a change to a document it has
        # not seen yet would reach it as an open, with no cursor).
        wait_for(lambda: engine.documents.get("file:///cursor.py") == text, 10, message="the engine to hear the open")
        changes = [  # (edits, where the cursor is after them)
            ([{"range": {"start": {"line": 1, "character": 9}, "end": {"line": 1, "character": 9}}, "text": "\n"}],
             line_end + 1),  # Enter at the end of "    x = 1" (utf-16 columns)
            ([{"start": line_end + 1, "end": line_end + 1, "text": "    "}], line_end + 5),  # offsets, indentation
            ([{"start": 0, "end": 0, "text": "# é\n"}, {"range": {"start": {"line": 3, "character": 4},
                                                               "end": {"line": 3, "character": 4}}, "text": "  "}],
             len("# é\n") + line_end + 7),  # two edits: the last one counts, after the first moved it
            ([{"text": "whole = 1\n"}], None),  # a full replacement: the engine infers it
        ]
        for version, (edits, expected) in enumerate(changes, 2):
            c.send_request("change", {"uri": "file:///cursor.py", "version": version, "edits": edits,
                                      "encoding": "utf-16"})[1].result(10)
            wait_for(lambda: engine.documents.get("file:///cursor.py") == d.on_loop(
                lambda: d.daemon.buffers.get("file:///cursor.py").text), 5, message="the engine to hear the change")
            assert engine.cursors.get("file:///cursor.py") == expected, (version, edits)


def _percentile(samples: list[float], fraction: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def test_another_clients_p95_under_edit_storms(tmp_path):
    """A polite client's p95 stays near its idle value while another client sends 400-edit
    changes on 1 MiB. A real daemon process, so the two clients do not share a GIL with it.
    Without short edit steps and the loop's turns between them, a status waits for a whole
    storm's change (figures: docs/reliability.md)."""
    line = "x = compute(alpha, beta)  # é\n"
    text = line * (MiB // len(line))
    edits = [{"range": {"start": {"line": n * 50, "character": 0}, "end": {"line": n * 50, "character": 1}},
              "text": "y"} for n in range(400)]
    d = DaemonProcess(tmp_path, config={"daemon.max_frame_bytes": 4 * MiB, "daemon.max_document_bytes": 4 * MiB,
                                        "log.level": "warning"}).start()
    try:
        with d.client() as storm, d.client() as polite:
            storm.open_document("file:///storm.py", text, version=1)
            for _ in range(20):  # warm up both ends
                polite.status()
            idle = []
            for _ in range(300):
                started = time.monotonic()
                polite.status()
                idle.append(time.monotonic() - started)
            during, changes = [], []
            for version in range(2, 10):
                started_change = time.monotonic()
                change = storm.send_request("change", {"uri": "file:///storm.py", "version": version, "edits": edits,
                                                       "encoding": "utf-16"})[1]
                while not change.done():
                    started = time.monotonic()
                    polite.status()
                    during.append(time.monotonic() - started)
                assert change.result(30)["version"] == version
                changes.append(time.monotonic() - started_change)
    finally:
        d.stop()
    idle_p95, storm_p95 = _percentile(idle, 0.95), _percentile(during, 0.95)
    print(f"\nstatus idle: p50 {_percentile(idle, 0.5) * 1000:.1f} ms, p95 {idle_p95 * 1000:.1f} ms, "
          f"max {max(idle) * 1000:.1f} ms; during 8 storms ({len(during)} samples): "
          f"p50 {_percentile(during, 0.5) * 1000:.1f} ms, p95 {storm_p95 * 1000:.1f} ms, max {max(during) * 1000:.1f} ms "
          f"({storm_p95 / idle_p95:.1f}x idle p95); each change {sorted(changes)[len(changes) // 2] * 1000:.0f} ms (median)")
    assert len(during) >= 40  # the polite client was served throughout, not once per change
    assert storm_p95 < 3 * idle_p95 + 0.015  # 2x is the goal; the slack is for a loaded 2-core machine


def test_status_reuses_the_engines_figures_until_they_may_have_changed(tmp_path):
    """status answers from the engine's last figures (no thread hop) while they are young and
    nothing the daemon knows of changed them; a completion that ended means new figures."""
    from specd.daemon.metrics import EngineFigures

    with LocalDaemon(tmp_path) as d, Client.connect_unix(d.socket_path) as c:
        engine = d.daemon.worker.engine
        fetches = []
        real_stats = engine.stats
        engine.stats = lambda: fetches.append(threading.current_thread().name) or real_stats()
        d.on_loop(lambda: setattr(d.daemon._engine_figures, "max_age_s", 60.0))
        first = c.status()
        for _ in range(5):
            assert c.status()["engine"] == first["engine"]
        assert len(fetches) == 1 and fetches[0] != d.thread.name  # fetched once, on a thread
        c.complete(text="abc", cursor=3)
        assert c.status()["acceptance"]["lookup"]["accepted"] == first["acceptance"]["lookup"]["accepted"] + 1
        assert len(fetches) == 2
        d.on_loop(lambda: setattr(d.daemon._engine_figures, "max_age_s", 0.0))
        c.status()
        assert len(fetches) == 3  # too old: fetched again

    figures, source = EngineFigures(60.0), ("engine", "ready")
    token = figures.begin()
    figures.invalidate()  # a completion ended while that fetch ran
    figures.keep(token, source, {"requests": 1})
    assert figures.fresh(source) is None
    figures.keep(figures.begin(), source, {"requests": 2})
    assert figures.fresh(source) == {"requests": 2} and figures.fresh(("engine", "unloaded")) is None


def test_a_large_text_is_indexed_in_steps(monkeypatch):
    from specd.daemon import buffers
    from specd.daemon.buffers import index_in_steps

    monkeypatch.setattr(buffers, "STEPWISE_INDEX_CHARS", 10)
    monkeypatch.setattr(buffers, "INDEX_STEP_CHARS", 7)
    rng = random.Random(5)
    for _ in range(1000):
        text = "".join(rng.choice(["a", "\r", "\n", "\r\n", "é"]) for _ in range(rng.randint(0, 60)))
        assert asyncio.run(index_in_steps(text)).line_starts == TextIndex(text).line_starts


def test_opening_a_large_document_does_not_stall_other_clients(tmp_path):
    line = "value = compute(alpha)  # é\n"
    text = line * (3 * MiB // len(line))
    lines = text.count("\n")
    with LocalDaemon(tmp_path) as d, Client.connect_unix(d.socket_path) as c, Client.connect_unix(d.socket_path) as other:
        opened = c.send_request("open", {"uri": "file:///large.py", "text": text})[1]
        completed = c.send_request("complete", {"uri": "file:///large.py", "cursor": {"line": lines - 1, "character": 5}})[1]
        worst = 0.0
        while not completed.done():
            started = time.monotonic()
            other.status()
            worst = max(worst, time.monotonic() - started)
        opened.result(10)
        offset = len(text) - len(line) + 5
        assert completed.result(10)["offset"] == offset
        assert completed.result()["text"] == "[" + text[offset - 12:offset] + "]"
    print(f"large open: another client's slowest status {worst * 1000:.0f} ms")
    assert worst < 1.0


def test_the_partial_message_clock_restarts_with_each_message(tmp_path):
    """A client that keeps sending whole messages, each read ending mid-message, is not cut."""
    frame = pack([0, 1, "status", [{}]])
    with LocalDaemon(tmp_path, partial_message_timeout_s=0.5) as d:
        with raw_connect(d.socket_path) as sock:
            sock.sendall(frame[:5])
            for _ in range(15):  # 1.5 s of traffic, never an empty buffer between reads
                time.sleep(0.1)
                sock.sendall(frame[5:] + frame[:5])
            sock.sendall(frame[5:])
            sock.shutdown(socket.SHUT_WR)
            got = replies(read_all(sock, timeout=10))
        assert [message[0] for message in got] == [1] * 16, got[-1]  # 16 answers, no timeout
