"""Bytes <-> whole msgpack objects, with memory bounded by the frame limit.

msgpack-rpc has no length prefix: messages are msgpack values written back to back. A reader
must find where each one ends without trusting what its headers declare, because a header
costs 5 bytes and may declare 4 GiB or 16 million elements. So decoding runs in two passes:

1. a *scanner* (msgpack's ``skip``, which builds no objects and allocates nothing a header
   declares) finds the end of each complete message, while the bytes of the message in
   progress are kept here, never more than ``max_frame_bytes`` of them: that is the limit on
   one message, however it is streamed (one 16 MiB string or 400 strings of 1 MiB);
2. only a complete message is decoded into objects, by ``unpackb``, whose per-container limits
   default to the message's own length (a container cannot hold more elements than it has
   bytes), with a cap on the number of containers so a small message cannot become millions
   of Python lists.

A header that by itself declares more than the limit (a str32 of 4 GiB, an array32 of 2**31
elements) at the start of a message is refused as soon as it arrives.
"""

from __future__ import annotations

import struct
from typing import Any

import msgpack

from specd.protocol.errors import ErrorCode

READ_CHUNK = 64 * 1024

# Arrays and maps one message may hold. A request's params need a few per edit; 65,536 is far
# above any real message (1,000 ranged edits use ~4,000) and bounds the objects one small
# message can expand into (each container costs ~60-100 bytes before its elements).
MAX_CONTAINERS = 65_536

# First byte -> (struct format of the length that follows, kind). Only the 16/32-bit forms can
# declare more than a few bytes; the fix-forms are bounded by their encoding.
_LENGTH_HEADERS: dict[int, tuple[str, str]] = {
    0xC4: (">B", "bytes"), 0xC5: (">H", "bytes"), 0xC6: (">I", "bytes"),  # bin 8/16/32
    0xD9: (">B", "bytes"), 0xDA: (">H", "bytes"), 0xDB: (">I", "bytes"),  # str 8/16/32
    0xC7: (">B", "bytes"), 0xC8: (">H", "bytes"), 0xC9: (">I", "bytes"),  # ext 8/16/32
    0xDC: (">H", "items"), 0xDD: (">I", "items"),  # array 16/32
    0xDE: (">H", "pairs"), 0xDF: (">I", "pairs"),  # map 16/32
}


class FrameError(Exception):
    """The byte stream cannot be decoded; the connection has to be closed after it."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


class _ContainerBudget:
    """Counts the arrays and maps ``unpackb`` builds; raises once there are too many."""

    __slots__ = ("left",)

    def __init__(self, limit: int):
        self.left = limit

    def _spend(self, value: Any) -> Any:
        self.left -= 1
        if self.left < 0:
            raise _TooManyContainers
        return value


class _TooManyContainers(Exception):
    pass


class FrameDecoder:
    """Feed bytes, get back the complete msgpack values they finish."""

    def __init__(self, max_frame_bytes: int, max_containers: int = MAX_CONTAINERS):
        self.max_frame_bytes = max_frame_bytes
        self.ceiling = max_frame_bytes  # max_frame_bytes may be lowered later, never raised past this
        self.max_containers = max_containers
        # The scanner only skips: it finds message ends and allocates nothing a header declares.
        # read_size: its first buffer (msgpack's default is 1 MiB, held by every idle connection).
        self._scanner = msgpack.Unpacker(max_buffer_size=max_frame_bytes, read_size=min(READ_CHUNK, max_frame_bytes))
        self._partial = bytearray()  # bytes of the message in progress (after the last complete one)
        self._partial_at = 0  # stream offset of _partial[0]

    @property
    def pending_bytes(self) -> int:
        """Bytes received since the last complete message (0 between messages)."""
        return len(self._partial)

    def feed(self, data: bytes) -> list[Any]:
        """Return the values completed by ``data``; raise FrameError on undecodable input."""
        out: list[Any] = []
        view = memoryview(data)
        # Feed in pieces no larger than half the limit, draining between them, so a stream of
        # many small messages arriving in one big read never trips the limit by itself.
        step = max(1, min(len(view), self.max_frame_bytes // 2 or 1))
        for start in range(0, len(view), step):
            piece = view[start:start + step]
            try:
                self._scanner.feed(piece)
            except msgpack.BufferFull:
                raise self._too_large() from None
            self._partial += piece
            out.extend(self._drain())
            if len(self._partial) > self.max_frame_bytes:
                raise self._too_large()
            self._check_first_header()
        return out

    def close(self) -> None:
        """Drop what is buffered (the connection is gone)."""
        self._partial = bytearray()
        self._scanner = msgpack.Unpacker(max_buffer_size=1, read_size=1)

    def _too_large(self) -> FrameError:
        return FrameError(ErrorCode.FRAME_TOO_LARGE.value, f"message larger than the limit of {self.max_frame_bytes} bytes")

    def _drain(self) -> list[Any]:
        out = []
        used = 0  # bytes of _partial taken by complete messages in this drain
        while True:
            try:
                self._scanner.skip()
            except msgpack.OutOfData:
                break
            except msgpack.StackError:
                raise FrameError(ErrorCode.PARSE_ERROR.value, "invalid msgpack: nested too deeply") from None
            except Exception as err:  # noqa: BLE001 - every scanner failure means the same thing
                raise FrameError(ErrorCode.PARSE_ERROR.value, f"invalid msgpack: {str(err) or type(err).__name__}") from None
            end = self._scanner.tell() - self._partial_at
            if end - used > self.max_frame_bytes:
                raise self._too_large()
            with memoryview(self._partial) as whole:
                out.append(self._decode(whole[used:end]))
            used = end
        if used:
            del self._partial[:used]
            self._partial_at += used
        return out

    def _decode(self, message: memoryview) -> Any:
        budget = _ContainerBudget(self.max_containers)
        try:
            # raw=False: msgpack str -> Python str (Neovim sends strings as str); invalid UTF-8
            # in a str is a decode error. strict_map_key=False: maps keyed by ints are allowed
            # through here and rejected by the message layer with a proper error instead.
            return msgpack.unpackb(
                message, raw=False, strict_map_key=False, list_hook=budget._spend, object_hook=budget._spend,
            )
        except _TooManyContainers:
            raise FrameError(
                ErrorCode.FRAME_TOO_LARGE.value, f"message holds more than {self.max_containers} arrays and maps"
            ) from None
        except Exception as err:  # noqa: BLE001 - every decoder failure means the same thing
            raise FrameError(ErrorCode.PARSE_ERROR.value, f"invalid msgpack: {str(err) or type(err).__name__}") from None

    def _check_first_header(self) -> None:
        """Refuse a message whose first header alone declares more than the limit."""
        if not self._partial:
            return
        head = _LENGTH_HEADERS.get(self._partial[0])
        if head is None:
            return
        fmt, kind = head
        size = struct.calcsize(fmt)
        if len(self._partial) < 1 + size:
            return
        (declared,) = struct.unpack_from(fmt, self._partial, 1)
        # Each array item takes at least one byte, each map pair two.
        least = declared * (2 if kind == "pairs" else 1)
        if least > self.max_frame_bytes:
            raise self._too_large()
