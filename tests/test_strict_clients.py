"""Every answer the daemon sends decodes with a plain client's defaults.

A user's few lines of client code use ``msgpack.Unpacker()`` as it comes: since msgpack 1.0 it
refuses maps keyed by anything but str or bytes (``strict_map_key=True``). So every map the
daemon sends (results, errors, notifications) is keyed by strings, and JSON output is too.
"""

from __future__ import annotations

import socket
import time
from typing import Any

import msgpack

from daemon_helpers import raw_connect
from specd.protocol import pack

SOURCE = "import os\n\n\ndef join(a, b):\n    return os.path.join(a, b)\n\n\ndef split(p):\n    return "


def string_keyed(value: Any, path: str = "") -> list[str]:
    """Paths of the maps in ``value`` that have a key other than a str."""
    bad = []
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                bad.append(f"{path}[{key!r}]")
            bad += string_keyed(item, f"{path}.{key}")
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            bad += string_keyed(item, f"{path}[{index}]")
    return bad


class StrictPeer:
    """A raw socket read with ``msgpack.Unpacker()``'s defaults, as a user's script would."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.unpacker = msgpack.Unpacker()  # defaults: strict_map_key=True, raw=False
        self.msgid = 0
        self.notifications: list[Any] = []

    def call(self, method: str, params: Any = None, timeout: float = 120.0) -> list:
        self.msgid += 1
        self.sock.sendall(pack([0, self.msgid, method, [params] if params is not None else []]))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for message in self.unpacker:  # raises ValueError on an int-keyed map
                if message[0] == 2:
                    self.notifications.append(message)
                elif message[1] == self.msgid:
                    return message
            self.sock.settimeout(max(0.1, deadline - time.monotonic()))
            data = self.sock.recv(65536)
            assert data, "the daemon closed the connection"
            self.unpacker.feed(data)
        raise AssertionError(f"no answer to {method}")


def test_every_answer_decodes_with_a_default_unpacker(daemon):
    uri = "file:///strict/paths.py"
    with raw_connect(daemon.socket_path, timeout=120) as sock:
        peer = StrictPeer(sock)
        answers = {
            "hello": peer.call("hello", {"client": "strict"}),
            "open": peer.call("open", {"uri": uri, "text": SOURCE, "version": 1}),
            "change": peer.call("change", {"uri": uri, "version": 2, "edits": [
                {"range": {"start": {"line": 8, "character": 11}, "end": {"line": 8, "character": 11}}, "text": "o"}]}),
            "workspace": peer.call("workspace", {"folders": ["/strict"]}),
        }
        # Several completions, so the planner has timed verify widths for status to report.
        for n in range(4):
            answers[f"complete {n}"] = peer.call("complete", {
                "uri": uri, "cursor": {"line": 8, "character": 12},
                "options": {"max_tokens": 8, "use_draft_model": True, "use_lookup": True}})
        answers["stateless complete"] = peer.call("complete", {"text": SOURCE, "cursor": len(SOURCE),
                                                               "options": {"max_tokens": 4}})
        answers["status"] = peer.call("status")
        answers["cancel"] = peer.call("cancel", {"uri": uri})
        answers["an error"] = peer.call("no_such_method", {})
        answers["bad params"] = peer.call("complete", {"uri": uri, "cursor": {"line": 99, "character": 0}})
        answers["close"] = peer.call("close", {"uri": uri})
    for name, answer in answers.items():
        assert string_keyed(answer) == [], (name, answer)
    assert answers["an error"][2] is not None and answers["bad params"][2] is not None
    assert answers["status"][3]["state"] == "ready"
    planner = answers["status"][3].get("engine", {}).get("planner", {})
    assert planner.get("target_ms_by_width"), answers["status"][3]  # the map that had int keys
    assert planner["acceptance"] and all(a["then_by_depth"] for a in planner["acceptance"].values()), planner
    assert string_keyed(peer.notifications) == []
