"""LSP's base protocol on stdin/stdout, strict about framing.

pygls's own reader skips what it cannot parse and reads on: after one wrong ``Content-Length``
every later message is misread, and the server stays alive but deaf. This reader stops at the
first framing error instead: a header line that is not ``Name: value``, a missing, malformed,
conflicting or oversized ``Content-Length``, a header over ``MAX_HEADER_BYTES``, a message whose
bytes stop arriving for ``read_timeout`` seconds (editors write a message at once, so a stall
means the length was wrong), or the input ending inside a message. ``run_stdio`` then logs one
line and ends the process with ``FRAMING_EXIT_STATUS``, so the editor restarts the server.

A body of the announced length that is not JSON is not a framing error: it gets a JSON-RPC
parse error (as the specification asks) and reading goes on; JSON that is not an LSP message
(``jsonrpc.py``) gets its one-line error the same way. If the length was too short, the next
header line is the rest of that body, and that is one.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import sys
import threading
from concurrent.futures import Executor
from typing import Any, BinaryIO, Callable

from pygls.io_ import StdoutWriter

from specd_lsp import jsonrpc

log = logging.getLogger("specd_lsp")

MAX_MESSAGE_BYTES = 256 << 20  # a didOpen of a large file, JSON-escaped, with room to spare
MAX_HEADER_BYTES = 8 << 10  # all header lines of one message together
READ_CHUNK_BYTES = 1 << 20
READ_TIMEOUT_S = 10.0  # the longest a started message may stall
FRAMING_EXIT_STATUS = 1
PARSE_ERROR = -32700  # JSON-RPC: invalid JSON was received
HEADER_NAME = re.compile(rb"[!#$%&'*+.^_`|~0-9A-Za-z-]+")  # an HTTP token, as LSP's headers are


class FramingError(Exception):
    """The byte stream no longer says where messages begin: nothing after this can be trusted."""


class MessageReader:
    """Whole message bodies from a binary stream, read on a worker thread (pygls's way: stdin
    may be a pipe, a file or a terminal)."""

    def __init__(self, stream: BinaryIO, executor: Executor | None, read_timeout: float = READ_TIMEOUT_S):
        self.stream = stream
        self.executor = executor
        self.read_timeout = read_timeout

    async def _read(self, fn: Callable[[int], bytes], size: int, timeout: float | None, stalled: str) -> bytes:
        future = asyncio.get_running_loop().run_in_executor(self.executor, fn, size)
        try:
            return await asyncio.wait_for(future, timeout)
        except asyncio.TimeoutError:
            raise FramingError(f"{stalled} for {self.read_timeout:g} s") from None

    async def next_body(self) -> bytes | None:
        """The next message's body; None when the input ends between messages."""
        length: int | None = None
        header_bytes = 0
        # An idle editor may wait as long as it likes before a message; once its first byte is
        # here, the rest must follow without a stall.
        if not await self._read(self.stream.peek, 1, None, ""):
            return None
        while True:
            line = await self._read(self.stream.readline, MAX_HEADER_BYTES - header_bytes + 1, self.read_timeout,
                                    "a message header left unfinished")
            if not line:
                raise FramingError("the input ended inside a message header")
            header_bytes += len(line)
            if header_bytes > MAX_HEADER_BYTES or not line.endswith(b"\n"):
                raise FramingError(f"a message header over {MAX_HEADER_BYTES} bytes")
            text = line[:-2] if line.endswith(b"\r\n") else line[:-1]
            if not text:
                break
            name, colon, value = text.partition(b":")
            if not colon or not HEADER_NAME.fullmatch(name):
                raise FramingError(f"a malformed header line {_shown(line)}")
            if name.lower() != b"content-length":
                continue  # Content-Type, or anything else: LSP needs only the length
            value = value.strip()
            if not value.isdigit() or len(value) > 12:
                raise FramingError(f"a bad Content-Length {_shown(value)}")
            if length is not None and int(value) != length:
                raise FramingError(f"two Content-Lengths ({length} and {int(value)})")
            length = int(value)
        if length is None:
            raise FramingError("a message without a Content-Length header")
        if length > MAX_MESSAGE_BYTES:
            raise FramingError(f"a Content-Length of {length} bytes (at most {MAX_MESSAGE_BYTES})")
        chunks, remaining = [], length
        while remaining:
            chunk = await self._read(self.stream.read1, min(remaining, READ_CHUNK_BYTES), self.read_timeout,
                                     f"{length - remaining} of the {length} bytes its Content-Length announced, "
                                     "then nothing")
            if not chunk:
                raise FramingError(f"the input ended {length - remaining} bytes into a {length}-byte message")
            chunks.append(chunk)
            remaining -= len(chunk)
        return b"".join(chunks)


def _shown(data: bytes) -> str:
    return repr(data[:60]) + ("…" if len(data) > 60 else "")


async def serve(server: Any, reader: MessageReader) -> None:
    """Hand each message to the pygls server's protocol until the input ends or the server stops."""
    protocol = server.protocol
    while not server._stop_event.is_set():
        body = await reader.next_body()
        if body is None:
            return
        try:
            data = json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            log.warning("a %d-byte message that is not JSON (%s): answered with a parse error", len(body), err)
            # A plain dict: pygls's converter would leave out the id, which must be there, null.
            protocol._send_data({"jsonrpc": "2.0", "id": None,
                                 "error": {"code": PARSE_ERROR, "message": f"not JSON: {err}"}})
            continue
        except RecursionError:
            log.warning("a %d-byte message nested too deeply to read: answered with a parse error", len(body))
            protocol._send_data({"jsonrpc": "2.0", "id": None,
                                 "error": {"code": PARSE_ERROR, "message": "nested too deeply"}})
            continue
        try:
            jsonrpc.check(data)
            message = jsonrpc.structure(protocol, data)
        except jsonrpc.BadMessage as bad:
            log.warning("a message that is not LSP (%s)%s", bad.message,
                        ": answered with an error" if bad.answer else ": dropped")
            if bad.answer:
                protocol._send_data(bad.response())
            continue
        try:
            protocol.handle_message(message)
        except Exception:
            log.exception("unable to handle a message")


def run_stdio(server: Any, stdin: BinaryIO | None = None, stdout: BinaryIO | None = None,
              read_timeout: float = READ_TIMEOUT_S) -> int:
    """Serve LSP on stdin/stdout (what pygls's ``start_io`` does, with the strict reader). On a
    framing error: one log line, then ``os._exit`` (a reading thread may be blocked in stdin,
    and an ordinary exit would wait for it forever)."""
    server._stop_event = threading.Event()  # pygls's shutdown() sets it
    server.protocol.set_writer(StdoutWriter(stdout or sys.stdout.buffer))
    reader = MessageReader(stdin or sys.stdin.buffer, server.thread_pool, read_timeout)
    try:
        asyncio.run(serve(server, reader))
    except FramingError as err:
        log.error("unrecoverable framing error on stdin: %s; exiting so that the editor restarts specd-lsp", err)
        logging.shutdown()
        os._exit(FRAMING_EXIT_STATUS)
    except BrokenPipeError:
        log.error("the editor closed the connection; shutting down")
    except (KeyboardInterrupt, SystemExit):  # SystemExit: the client's exit notification (pygls)
        pass
    finally:
        server.shutdown()
    return 0
