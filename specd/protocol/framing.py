"""Bytes <-> whole msgpack objects, with memory bounded by the frame limit.

msgpack-rpc has no length prefix: messages are msgpack values written back to back. A reader
must find where each one ends without trusting what its headers declare, because a header
costs 5 bytes and may declare 4 GiB or 16 million elements. So decoding runs in two passes:

1. a *walker* reads only the headers, as the bytes arrive, to find where each message ends:
   it skips string payloads by their length, keeps a stack of how many items each open array
   or map still needs, and allocates nothing a header declares. It refuses a message as soon
   as what its headers declare no longer fits the limit, or when it nests too deeply, holds
   too many arrays and maps, or declares too many elements in them all. The bytes of the
   message in progress are kept here once, never more than ``max_frame_bytes`` of them,
   however the message is streamed (one 16 MiB string or 400 strings of 1 MiB);
2. only a complete message is decoded into objects, by ``unpackb``, under the same element
   limit.

What a message unpacks to is bounded by its bytes and by those counts, not by its bytes alone:
a ``nil`` is one byte on the wire but an 8-byte slot in a list, a two-letter string three bytes
but a ~60-byte object. So the elements of all its arrays and maps together (``MAX_ITEMS``) are
capped far below the frame limit, at what the largest real requests need: the objects a
message expands into stay within about its frame limit, and the walker's per-element work
(Python, one step an element) stays a fraction of a second a message.

The walker's work is proportional to the headers in the bytes just read (one read is at most
64 KiB), so a message of millions of tiny elements costs the loop a little per read, never a
stall.
"""

from __future__ import annotations

import struct
from typing import Any

import msgpack

from specd.protocol.errors import ErrorCode

READ_CHUNK = 64 * 1024
# A read is walked in slices of this many bytes, the event loop serving other connections
# between them: the walker visits every msgpack header in Python, so a dense read (a change of
# 400 ranged edits, ~5,600 headers in 25 kB) would hold the loop for milliseconds at once
# (docs/reliability.md, "Fair service between connections").
WALK_SLICE = 4 * 1024

# Arrays and maps one message may hold. A request's params need a few per edit; 65,536 is far
# above any real message (1,000 ranged edits use ~4,000) and bounds the objects one small
# message can expand into (each container costs ~60-100 bytes before its elements).
MAX_CONTAINERS = 65_536
# Elements of all the arrays and maps in one message, summed (a map's keys and values both
# count). A ranged edit costs 17 (4 maps of 2 pairs, and its slot in ``edits``), so this lets a
# change carry ~15,000 ranged edits (the container cap alone allows ~16,000) or ~37,000 offset
# edits. It bounds the pointers and small objects one message becomes: 262,144 elements of ~60
# bytes at most each, ~15 MiB, the size of the default frame limit.
MAX_ITEMS = 1 << 18
MAX_DEPTH = 1000  # nesting (msgpack itself stops at 1,024); real messages use fewer than 10

# What each first byte of a msgpack value is, as (kind, argument):
_SCALAR, _PAYLOAD, _ARRAY, _MAP, _SIZED_PAYLOAD, _SIZED_ARRAY, _SIZED_MAP, _INVALID = range(8)
_LENGTH_FORMAT = {1: ">B", 2: ">H", 4: ">I"}


def _header_table() -> list[tuple[int, int, int]]:
    """(kind, a, b) per first byte. _SCALAR: b more bytes follow. _PAYLOAD: a payload of a bytes.
    _ARRAY/_MAP: a items/pairs. _SIZED_*: a length of a bytes follows, then b extra header bytes
    (ext's type byte) before the payload."""
    table: list[tuple[int, int, int]] = [(_INVALID, 0, 0)] * 256
    for byte in range(0x00, 0x80):
        table[byte] = (_SCALAR, 0, 0)  # positive fixint
    for byte in range(0xE0, 0x100):
        table[byte] = (_SCALAR, 0, 0)  # negative fixint
    for byte in range(0x80, 0x90):
        table[byte] = (_MAP, byte & 0x0F, 0)
    for byte in range(0x90, 0xA0):
        table[byte] = (_ARRAY, byte & 0x0F, 0)
    for byte in range(0xA0, 0xC0):
        table[byte] = (_PAYLOAD, byte & 0x1F, 0)
    for byte in (0xC0, 0xC2, 0xC3):
        table[byte] = (_SCALAR, 0, 0)  # nil, false, true
    for byte, size in ((0xCA, 4), (0xCB, 8), (0xCC, 1), (0xCD, 2), (0xCE, 4), (0xCF, 8),
                       (0xD0, 1), (0xD1, 2), (0xD2, 4), (0xD3, 8)):
        table[byte] = (_SCALAR, 0, size)  # floats, ints
    for byte, size in ((0xD4, 1), (0xD5, 2), (0xD6, 4), (0xD7, 8), (0xD8, 16)):
        table[byte] = (_SCALAR, 0, 1 + size)  # fixext: type byte + data
    for byte, size in ((0xC4, 1), (0xC5, 2), (0xC6, 4), (0xD9, 1), (0xDA, 2), (0xDB, 4)):
        table[byte] = (_SIZED_PAYLOAD, size, 0)  # bin, str
    for byte, size in ((0xC7, 1), (0xC8, 2), (0xC9, 4)):
        table[byte] = (_SIZED_PAYLOAD, size, 1)  # ext: length, type byte, data
    table[0xDC], table[0xDD] = (_SIZED_ARRAY, 2, 0), (_SIZED_ARRAY, 4, 0)
    table[0xDE], table[0xDF] = (_SIZED_MAP, 2, 0), (_SIZED_MAP, 4, 0)
    return table


_HEADERS = _header_table()


class FrameError(Exception):
    """The byte stream cannot be decoded; the connection has to be closed after it."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


class FrameDecoder:
    """Feed bytes, get back the complete msgpack values they finish."""

    def __init__(self, max_frame_bytes: int, max_containers: int = MAX_CONTAINERS,
                 max_items: int = MAX_ITEMS):
        self.max_frame_bytes = max_frame_bytes
        self.ceiling = max_frame_bytes  # kept for callers that lower the limit and raise it back
        self.max_containers = max_containers
        self.max_items = max_items
        self._buffer = bytearray()  # the message in progress (after the last complete one)
        self._pos = 0  # where the walker reads the next header, in _buffer (may be past its end)
        self._open: list[int] = []  # items still needed by each open array/map, innermost last
        self._containers = 0  # in the message in progress
        self._items = 0  # elements its arrays and maps declare, in the message in progress
        self._ends: list[int] = []  # ends of messages whose headers are all read, in _buffer

    @property
    def pending_bytes(self) -> int:
        """Bytes received since the last complete message (0 between messages)."""
        return len(self._buffer)

    @property
    def payload_ahead(self) -> int:
        """Bytes still to come of a payload the walker has already stepped over: bytes that
        hold no header to walk."""
        return max(0, self._pos - len(self._buffer))

    def feed(self, data: bytes) -> list[Any]:
        """Return the values completed by ``data``; raise FrameError on undecodable input."""
        self._buffer += data
        self._walk()
        out = []
        start = 0
        # A message's last payload may be noted before its bytes have all arrived: decode only
        # the messages that are whole.
        whole_count = 0
        while whole_count < len(self._ends) and self._ends[whole_count] <= len(self._buffer):
            whole_count += 1
        if whole_count:
            with memoryview(self._buffer) as whole:
                for end in self._ends[:whole_count]:
                    out.append(self._decode(whole[start:end]))
                    start = end
            del self._ends[:whole_count]
            del self._buffer[:start]
            self._pos -= start
            self._ends = [end - start for end in self._ends]
        if len(self._buffer) > self.max_frame_bytes:
            raise self._too_large()
        return out

    def close(self) -> None:
        """Drop what is buffered (the connection is gone)."""
        self._buffer = bytearray()
        self._open = []
        self._ends = []

    def _too_large(self, detail: str = "") -> FrameError:
        return FrameError(ErrorCode.FRAME_TOO_LARGE.value,
                          f"message larger than the limit of {self.max_frame_bytes} bytes{detail}")

    def _walk(self) -> None:
        """Advance over the headers now in the buffer, noting where messages end."""
        buf, end = self._buffer, len(self._buffer)
        pos, open_, headers = self._pos, self._open, _HEADERS
        message_start = self._ends[-1] if self._ends else 0
        limit = self.max_frame_bytes
        try:
            while pos < end:
                kind, a, b = headers[buf[pos]]
                if kind == _SCALAR:
                    pos += 1 + b
                elif kind == _PAYLOAD:
                    pos += 1 + a
                elif kind == _SIZED_PAYLOAD:
                    if pos + 1 + a > end:
                        break  # the length is still on its way
                    (length,) = struct.unpack_from(_LENGTH_FORMAT[a], buf, pos + 1)
                    pos += 1 + a + b + length
                    if pos - message_start > limit:
                        raise self._too_large(f" (a header declares {length} bytes)")
                elif kind == _INVALID:
                    raise FrameError(ErrorCode.PARSE_ERROR.value, f"invalid msgpack: byte 0x{buf[pos]:02x} starts no value")
                else:  # an array or a map
                    if kind == _ARRAY or kind == _MAP:
                        count, size = a, 0
                    else:
                        size = a
                        if pos + 1 + size > end:
                            break
                        (count,) = struct.unpack_from(_LENGTH_FORMAT[size], buf, pos + 1)
                    if kind == _MAP or kind == _SIZED_MAP:
                        count *= 2
                    pos += 1 + size
                    self._containers += 1
                    if self._containers > self.max_containers:
                        raise self._too_large(f" (more than {self.max_containers} arrays and maps)")
                    if pos - message_start + count > limit:  # every item takes a byte at least
                        raise self._too_large(f" (a header declares {count} items)")
                    self._items += count
                    if self._items > self.max_items:
                        raise self._too_large(f" (more than {self.max_items} elements in its arrays and maps)")
                    if count:
                        if len(open_) >= MAX_DEPTH:
                            raise FrameError(ErrorCode.PARSE_ERROR.value, "invalid msgpack: nested too deeply")
                        open_.append(count)
                        continue
                # One item is complete: count it off the arrays and maps that hold it.
                while open_:
                    open_[-1] -= 1
                    if open_[-1]:
                        break
                    open_.pop()
                if not open_:  # a whole message
                    self._ends.append(pos)
                    message_start = pos
                    self._containers = 0
                    self._items = 0
        finally:
            self._pos = pos

    def _decode(self, message: memoryview) -> Any:
        try:
            # raw=False: msgpack str -> Python str (Neovim sends strings as str); invalid UTF-8
            # in a str is a decode error. strict_map_key=False: maps keyed by ints are allowed
            # through here and rejected by the message layer with a proper error instead. The
            # length limits repeat the walker's element cap, for the decoder's own allocations.
            return msgpack.unpackb(message, raw=False, strict_map_key=False,
                                   max_array_len=self.max_items, max_map_len=self.max_items // 2)
        except Exception as err:  # noqa: BLE001 - every decoder failure means the same thing
            raise FrameError(ErrorCode.PARSE_ERROR.value, f"invalid msgpack: {str(err) or type(err).__name__}") from None
