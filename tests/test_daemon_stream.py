"""A streamed ``complete`` (``"stream": true``) through the real daemon on the tiny pair: its
settled lines and the line being written arrive as ``progress`` notifications before the
result, each a prefix of the result's text; only the asking connection gets them; nothing of a
cancelled stream comes after its answer; a plain msgpack client decodes them. The notes' pace
(a settled change at once, a grown tail at most one per ``TAIL_NOTE_INTERVAL_S``) is checked
on the daemon's ``_Stream`` with a clock of the test's own."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import pytest

from daemon_helpers import raw_connect
from specd.daemon.handlers import completion as completion_handler
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
            assert all(result["text"].startswith(p["text"] + p["tail"]) for _, p in seen), (seen, result["text"])
            assert all(b.startswith(a) for a, b in zip(texts, texts[1:])), texts
            # a note with the settled text of the one before it brings a longer line being written
            assert all(len(a["tail"]) < len(b["tail"]) for (_, a), (_, b) in zip(seen, seen[1:])
                       if a["text"] == b["text"]), seen
            # the tail is the settled text's left-out line break and the line being written
            assert all("\n" not in p["tail"][1:] and (p["tail"].startswith("\n") or not p["text"])
                       for _, p in seen), seen
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


class _Notes:
    """A session that keeps the notifications a ``_Stream`` writes."""

    def __init__(self) -> None:
        self.sent: list[dict] = []

    def notify_nowait(self, method: str, params: dict) -> None:
        self.sent.append(params)


@pytest.mark.asyncio
async def test_a_growing_line_is_sent_at_most_once_an_interval_and_a_settled_line_at_once(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr(completion_handler.time, "monotonic", lambda: clock[0])
    notes = _Notes()
    stream = completion_handler._Stream(SimpleNamespace(session=notes), 7)
    interval = completion_handler.TAIL_NOTE_INTERVAL_S

    async def step(text: str, after_s: float) -> None:
        clock[0] += after_s
        stream(SimpleNamespace(text=lambda: text, tokens=len(text)))
        await asyncio.sleep(0)  # the loop writes what the worker handed it

    await step("ret", 0.001)  # the line being written: sent, nothing was before
    await step("return", interval / 3)  # grown again too soon: held
    await step("return x", interval / 3)
    await step("return x +", interval / 2)  # an interval since the last note: sent
    await step("return x + y\n", interval / 10)  # a settled line: at once, however soon
    await step("return x + y\n    ", interval / 10)  # the next line's indentation: too soon
    await step("return x + y\n    ", interval * 2)  # a step later: an interval since the last note
    await step("return x + y\n    ", interval * 2)  # nothing new: nothing sent
    await step("return x + y\n    z", interval / 10)  # new: the last note is an interval old
    await step("return x + y\n    z =", interval / 10)  # too soon again
    assert notes.sent == [
        {"msgid": 7, "text": "", "tail": "ret", "tokens": 3},
        {"msgid": 7, "text": "", "tail": "return x +", "tokens": 10},
        {"msgid": 7, "text": "return x + y", "tail": "\n", "tokens": 13},
        {"msgid": 7, "text": "return x + y", "tail": "\n    ", "tokens": 17},
        {"msgid": 7, "text": "return x + y", "tail": "\n    z", "tokens": 18},
    ]
