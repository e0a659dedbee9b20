"""What a message unpacks to is bounded, not only its bytes.

A frame of 16 MiB can hold 16 million one-byte ``nil``s, which unpack into a list of 16 million
8-byte slots, and the walker that finds a message's end takes a Python step for each. The
decoder caps the elements of all the arrays and maps in one message (``MAX_ITEMS``) and refuses
a message as soon as its headers declare more, like a message over the byte limit: the
daemon answers ``frame_too_large`` and closes the connection, without unpacking anything.
"""

from __future__ import annotations

import socket
import struct
import threading
import time

import msgpack
import pytest

from daemon_helpers import DaemonProcess, raw_connect
from specd.protocol import pack
from specd.protocol.framing import MAX_ITEMS, FrameDecoder, FrameError

MiB = 1 << 20
FRAME_LIMIT = 16 * MiB
STATUS_PREFIX = b"\x94\x00\x01\xa6status\x91"  # [0, 1, "status", [<params>]]


def _array32(count: int) -> bytes:
    return b"\xdd" + struct.pack(">I", count)


def _map32(pairs: int) -> bytes:
    return b"\xdf" + struct.pack(">I", pairs)


def flat_nils(size: int = FRAME_LIMIT) -> bytes:
    """The params map {"junk": [nil, nil, ...]} filling the frame."""
    n = size - 64
    return STATUS_PREFIX + b"\x81\xa4junk" + _array32(n) + b"\xc0" * n


def map_of_arrays(size: int = FRAME_LIMIT, arrays: int = 2048) -> bytes:
    """A map of many arrays, each under the cap, together far over it."""
    each = (size - 64) // arrays - 8
    return STATUS_PREFIX + _map32(arrays) + b"".join(
        b"\xcd" + struct.pack(">H", key) + _array32(each) + b"\xc0" * each for key in range(arrays))


def array_of_maps(size: int = FRAME_LIMIT) -> bytes:
    """[{0: nil}, {0: nil}, ...]: three bytes a map."""
    count = (size - 64) // 3
    return STATUS_PREFIX + b"\x81\xa4junk" + _array32(count) + b"\x81\x00\xc0" * count


def deep_then_nils(size: int = FRAME_LIMIT, depth: int = 900) -> bytes:
    """An array of nils at the bottom of 900 nested one-element arrays."""
    n = size - depth - 64
    return STATUS_PREFIX + b"\x91" * depth + _array32(n) + b"\xc0" * n


def deep_maps_of_arrays(depth: int = 500) -> bytes:
    """500 nested {"k": [nil x 999, {"k": [...]}]}: each container under the cap, the elements
    of all of them over it."""
    layer = b"\x81\xa1k\xdc" + struct.pack(">H", 1000) + b"\xc0" * 999
    return STATUS_PREFIX + layer * depth + b"\xc0"


HOSTILE = {
    "flat_nils": flat_nils,
    "map_of_arrays": map_of_arrays,
    "array_of_maps": array_of_maps,
    "deep_then_nils": deep_then_nils,
}


# -- the decoder -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_a_message_declaring_too_many_elements_is_refused_before_its_bytes_arrive(name):
    frame = HOSTILE[name]()
    decoder = FrameDecoder(FRAME_LIMIT)
    with pytest.raises(FrameError) as info:
        for at in range(0, len(frame), 64 * 1024):
            decoder.feed(frame[at:at + 64 * 1024])
    assert info.value.code == "frame_too_large"
    assert "elements" in info.value.message or "arrays and maps" in info.value.message
    # Refused once the headers read declare more than the cap, long before 16 MiB were buffered.
    assert at < 2 * MiB, f"refused only after {at} bytes"


def test_the_cap_counts_elements_across_containers_and_nesting():
    half = MAX_ITEMS // 2
    two_halves = pack([0, 1, "status", [{"a": [None] * half, "b": [None] * half}]])
    with pytest.raises(FrameError) as info:
        FrameDecoder(FRAME_LIMIT).feed(two_halves)
    assert info.value.code == "frame_too_large" and "elements" in info.value.message
    nested = [None] * (MAX_ITEMS // 4)
    with pytest.raises(FrameError):
        FrameDecoder(FRAME_LIMIT).feed(pack([0, 1, "status", [{"x": [nested, [nested, [nested, [nested]]]]}]]))
    # The cap is per message: the next message on the connection starts from zero.
    under = pack([0, 1, "status", [{"a": [None] * (MAX_ITEMS - 100)}]])
    decoder = FrameDecoder(FRAME_LIMIT)
    assert len(decoder.feed(under + under)) == 2
    with pytest.raises(FrameError):
        FrameDecoder(FRAME_LIMIT).feed(deep_maps_of_arrays())


def test_the_largest_real_requests_stay_under_the_caps():
    edit = {"range": {"start": {"line": 1, "character": 2}, "end": {"line": 1, "character": 3}}, "text": "x"}
    messages = [
        [0, 1, "change", [{"uri": "file:///a.py", "edits": [edit] * 15_000, "encoding": "utf-16"}]],
        [0, 2, "change", [{"uri": "file:///a.py", "edits": [{"start": n, "end": n + 1, "text": "z"} for n in range(30_000)]}]],
        [0, 3, "workspace", [{"folders": [f"/home/user/project{n}" for n in range(50_000)]}]],
        [0, 4, "complete", [{"text": "x" * MiB, "cursor": {"line": 0, "character": 3},
                             "extra_context": [{"path": f"/p/{n}.py", "text": "y" * 100} for n in range(10_000)],
                             "options": {"max_tokens": 64, "temperature": 0.2, "top_p": 0.9, "seed": 7}}]],
    ]
    for message in messages:
        assert FrameDecoder(FRAME_LIMIT).feed(pack(message)) == [message]


def test_what_a_message_under_the_cap_unpacks_to_stays_within_its_frame_limit():
    import tracemalloc

    count = MAX_ITEMS - 100
    shapes = {
        "nils": b"\xc0" * count,
        "two-letter strings": b"\xa2ab" * count,
        "16-bit ints": b"\xcd\x12\x34" * count,
    }
    for name, body in shapes.items():
        frame = STATUS_PREFIX + _array32(count) + body
        decoder = FrameDecoder(FRAME_LIMIT)
        tracemalloc.start()
        try:
            (message,) = decoder.feed(frame)
            held, _ = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert len(message[3][0]) == count
        assert held < FRAME_LIMIT, f"{name}: {held / MiB:.1f} MiB from a {len(frame) / MiB:.1f} MiB message"
        del message


# -- the daemon --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = DaemonProcess(tmp_path_factory.mktemp("amplification"), config={"log.level": "warning"})
    d.start()
    yield d
    d.stop()


def _first_reply(sock: socket.socket, timeout: float) -> list:
    """The first message the daemon sends back (the reset after its close keeps what came)."""
    sock.settimeout(timeout)
    unpacker = msgpack.Unpacker(raw=False)
    while True:
        try:
            data = sock.recv(65536)
        except ConnectionResetError:
            data = b""
        if not data:
            raise AssertionError("the daemon closed without a reply")
        unpacker.feed(data)
        for message in unpacker:
            return message


class PoliteClient:
    """Asks `status` in a loop on its own connection; records the slowest answer."""

    def __init__(self, daemon: DaemonProcess):
        self.daemon = daemon
        self.worst_s = 0.0
        self.answers = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        with self.daemon.client() as client:
            while not self.stop.is_set():
                started = time.monotonic()
                assert client.status(timeout=10)["state"] == "ready"
                self.worst_s = max(self.worst_s, time.monotonic() - started)
                self.answers += 1

    def __enter__(self) -> PoliteClient:
        self.thread.start()
        deadline = time.monotonic() + 10
        while self.answers < 3 and time.monotonic() < deadline:  # connected and warm
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(20)


def _send(sock: socket.socket, frame: bytes) -> None:
    try:
        sock.sendall(frame)
    except OSError:
        pass  # the daemon refused the message and closed: expected


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_the_daemon_refuses_an_amplification_frame_at_once_and_serves_others(daemon, name):
    frame = HOSTILE[name]()
    with daemon.client() as c:
        c.status()
    before = daemon.rss_mb()
    peak = before
    with PoliteClient(daemon) as polite:
        with raw_connect(daemon.socket_path, timeout=30) as sock:
            sender = threading.Thread(target=_send, args=(sock, frame))
            started = time.monotonic()
            sender.start()
            reply = _first_reply(sock, timeout=30)
            answered_s = time.monotonic() - started
            while sender.is_alive():
                peak = max(peak, daemon.rss_mb())
                sender.join(0.01)
        peak = max(peak, daemon.rss_mb())
    assert reply[0] == 2 and reply[2][0]["code"] == "frame_too_large", reply
    assert answered_s < 1.0, f"answered after {answered_s:.2f} s"
    assert peak - before < 2 * len(frame) / MiB, f"RSS {before:.0f} -> {peak:.0f} MiB"
    assert polite.worst_s < 0.25, f"a polite status waited {polite.worst_s * 1000:.0f} ms"
    assert daemon.proc.poll() is None


def test_four_connections_of_amplification_frames_at_once(daemon):
    frame = flat_nils()
    before = daemon.rss_mb()
    with PoliteClient(daemon) as polite:
        socks = [raw_connect(daemon.socket_path, timeout=30) for _ in range(4)]
        try:
            senders = [threading.Thread(target=_send, args=(sock, frame)) for sock in socks]
            for sender in senders:
                sender.start()
            replies = [_first_reply(sock, timeout=30) for sock in socks]
            peak = daemon.rss_mb()
            for sender in senders:
                sender.join(30)
        finally:
            for sock in socks:
                sock.close()
    assert all(reply[2][0]["code"] == "frame_too_large" for reply in replies), replies
    assert peak - before < 2 * len(frame) / MiB, f"RSS {before:.0f} -> {peak:.0f} MiB"
    assert polite.worst_s < 0.25, f"a polite status waited {polite.worst_s * 1000:.0f} ms"


def test_a_message_just_under_the_cap_is_answered(daemon):
    with raw_connect(daemon.socket_path, timeout=30) as sock:
        sock.sendall(pack([0, 9, "status", [{"junk": [None] * (MAX_ITEMS - 100)}]]))
        reply = _first_reply(sock, timeout=30)
    assert reply[0] == 1 and reply[1] == 9 and reply[2] is None and reply[3]["state"] == "ready"
