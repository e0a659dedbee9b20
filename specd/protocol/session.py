"""One msgpack-rpc connection on asyncio streams, usable by either end.

The read loop decodes frames, answers requests through ``handler`` (each in its own task, so
a long ``complete`` never holds up a ``cancel`` on the same connection), routes responses to
the requests this end sent, and passes notifications to ``on_notification``. Every handler
exception becomes an error response carrying the request's own msgid.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from typing import Any, Awaitable, Callable

from specd.protocol.errors import ErrorCode, RpcError
from specd.protocol.framing import READ_CHUNK, WALK_SLICE, FrameDecoder, FrameError, pack
from specd.protocol.messages import (
    MAX_MSGID,
    InvalidMessage,
    Notification,
    Request,
    Response,
    parse_message,
)
from specd.protocol.methods import ERROR_NOTIFICATION

log = logging.getLogger("specd.protocol")

RequestHandler = Callable[[Request], Awaitable[Any]]
NotificationHandler = Callable[[Notification], Awaitable[None] | None]

# Requests one connection may have unanswered at once. A request holds its slot until its
# answer has left the write buffer (below the high-water mark), so a client that floods
# without reading its answers stops being read after this many: its memory is bounded.
MAX_CONCURRENT_REQUESTS = 64

# Bytes of answers waiting in a connection's write buffer above which the session stops
# reading from that peer until the buffer drains (asyncio's flow control: pause at high,
# resume at low).
WRITE_HIGH_WATER = 256 * 1024
WRITE_LOW_WATER = 64 * 1024

# How long the bytes of one message may take to arrive once its first byte has: a peer that
# sends half a message and stalls is closed, not waited on forever.
PARTIAL_MESSAGE_TIMEOUT_S = 30.0
# While the owner says others need the interpreter (``yield_to_others``: a completion stepping
# on the model thread), a message still arriving is read one chunk per this pause: a client
# sending 64 MiB of documents otherwise keeps the loop copying bytes with the GIL held, and
# every small torch op of the completion waits out a switch interval to get it back (a polite
# completion's engine time nearly tripled: docs/reliability.md). 1 MiB then takes 16 pauses, ~16 ms more.
LARGE_READ_PAUSE_S = 0.001

# How long a peer may leave our answers unread (the write buffer over the high-water mark,
# reading paused) before the connection is dropped: no slot is held past a deadline.
WRITE_STALL_TIMEOUT_S = 60.0

# After the peer's EOF, how long requests already read may take to answer before being cut.
ANSWER_GRACE_S = 5.0


# Closing a socket that still holds unread input makes the kernel send RST, and the peer may
# lose the error we wrote just before. So after an error we half-close, then read and discard
# for a moment (bounded in time and bytes) before closing.
LINGER_S = 1.0
LINGER_BYTES = 32 * 1024 * 1024  # twice the default frame limit: a refused message is read to its end


async def linger_close(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Half-close, discard what the peer still sends (briefly), then close."""
    try:
        await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + LINGER_S
        discarded = 0
        while discarded < LINGER_BYTES and (left := deadline - loop.time()) > 0:
            data = await asyncio.wait_for(reader.read(READ_CHUNK), left)
            if not data:
                break
            discarded += len(data)
    except (asyncio.TimeoutError, ConnectionError, OSError, RuntimeError):
        pass
    try:
        writer.close()
        await writer.wait_closed()
    except (ConnectionError, OSError, RuntimeError):
        pass


class Session:
    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        *,
        max_frame_bytes: int,
        handler: RequestHandler | None = None,
        on_notification: NotificationHandler | None = None,
        name: str = "session",
        on_eof: Callable[[], None] | None = None,
        partial_message_timeout_s: float | None = None,
        yield_to_others: Callable[[], bool] | None = None,
    ):
        self.reader = reader
        self.writer = writer
        self.handler = handler
        self.on_notification = on_notification
        self.on_eof = on_eof
        self.name = name
        self._decoder = FrameDecoder(max_frame_bytes)
        self.partial_message_timeout_s = partial_message_timeout_s
        self.yield_to_others = yield_to_others  # True: a large message in progress is read slowly (LARGE_READ_PAUSE_S)
        self._partial_since: float | None = None  # loop time the message in progress began
        transport = getattr(writer, "transport", None)
        if transport is not None and hasattr(transport, "set_write_buffer_limits"):
            transport.set_write_buffer_limits(high=WRITE_HIGH_WATER, low=WRITE_LOW_WATER)
        self._pending: dict[int, asyncio.Future[Any]] = {}
        self._msgids = itertools.cycle(range(1, MAX_MSGID + 1))
        self._tasks: set[asyncio.Task[None]] = set()
        self._slots = asyncio.Semaphore(MAX_CONCURRENT_REQUESTS)
        self._closed = False
        self._linger = False  # close gently so the peer reads our last error
        # How an error goes in a response's error slot: the {code, message} map by default;
        # the daemon switches a connection to "code: message" strings on request (Neovim).
        self.encode_error: Callable[[RpcError], Any] = RpcError.to_wire
        self.close_reason: RpcError | None = None

    # -- sending ---------------------------------------------------------------------------

    def _write(self, obj: Any) -> None:
        if self._closed or self.writer.is_closing():
            return
        self.writer.write(pack(obj))

    async def _flush(self) -> None:
        try:
            await self.writer.drain()
        except (ConnectionError, RuntimeError):
            pass

    async def request(self, method: str, params: dict[str, Any] | None = None, timeout: float | None = None) -> Any:
        """Send a request and wait for its result; raise RpcError for an error response."""
        msgid, future = self.send_request(method, params)
        try:
            return await asyncio.wait_for(future, timeout)
        except asyncio.TimeoutError:
            raise RpcError(ErrorCode.TIMEOUT, f"no answer to {method} within {timeout} s") from None
        finally:
            self._pending.pop(msgid, None)

    def send_request(self, method: str, params: dict[str, Any] | None = None) -> tuple[int, asyncio.Future[Any]]:
        if self._closed:
            raise self.close_reason or RpcError(ErrorCode.CONNECTION_LOST, "connection closed")
        msgid = next(self._msgids)
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending[msgid] = future
        self._write(Request(msgid, method, params or {}).to_wire())
        return msgid, future

    def forget(self, msgid: int) -> None:
        """Stop waiting for the answer to ``msgid`` (its caller gave up); a late answer is dropped."""
        future = self._pending.pop(msgid, None)
        if future is not None and not future.done():
            future.cancel()

    async def notify(self, method: str, params: dict[str, Any] | None = None) -> None:
        self._write(Notification(method, params or {}).to_wire())
        await self._flush()

    def notify_nowait(self, method: str, params: dict[str, Any] | None = None) -> None:
        """Queue a notification for writing, in order with everything written after it."""
        self._write(Notification(method, params or {}).to_wire())

    async def send_error_notification(self, error: RpcError) -> None:
        await self.notify(ERROR_NOTIFICATION, error.to_wire())

    # -- receiving -------------------------------------------------------------------------

    @property
    def frame_limit(self) -> int:
        """The largest message this end accepts now (lowered for unauthenticated peers)."""
        return self._decoder.max_frame_bytes

    @frame_limit.setter
    def frame_limit(self, limit: int) -> None:
        self._decoder.max_frame_bytes = min(limit, self._decoder.ceiling)

    def write_buffer_size(self) -> int:
        transport = getattr(self.writer, "transport", None)
        return transport.get_write_buffer_size() if transport is not None else 0

    def _read_deadline(self) -> float | None:
        """Seconds left for the message in progress, or None when between messages."""
        if self._decoder.pending_bytes == 0 or self.partial_message_timeout_s is None:
            self._partial_since = None
            return None
        now = asyncio.get_running_loop().time()
        if self._partial_since is None:
            self._partial_since = now
        return max(0.0, self._partial_since + self.partial_message_timeout_s - now)

    async def _read(self) -> bytes:
        # Backpressure: while our answers pile up unread, read nothing more from this peer.
        if self.write_buffer_size() > WRITE_HIGH_WATER:
            try:
                await asyncio.wait_for(self._flush(), WRITE_STALL_TIMEOUT_S)
            except asyncio.TimeoutError:
                log.info("%s: answers unread for %g s; closing", self.name, WRITE_STALL_TIMEOUT_S)
                self.writer.transport.abort()
                return b""
        if self._decoder.pending_bytes and self.yield_to_others is not None and self.yield_to_others():
            await asyncio.sleep(LARGE_READ_PAUSE_S)
        left = self._read_deadline()
        if left is None:
            return await self.reader.read(READ_CHUNK)
        try:
            return await asyncio.wait_for(self.reader.read(READ_CHUNK), left)
        except asyncio.TimeoutError:
            raise FrameError(
                ErrorCode.TIMEOUT.value,
                f"a message stayed incomplete for {self.partial_message_timeout_s:g} s "
                f"({self._decoder.pending_bytes} bytes received)",
            ) from None

    async def run(self) -> None:
        """Serve the connection until EOF, a broken stream or ``close()``."""
        try:
            while not self._closed:
                try:
                    data = await self._read()
                    if not data:
                        break
                    objects = await self._feed(data)
                    if objects:  # what is pending now belongs to a newer message: its own clock
                        self._partial_since = None
                except (ConnectionError, OSError):
                    break
                except FrameError as err:
                    # The stream cannot be resynchronised after undecodable bytes: say why, close.
                    self.close_reason = RpcError(err.code, err.message)
                    await self.send_error_notification(self.close_reason)
                    self._linger = True
                    break
                for obj in objects:
                    await self._dispatch(obj)
                del objects
        finally:
            # The peer stopped sending (or broke the stream). Let the owner cancel this peer's
            # work, give the requests already taken a moment to answer (a client that only
            # half-closed still reads them), then close.
            if self.on_eof is not None:
                self.on_eof()
            await self._settle(ANSWER_GRACE_S)
            if self._linger and not self._closed:
                self._closed = True
                self._fail_pending()
                await linger_close(self.reader, self.writer)
            await self.close()
            self._decoder.close()
            self.release_callbacks()

    async def _feed(self, data: bytes) -> list[Any]:
        """The messages ``data`` completes, walked ``WALK_SLICE`` bytes at a time with a loop
        turn for others between slices; at once when it is all inside a string's payload (a
        large document's text: nothing to walk, and 128 turns a MiB cost the loop's others
        more than they gave them)."""
        if len(data) <= WALK_SLICE or len(data) <= self._decoder.payload_ahead:
            return self._decoder.feed(data)
        objects: list[Any] = []
        with memoryview(data) as view:
            for at in range(0, len(data), WALK_SLICE):
                if at:
                    await asyncio.sleep(0)
                objects += self._decoder.feed(view[at:at + WALK_SLICE])
        return objects

    async def _settle(self, timeout: float) -> None:
        if not self._tasks:
            return
        _, still_running = await asyncio.wait(list(self._tasks), timeout=timeout)
        for task in still_running:
            task.cancel()
        if still_running:
            await asyncio.wait(still_running, timeout=1.0)

    async def _dispatch(self, obj: Any) -> None:
        try:
            message = parse_message(obj)
        except InvalidMessage as err:
            if err.msgid is not None:
                self._write(Response(err.msgid, self.encode_error(err), None).to_wire())
                await self._flush()
            else:
                await self.send_error_notification(err)
            return
        if isinstance(message, Request):
            await self._slots.acquire()
            task = asyncio.create_task(self._answer(message), name=f"{self.name}:{message.method}")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        elif isinstance(message, Response):
            future = self._pending.pop(message.msgid, None)
            if future is None or future.done():
                log.debug("%s: response to unknown msgid %s", self.name, message.msgid)
            elif message.error is not None:
                future.set_exception(RpcError.from_wire(message.error))
            else:
                future.set_result(message.result)
        elif self.on_notification is not None:
            try:
                outcome = self.on_notification(message)
                if asyncio.iscoroutine(outcome):
                    await outcome
            except RpcError as err:  # no response to carry it: tell the peer in an error notification
                log.debug("%s: notification %s refused: %s", self.name, message.method, err)
                await self.send_error_notification(err)
            except Exception:  # a bug on this side: log it and go on
                log.exception("%s: notification %s failed", self.name, message.method)

    async def _answer(self, request: Request) -> None:
        try:
            if self.handler is None:
                raise RpcError(ErrorCode.METHOD_NOT_FOUND, f"this end serves no methods ({request.method})")
            result = await self.handler(request)
            response = Response(request.msgid, None, result)
        except RpcError as err:
            response = Response(request.msgid, self.encode_error(err), None)
        except asyncio.CancelledError:
            response = Response(request.msgid, self.encode_error(RpcError(ErrorCode.CANCELLED, "request cancelled")), None)
        except Exception as err:  # every handler failure still answers the request
            log.exception("%s: %s failed", self.name, request.method)
            error = RpcError(ErrorCode.INTERNAL_ERROR, f"{type(err).__name__}: {err}")
            response = Response(request.msgid, self.encode_error(error), None)
        try:
            try:
                self._write(response.to_wire())
            except (TypeError, ValueError, OverflowError) as err:  # a result msgpack cannot carry
                log.error("%s: cannot encode the result of %s: %s", self.name, request.method, err)
                error = RpcError(ErrorCode.INTERNAL_ERROR, f"result not encodable: {err}")
                self._write(Response(request.msgid, self.encode_error(error), None).to_wire())
            del response
            await self._flush()  # the slot is held until the answer is on its way (backpressure)
        finally:
            self._slots.release()

    # -- closing ---------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._closed

    async def wait_answered(self) -> None:
        """Wait until every request this end is answering has been answered."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    def _fail_pending(self) -> None:
        reason = self.close_reason or RpcError(ErrorCode.CONNECTION_LOST, "connection closed")
        for future in self._pending.values():
            if not future.done():
                future.set_exception(reason)
        self._pending.clear()

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._fail_pending()
        self._decoder.close()
        try:
            self.writer.close()
            await self.writer.wait_closed()
        except (ConnectionError, OSError, RuntimeError):
            pass
        self.release_callbacks()

    def release_callbacks(self) -> None:
        """Forget the owner's callbacks: they close over the owner, which holds this session,
        and that cycle would keep a closed connection's memory until a full collection."""
        self.handler = None
        self.on_notification = None
        self.on_eof = None
