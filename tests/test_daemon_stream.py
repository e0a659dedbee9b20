"""A streamed ``complete`` (``"stream": true``) through the real daemon on the tiny pair: its
settled lines arrive as ``progress`` notifications before the result, each a prefix of the
result's text and longer than the last; only the asking connection gets them; nothing of a
cancelled stream comes after its answer; a plain msgpack client decodes them."""

from __future__ import annotations

import threading
import time

from daemon_helpers import raw_connect
from specd.engine.front.boundaries import NO_BOUNDARIES
from specd.protocol.methods import PROGRESS_NOTIFICATION
from test_strict_clients import StrictPeer, string_keyed

SOURCE = "import os\n\n\ndef join(a, b):\n    return os.path.join(a, b)\n\n\ndef split(p):\n    "
LONG = {"max_tokens": 96, **NO_BOUNDARIES}


def _streamed(client, text: str = SOURCE, **kw):
    seen: list[tuple[float, dict]] = []
    result = client.complete(text=text, cursor=len(text), options=LONG,
                             stream=lambda params: seen.append((time.monotonic(), params)), **kw)
    return result, seen, time.monotonic()


def test_settled_lines_arrive_before_the_result_each_a_prefix_of_it(daemon):
    with daemon.client() as client:
        for number in range(4):  # several prompts: the tiny model writes several lines of junk
            text = SOURCE + "x" * number
            result, seen, answered = _streamed(client, text)
            assert "\n" in result["text"], result
            texts = [params["text"] for _, params in seen]
            assert texts, "no progress before the result"
            assert all(result["text"].startswith(t) for t in texts), (texts, result["text"])
            assert all(len(a) < len(b) for a, b in zip(texts, texts[1:])), texts
            # the tail is the settled text's left-out line break and the line being written
            assert all(p["tail"].startswith("\n") and "\n" not in p["tail"][1:] for _, p in seen), seen
            assert {params["msgid"] for _, params in seen} == {seen[0][1]["msgid"]}
            assert all(at <= answered for at, _ in seen)
            assert all(params["tokens"] <= len(result["token_ids"]) for _, params in seen)


def test_a_plain_complete_gets_no_progress_and_others_see_none(daemon):
    with daemon.client() as streaming, daemon.client() as plain:
        done = threading.Event()

        def other() -> None:
            plain.complete(text=SOURCE, cursor=len(SOURCE), options=LONG)
            done.set()

        thread = threading.Thread(target=other)
        thread.start()
        result, seen, _ = _streamed(streaming)
        thread.join(60)
        assert done.is_set() and seen and result
        got = [note for note in plain.notifications if note.method == PROGRESS_NOTIFICATION]
        assert got == []


def test_nothing_of_a_cancelled_stream_comes_after_its_answer(daemon):
    with daemon.client() as client:
        seen: list[dict] = []
        params = {"text": SOURCE, "cursor": len(SOURCE), "stream": True,
                  "options": {**LONG, "max_tokens": 2000, "time_budget_ms": 60000}}
        msgid, future = client.send_request("complete", params, on_progress=seen.append)
        deadline = time.monotonic() + 30
        while not seen and time.monotonic() < deadline:
            time.sleep(0.01)
        client.cancel(msgid=msgid)
        try:
            future.result(30)
        except Exception as err:  # the cancelled complete's answer
            assert getattr(err, "code", "") == "cancelled"
        after = len(seen)
        time.sleep(0.5)
        assert len(seen) == after


def test_progress_decodes_with_msgpack_defaults(daemon):
    sock = raw_connect(daemon.socket_path)
    try:
        peer = StrictPeer(sock)
        answer = peer.call("complete", {"text": SOURCE, "cursor": len(SOURCE), "stream": True, "options": LONG})
        assert answer[2] is None, answer
        progress = [message for message in peer.notifications if message[1] == PROGRESS_NOTIFICATION]
        assert progress and all(string_keyed(message) == [] for message in progress)
        assert answer[3]["text"].startswith(progress[-1][2][0]["text"])
    finally:
        sock.close()


def test_stream_must_be_a_boolean(daemon):
    with daemon.client() as client:
        try:
            client.request("complete", {"text": SOURCE, "cursor": 3, "stream": "yes"})
        except Exception as err:
            assert getattr(err, "code", "") == "invalid_params" and "stream" in str(err)
        else:
            raise AssertionError("stream='yes' was accepted")
