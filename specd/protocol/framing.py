"""Bytes <-> whole msgpack objects.

msgpack-rpc has no length prefix: messages are msgpack values written back to back, so a
reader feeds bytes to a streaming unpacker and takes out every complete value. The size limit
is the unpacker's buffer limit; a declared length over it (a str32 header claiming 4 GiB) is
refused as soon as the header arrives, before any of that memory is allocated.
"""

from __future__ import annotations

from typing import Any

import msgpack

from specd.protocol.errors import ErrorCode

READ_CHUNK = 64 * 1024


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

    def __init__(self, max_frame_bytes: int):
        self.max_frame_bytes = max_frame_bytes
        # raw=False: msgpack str -> Python str (Neovim sends strings as str); invalid UTF-8
        # in a str is a decode error. strict_map_key=False: maps keyed by ints are allowed
        # through here and rejected by the message layer with a proper error instead.
        self._unpacker = msgpack.Unpacker(
            raw=False,
            max_buffer_size=max_frame_bytes,
            strict_map_key=False,
        )

    def feed(self, data: bytes) -> list[Any]:
        """Return the values completed by ``data``; raise FrameError on undecodable input."""
        out: list[Any] = []
        view = memoryview(data)
        # Feed in pieces no larger than the limit, draining between them, so a stream of many
        # small messages arriving in one big read never trips the buffer limit by itself.
        step = max(1, min(len(view), self.max_frame_bytes // 2 or 1))
        for start in range(0, len(view), step):
            try:
                self._unpacker.feed(view[start:start + step])
            except msgpack.BufferFull:
                raise FrameError(
                    ErrorCode.FRAME_TOO_LARGE.value, f"message larger than the limit of {self.max_frame_bytes} bytes"
                ) from None
            out.extend(self._drain())
        return out

    def _drain(self) -> list[Any]:
        out = []
        while True:
            try:
                out.append(self._unpacker.unpack())
            except msgpack.OutOfData:
                return out
            except msgpack.StackError:
                raise FrameError(ErrorCode.PARSE_ERROR.value, "invalid msgpack: nested too deeply") from None
            except Exception as err:  # noqa: BLE001 - every decoder failure means the same thing
                # ValueError "N exceeds max_array_len(M)": a declared length over the limit.
                if "exceeds max" in str(err):
                    raise FrameError(
                        ErrorCode.FRAME_TOO_LARGE.value, f"message larger than the limit of {self.max_frame_bytes} bytes"
                    ) from None
                detail = str(err) or type(err).__name__
                raise FrameError(ErrorCode.PARSE_ERROR.value, f"invalid msgpack: {detail}") from None
