"""Malformed input thrown at the real daemon while a well-behaved client is served throughout.

Hypothesis generates frames of five kinds (random bytes, msgpack of the wrong shape, requests
with random methods and params, truncated requests, headers declaring huge lengths) and sends a
batch of them on a fresh connection, then half-closes. For each batch the daemon must answer
with well-formed responses or error notifications, and close the connection (never hang); a
background client keeps getting answers the whole time; the daemon's memory stays bounded.
"""

from __future__ import annotations

import socket
import struct
import threading
import time

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from daemon_helpers import raw_connect, read_all
from specd.protocol import pack
from specd.protocol.messages import parse_message, Response, Notification

pytestmark = pytest.mark.slow

METHODS = ["hello", "open", "change", "close", "complete", "cancel", "status"]  # not shutdown
KEYS = ["uri", "text", "cursor", "version", "edits", "options", "msgid", "encoding", "extra_context",
        "line", "character", "offset", "byte_offset", "range", "start", "end", "token", "max_tokens"]

SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))

scalars = (st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats(allow_nan=True)
           | st.text(max_size=20) | st.binary(max_size=20) | st.sampled_from(["file:///fuzz.py", "utf-16", ""]))
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.sampled_from(KEYS) | st.text(max_size=5), inner, max_size=4),
    max_leaves=12,
)
params = st.dictionaries(st.sampled_from(KEYS), values, max_size=6)
msgids = st.integers(0, 2**32 - 1) | st.integers(-5, -1) | st.just(2**32) | st.text(max_size=3) | st.none()
methods = st.sampled_from(METHODS) | st.text(max_size=12)
requests = st.builds(lambda i, m, p, wrap: pack([0, i, m, [p] if wrap else p]), msgids, methods, params, st.booleans())
notifications = st.builds(lambda m, p: pack([2, m, [p]]), methods, params)
wrong_shapes = values.map(pack)
truncated = st.builds(lambda frame, cut: frame[: max(1, int(len(frame) * cut))], requests, st.floats(0, 0.99))
huge_header = st.sampled_from([b"\xdb", b"\xc6", b"\xdd", b"\xdf", b"\xc9\x00\x00\x00\x00"[:1]]).flatmap(
    lambda head: st.builds(lambda n, tail: head + struct.pack(">I", n) + tail,
                           st.integers(2**20, 2**32 - 1), st.binary(max_size=64)))
frames = st.one_of(st.binary(min_size=1, max_size=256), wrong_shapes, requests, notifications, truncated, huge_header)


class Background:
    """A well-behaved client on its own connection, asking all the time."""

    def __init__(self, daemon):
        self.daemon = daemon
        self.ok = 0
        self.errors: list[str] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        with self.daemon.client() as client:
            number = 0
            while not self.stop.is_set():
                number += 1
                try:
                    if number % 10 == 0:
                        client.complete(text="def f(x):\n    return x", cursor=22, options={"max_tokens": 2}, timeout=15)
                    else:
                        assert client.hello(timeout=5)["server"] == "specd"
                    self.ok += 1
                except Exception as err:  # recorded, asserted at the end
                    self.errors.append(f"{type(err).__name__}: {err}")
                time.sleep(0.01)


@pytest.fixture(scope="module")
def fuzzing(daemon):
    with daemon.client() as warm:  # let allocations settle before the baseline
        warm.complete(text="x = 1\n", cursor=6, options={"max_tokens": 2})
    stats = {"frames": 0, "batches": 0, "rss_before": daemon.rss_mb()}
    background = Background(daemon)
    background.thread.start()
    stats["background"] = background
    yield stats
    background.stop.set()
    background.thread.join(30)


def _check_reply(obj) -> None:
    message = parse_message(obj)
    if isinstance(message, Response):
        if message.error is not None:
            assert isinstance(message.error["code"], str) and isinstance(message.error["message"], str)
            assert message.result is None
    else:
        assert isinstance(message, Notification) and message.method == "specd/error"
        assert isinstance(message.params["code"], str)


def _throw(daemon, stats, batch: list[bytes]) -> None:
    with raw_connect(daemon.socket_path) as sock:
        try:
            sock.sendall(b"".join(batch))
            sock.shutdown(socket.SHUT_WR)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the daemon closed first (undecodable bytes); what it said is still readable
        started = time.monotonic()
        try:
            data = read_all(sock, timeout=15)
        except ConnectionResetError:
            data = b""
        assert time.monotonic() - started < 15, "the daemon neither answered nor closed"
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=False)
    unpacker.feed(data)
    for reply in unpacker:
        _check_reply(reply)
    assert daemon.proc.poll() is None, daemon.stderr()[-2000:]
    stats["seconds"] = stats.get("seconds", 0) + time.monotonic() - started
    stats["frames"] += len(batch)
    stats["batches"] += 1


@SETTINGS
@given(batch=st.lists(frames, min_size=3, max_size=16))
def test_mixed_garbage(daemon, fuzzing, batch):
    _throw(daemon, fuzzing, batch)


@settings(SETTINGS, max_examples=120)
@given(batch=st.lists(requests, min_size=6, max_size=24))
def test_requests_with_bad_params_and_unknown_methods(daemon, fuzzing, batch):
    _throw(daemon, fuzzing, batch)


@settings(SETTINGS, max_examples=60)
@given(prefix=st.lists(requests, max_size=3), bad=st.one_of(truncated, huge_header, st.binary(min_size=1, max_size=64)))
def test_good_frames_then_a_broken_one(daemon, fuzzing, prefix, bad):
    _throw(daemon, fuzzing, [*prefix, bad])


def test_daemon_served_throughout_and_memory_stayed_bounded(daemon, fuzzing):
    assert fuzzing["frames"] >= 2000, fuzzing
    background = fuzzing["background"]
    time.sleep(0.2)
    assert background.errors == []
    assert background.ok > 20
    with daemon.client() as client:
        info = client.status()
    assert info["state"] == "ready"
    grown = daemon.rss_mb() - fuzzing["rss_before"]
    assert grown < 64, f"daemon RSS grew {grown:.0f} MiB while fuzzed"
    # The fuzz connections' documents went away with them.
    assert info["documents"]["open"] <= 1
    # Every bad input was refused by validation, none reached a handler as an unexpected exception.
    log = daemon.stderr()
    assert "Traceback" not in log, log[max(0, log.find("Traceback") - 1500):log.find("Traceback") + 3000]
    print(f"fuzz: {fuzzing['frames']} frames in {fuzzing['batches']} connections; background client "
          f"{background.ok} answers, 0 errors; {fuzzing.get('seconds', 0):.1f} s waiting for the daemon; RSS {fuzzing['rss_before']:.0f} -> {daemon.rss_mb():.0f} MiB")
