"""The wire format and the buffer logic, in process: framing, message typing, the asyncio
session (every handler failure answered with the request's msgid), cursor conversion, edits."""

from __future__ import annotations

import asyncio
import socket

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from daemon_helpers import apply_edits, resolve_cursor
from specd.daemon.buffers import BufferStore, TextIndex
from specd.daemon.params import parse_edits
from specd.protocol import (
    ErrorCode,
    FrameDecoder,
    FrameError,
    Notification,
    Request,
    Response,
    RpcError,
    pack,
    parse_message,
)
from specd.protocol.messages import InvalidMessage
from specd.protocol.session import Session

# -- framing --------------------------------------------------------------------------------------


def test_messages_split_at_every_byte_boundary():
    messages = [[0, 1, "hello", [{"client": "x"}]], [2, "cancel", [{"uri": "é😀"}]], [1, 5, None, {"ok": True}]]
    stream = b"".join(pack(m) for m in messages)
    for cut in range(len(stream) + 1):
        decoder = FrameDecoder(1024)
        assert decoder.feed(stream[:cut]) + decoder.feed(stream[cut:]) == messages


def test_many_small_messages_in_one_read_do_not_trip_the_limit():
    messages = [[0, n, "status", []] for n in range(1000)]
    decoder = FrameDecoder(256)
    assert decoder.feed(b"".join(pack(m) for m in messages)) == messages


def test_frame_limits():
    with pytest.raises(FrameError) as info:
        FrameDecoder(1024).feed(pack([0, 1, "open", [{"text": "x" * 2000}]]))
    assert info.value.code == "frame_too_large"
    # A header declaring 2**31 elements is refused at once, nothing allocated.
    with pytest.raises(FrameError) as info:
        FrameDecoder(1024).feed(b"\xdd\x7f\xff\xff\xff")
    assert info.value.code == "frame_too_large"
    # A str32 header declaring 4 GiB: refused as soon as the header arrives.
    with pytest.raises(FrameError) as info:
        FrameDecoder(1024).feed(b"\xdb\xff\xff\xff\xff")
    assert info.value.code == "frame_too_large"
    # Inside a message too: a nested header is checked against what is left of the limit.
    with pytest.raises(FrameError) as info:
        FrameDecoder(1024).feed(b"\x92\xa1a\xdb\x00\x00\x04\x00")
    assert info.value.code == "frame_too_large"
    # And bytes streamed without any header declaring them are refused past the limit.
    decoder = FrameDecoder(1024)
    assert decoder.feed(b"\xdc\x01\x00") == []
    with pytest.raises(FrameError) as info:
        for _ in range(40):
            decoder.feed(b"\xd9\x28" + b"a" * 40)
    assert info.value.code == "frame_too_large"


@pytest.mark.parametrize("data", [b"\xc1", b"\xa3\xff\xfe\xfd", b"\x91" * 5000])
def test_undecodable_bytes_are_parse_errors(data):
    with pytest.raises(FrameError) as info:
        FrameDecoder(1 << 20).feed(data)
    assert info.value.code == "parse_error"


# -- messages -------------------------------------------------------------------------------------


def test_parse_the_three_message_types():
    assert parse_message([0, 3, "complete", [{"uri": "u"}]]) == Request(3, "complete", {"uri": "u"})
    assert parse_message([0, 3, "status", []]) == Request(3, "status", {})
    assert parse_message([0, 3, "status", {"a": 1}]) == Request(3, "status", {"a": 1})
    assert parse_message([1, 3, None, 42]) == Response(3, None, 42)
    assert parse_message([2, "cancel", [{"uri": "u"}]]) == Notification("cancel", {"uri": "u"})
    request = Request(9, "hello", {"client": "x"})
    assert parse_message(msgpack.unpackb(pack(request.to_wire()), raw=False)) == request


@pytest.mark.parametrize("obj, msgid, code", [
    (5, None, "invalid_request"),
    ([], None, "invalid_request"),
    ([3, 1, "x", []], None, "invalid_request"),
    ([True, 1, "x", []], None, "invalid_request"),
    ([0.0, 1, "x", []], None, "invalid_request"),  # msgpack-rpc types are integers
    ([2.0, "cancel", []], None, "invalid_request"),
    (["0", 1, "x", []], None, "invalid_request"),
    ([0, -1, "x", []], None, "invalid_request"),
    ([0, 2**32, "x", []], None, "invalid_request"),
    ([0, True, "x", []], None, "invalid_request"),
    ([0, 4, "x"], 4, "invalid_request"),
    ([0, 4, 17, []], 4, "invalid_request"),
    ([0, 4, "", []], 4, "invalid_request"),
    ([0, 4, "x", "params"], 4, "invalid_params"),
    ([0, 4, "x", [1, 2]], 4, "invalid_params"),
    ([0, 4, "x", [{1: 2}]], 4, "invalid_params"),
    ([2, "x"], None, "invalid_request"),
    ([1, "x", None, None], None, "invalid_request"),
])
def test_invalid_messages_keep_the_msgid_when_readable(obj, msgid, code):
    with pytest.raises(InvalidMessage) as info:
        parse_message(obj)
    assert info.value.msgid == msgid and info.value.code == code


def test_rpc_error_wire_forms():
    err = RpcError(ErrorCode.OUT_OF_RANGE, "line 9 outside", {"lines": 3})
    assert err.to_wire() == {"code": "out_of_range", "message": "line 9 outside", "data": {"lines": 3}}
    back = RpcError.from_wire(err.to_wire())
    assert (back.code, back.message, back.data) == ("out_of_range", "line 9 outside", {"lines": 3})
    assert RpcError.from_wire([0, "Neovim style"]).message == "Neovim style"
    assert RpcError.from_wire("odd").code == "internal_error"


# -- session --------------------------------------------------------------------------------------


async def _session_pair(handler):
    left, right = socket.socketpair()
    server_streams = await asyncio.open_connection(sock=left)
    client_streams = await asyncio.open_connection(sock=right)
    server = Session(*server_streams, max_frame_bytes=1 << 20, handler=handler, name="server")
    client = Session(*client_streams, max_frame_bytes=1 << 20, name="client")
    tasks = [asyncio.create_task(server.run()), asyncio.create_task(client.run())]
    return server, client, tasks


def test_session_answers_every_request_with_its_own_msgid():
    async def handler(request: Request):
        if request.method == "boom":
            raise ValueError("kaput")
        if request.method == "refuse":
            raise RpcError(ErrorCode.INVALID_PARAMS, "no thanks")
        if request.method == "slow":
            await asyncio.sleep(0.2)
        if request.method == "unencodable":
            return object()
        return {"echo": request.params, "method": request.method}

    async def main():
        server, client, tasks = await _session_pair(handler)
        slow = asyncio.create_task(client.request("slow", {"n": 1}))
        fast = await client.request("fast", {"n": 2})
        assert fast == {"echo": {"n": 2}, "method": "fast"}  # answered before the slow one
        assert not slow.done()
        assert (await slow)["echo"] == {"n": 1}
        for method, code in (("boom", "internal_error"), ("refuse", "invalid_params"),
                             ("unencodable", "internal_error")):
            with pytest.raises(RpcError) as info:
                await client.request(method, {})
            assert info.value.code == code, method
        assert "kaput" in str(await _error(client, "boom"))
        with pytest.raises(RpcError) as info:
            await client.request("slow", {}, timeout=0.01)
        assert info.value.code == "timeout"
        await client.close()
        await asyncio.wait(tasks, timeout=5)
        assert server.closed

    asyncio.run(main())


async def _error(client: Session, method: str) -> RpcError:
    try:
        await client.request(method, {})
    except RpcError as err:
        return err
    raise AssertionError("no error")


def test_session_invalid_message_gets_an_error_with_the_msgid_then_serves_on():
    async def main():
        left, right = socket.socketpair()
        server = Session(*await asyncio.open_connection(sock=left), max_frame_bytes=1 << 20,
                         handler=lambda r: asyncio.sleep(0, result="ok"))
        task = asyncio.create_task(server.run())
        reader, writer = await asyncio.open_connection(sock=right)
        writer.write(pack([0, 11, 99, []]) + pack("junk") + pack([0, 12, "ok", []]))
        unpacker = msgpack.Unpacker(raw=False)
        replies = []
        while len(replies) < 3:
            unpacker.feed(await reader.read(4096))
            replies.extend(unpacker)
        assert [1, 11] == replies[0][:2] and replies[0][2]["code"] == "invalid_request"
        assert replies[1][:2] == [2, "specd/error"] and replies[1][2][0]["code"] == "invalid_request"
        assert replies[2] == [1, 12, None, "ok"]
        writer.write(b"\xc1")  # undecodable: an error notification, then the session closes
        unpacker.feed(await reader.read(4096))
        assert next(unpacker)[2][0]["code"] == "parse_error"
        writer.close()
        await asyncio.wait_for(task, 5)

    asyncio.run(main())


# -- cursor conversion ----------------------------------------------------------------------------


def test_positions_in_every_encoding():
    text = "aé😀b\r\nsecond\rthird\nlast"
    index = TextIndex(text)
    assert index.line_starts == [0, 6, 13, 19]
    assert index.line_text(0) == "aé😀b"
    # "b" is code point 3, UTF-16 unit 4, UTF-8 byte 7 on line 0.
    assert index.offset(0, 3) == index.offset(0, 4, "utf-16") == index.offset(0, 7, "utf-8") == 3
    assert index.offset(0, 3, "utf-16") == 2  # inside the surrogate pair: rounds down
    assert index.offset(0, 5, "utf-8") == 2  # inside the emoji's bytes: rounds down
    assert index.offset(0, 99) == 4  # past the end of the line: its end
    assert index.offset(3, 2) == 21
    with pytest.raises(RpcError) as info:
        index.offset(4, 0)
    assert info.value.code == "out_of_range"
    assert index.byte_offset_to_char(len("aé😀".encode())) == 3
    assert index.position(21) == (3, 2)


def test_resolve_cursor_forms_and_errors():
    index = TextIndex("ab\ncd")
    for cursor in (4, {"offset": 4}, {"byte_offset": 4}, {"line": 1, "character": 1}, {"line": 1, "col": 1}):
        assert resolve_cursor(index, cursor) == 4
    for bad in ("4", True, {"line": 1}, {}, {"offset": "1"}, {"line": 0, "character": 0, "encoding": "utf-7"}):
        with pytest.raises(RpcError) as info:
            resolve_cursor(index, bad)
        assert info.value.code == "invalid_params", bad
    for bad in (-1, 6, {"byte_offset": 99}, {"line": -1, "character": 0}, {"line": 0, "character": -1}):
        with pytest.raises(RpcError) as info:
            resolve_cursor(index, bad)
        assert info.value.code == "out_of_range", bad


# -- edits and the store --------------------------------------------------------------------------


def test_edits_apply_in_order_like_lsp_content_changes():
    text = "hello\nworld\n"
    edits = [
        {"range": {"start": {"line": 0, "character": 0}, "end": {"line": 0, "character": 5}}, "text": "HELLO"},
        {"range": {"start": {"line": 1, "character": 5}, "end": {"line": 1, "character": 5}}, "text": "!\nnew"},
        {"start": 0, "end": 1, "text": "J"},
        {"range": {"start": {"line": 2, "character": 0}, "end": {"line": 2, "character": 3}}, "text": "NEW"},
    ]
    assert apply_edits(text, edits, "utf-32") == "JELLO\nworld!\nNEW\n"
    assert apply_edits(text, [{"text": "all new"}], "utf-32") == "all new"


def _lsp_position(text: str, offset: int) -> dict[str, int]:
    line, character = TextIndex(text).position(offset)
    return {"line": line, "character": len(TextIndex(text).line_text(line)[:character].encode("utf-16-le")) // 2}


@settings(max_examples=150, deadline=None)
@given(st.text(alphabet="ab\n\r😀é ", max_size=30), st.data())
def test_ranged_edits_match_splicing(text, data):
    """An edit by UTF-16 range does what slicing the string by code points does."""
    start = data.draw(st.integers(0, len(text)))
    end = data.draw(st.integers(start, len(text)))
    # Positions between "\r" and "\n" of one line break do not exist in LSP terms; skip those.
    if any(0 < p < len(text) and text[p - 1] == "\r" and text[p] == "\n" for p in (start, end)):
        return
    insert = data.draw(st.text(alphabet="xy😀\n", max_size=5))
    edit = {"range": {"start": _lsp_position(text, start), "end": _lsp_position(text, end)}, "text": insert}
    assert apply_edits(text, [edit], "utf-16") == text[:start] + insert + text[end:]


def test_store_limits_versions_owners():
    store = BufferStore(max_documents=2, max_document_bytes=10)
    store.open("a", "12345", 1, owner=1)
    store.open("a", "123", 1, owner=2)  # reopen: replaces the text, adds an owner
    store.open("b", "", 0, owner=1)
    with pytest.raises(RpcError) as info:
        store.open("c", "", 0, owner=1)
    assert info.value.code == "too_many_documents"
    with pytest.raises(RpcError) as info:
        store.open("c", "é" * 6, 0, owner=1)  # 12 bytes of UTF-8, 6 characters
    assert info.value.code == "document_too_large"
    with pytest.raises(RpcError) as info:
        store.change("a", 1, None, "x")
    assert info.value.code == "stale_version"
    assert store.change("a", None, parse_edits([{"start": 3, "end": 3, "text": "4"}], "utf-32"), None).version == 2
    with pytest.raises(RpcError):
        store.change("a", 3, parse_edits([{"start": 0, "end": 0, "text": "x" * 20}], "utf-32"), None)
    assert store.get("a").text == "1234" and store.get("a").version == 2  # unchanged by the failure
    assert store.release_owner(1) == ["b"]  # "a" is still held by owner 2
    assert store.close("a", owner=2) is True and len(store) == 0
