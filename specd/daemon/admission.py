"""Who may talk to the daemon: connection limits, the peer's uid, the TCP token and its
back-off, the first-message deadline.

A new connection is *pending* until it proves to be a client, and pending connections live in
their own small pool per listener, outside ``daemon.max_connections``: so connections that say
nothing cannot take the slots of clients that talk.

- A Unix connection is accepted when its peer runs as the served uid and fewer than
  ``daemon.max_connections`` clients are connected; it becomes a client with its first
  complete message (``hello`` or any other), which must come within ``FIRST_MESSAGE_DEADLINE_S``.
- A TCP connection may send only ``hello`` with the token, within ``HELLO_DEADLINE_S``, in
  messages of at most ``PREAUTH_MAX_FRAME_BYTES``; it becomes a client once authenticated (and
  is refused then if the clients are at the limit). Each wrong token delays its answer
  (``AUTH_BACKOFF_*``) and closes the connection.
- When a listener's pool is full (``MAX_PENDING_UNIX``, ``MAX_PREAUTH_CONNECTIONS``), the
  oldest pending connection there is closed to make room, never the newcomer: a client that
  connects and speaks at once always gets in, however many silent ones came before it.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from specd.daemon.params import hello_token
from specd.daemon.scheduler import Job
from specd.protocol.errors import ErrorCode, RpcError
from specd.protocol.framing import pack
from specd.protocol.messages import Notification
from specd.protocol.methods import ERROR_NOTIFICATION, Method
from specd.protocol.session import Session, linger_close

log = logging.getLogger("specd.daemon")

MAX_PREAUTH_CONNECTIONS = 8  # TCP connections waiting to authenticate
MAX_PENDING_UNIX = 16  # Unix connections waiting for their first message
PREAUTH_MAX_FRAME_BYTES = 64 * 1024
HELLO_DEADLINE_S = 10.0
FIRST_MESSAGE_DEADLINE_S = 10.0  # shorter than a partial message's 30 s: nothing is coming
# A wrong token delays its answer by BASE * 2**(recent failures - 1) s, at most MAX; the count
# resets after a success or AUTH_BACKOFF_RESET_S without failures.
AUTH_BACKOFF_BASE_S = 0.1
AUTH_BACKOFF_MAX_S = 5.0
AUTH_BACKOFF_RESET_S = 60.0
CLOSE_AFTER_ANSWER_S = 0.05  # a refused hello's answer goes out before its connection closes


@dataclass(eq=False)
class Connection:
    id: int
    session: Session | None = None  # cleared when the connection closes (no cycle through the handlers)
    transport: str = "unix"  # unix | tcp
    uid: int | None = None
    authenticated: bool = True  # TCP connections start False until hello presents the token
    pending: bool = True  # not a client yet: no complete message (Unix), not authenticated (TCP)
    client: str = ""
    batch: bool = False  # its completes are batch work unless a complete says otherwise
    jobs: dict[int, Job] = field(default_factory=dict)  # msgid -> running complete


async def refuse(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, error: RpcError) -> None:
    """Say why in one error notification, then close without serving anything."""
    try:
        writer.write(pack(Notification(ERROR_NOTIFICATION, error.to_wire()).to_wire()))
    except (ConnectionError, OSError, RuntimeError):
        pass
    await linger_close(reader, writer)


class Admission:
    """Admits connections into ``connections`` (the daemon's map, by id) and keeps them within
    the limits; authenticates TCP connections."""

    def __init__(self, connections: dict[int, Connection], *, allowed_uid: int, max_connections: int,
                 max_frame_bytes: int, tcp_token: str):
        self.connections = connections
        self.allowed_uid = allowed_uid
        self.max_connections = max_connections
        self.max_frame_bytes = max_frame_bytes
        self.tcp_token = tcp_token
        self._deadlines: dict[int, asyncio.TimerHandle] = {}  # connection id -> its hello deadline
        self._auth_failures = 0
        self._last_auth_failure = 0.0

    def client_count(self) -> int:
        return sum(1 for conn in self.connections.values() if not conn.pending)

    def too_many(self) -> RpcError:
        return RpcError(
            ErrorCode.TOO_MANY_CONNECTIONS,
            f"{self.client_count()} clients are connected, the limit (daemon.max_connections)",
        )

    def peer_refusal(self, uid: int | None) -> RpcError | None:
        """Why a Unix peer running as ``uid`` (None: unknown) may not connect, or None."""
        if uid is None or uid == self.allowed_uid:
            return None
        log.warning("refused a connection from uid %s (serving uid %s)", uid, self.allowed_uid)
        return RpcError(ErrorCode.UNAUTHORIZED, f"uid {uid} may not use this daemon")

    def refusal(self, conn: Connection) -> RpcError | None:
        """Why ``conn`` may not join now (the clients are at the limit), or None. A TCP
        connection is counted once it authenticates, and checked then."""
        if conn.transport == "unix" and self.client_count() >= self.max_connections:
            return self.too_many()
        return None

    def admit(self, conn: Connection, hello_deadline_s: float,
              first_message_deadline_s: float = FIRST_MESSAGE_DEADLINE_S) -> None:
        """``conn`` (its session set) joins as pending, with a deadline to become a client;
        the oldest pending connection of its listener makes room when the pool is full."""
        session = conn.session
        if session is None:
            return
        pool = MAX_PENDING_UNIX if conn.transport == "unix" else MAX_PREAUTH_CONNECTIONS
        waiting = [other for other in self.connections.values() if other.pending and other.transport == conn.transport]
        for oldest in waiting[: max(0, len(waiting) - pool + 1)]:  # the map keeps connection order
            self._evict(oldest, pool)
        if conn.authenticated:
            deadline_s, overdue = first_message_deadline_s, "no request"
        else:
            session.frame_limit = min(PREAUTH_MAX_FRAME_BYTES, self.max_frame_bytes)
            deadline_s, overdue = hello_deadline_s, "no hello with the token"
        self._deadlines[conn.id] = asyncio.get_running_loop().call_later(
            deadline_s, self._overdue, conn, f"{overdue} within {deadline_s:g} s")
        self.connections[conn.id] = conn

    def spoke(self, conn: Connection) -> None:
        """A complete message came from ``conn``: a Unix connection is a client from now on
        (refused if the clients reached the limit while it was pending)."""
        if not conn.pending or not conn.authenticated:
            return
        if conn.id not in self.connections:  # evicted: its close is on the way
            raise RpcError(ErrorCode.TOO_MANY_CONNECTIONS, "this connection was closed to make room")
        self._promote(conn)

    def _promote(self, conn: Connection) -> None:
        deadline = self._deadlines.pop(conn.id, None)
        if deadline is not None:
            deadline.cancel()
        if self.client_count() >= self.max_connections:
            self._close_soon(conn)
            raise self.too_many()
        conn.pending = False

    def leave(self, conn: Connection) -> None:
        deadline = self._deadlines.pop(conn.id, None)
        if deadline is not None:
            deadline.cancel()
        self.connections.pop(conn.id, None)

    async def gate(self, conn: Connection, method: str, params: dict[str, Any]) -> None:
        """Let a request through, or refuse it: an unauthenticated connection may send only its
        hello, whose token is checked here."""
        if conn.authenticated:
            return
        if method != Method.HELLO:
            raise RpcError(ErrorCode.UNAUTHORIZED, "send hello with the token first (TCP connections need daemon.tcp_token)")
        await self._authenticate(conn, hello_token(params))

    async def _authenticate(self, conn: Connection, token: str | None) -> None:
        """Check a TCP connection's token; a wrong one is answered late and the connection closed."""
        if token is not None and hmac.compare_digest(token.encode(), self.tcp_token.encode()):
            self._promote(conn)
            self._auth_failures = 0
            conn.authenticated = True
            if conn.session is not None:
                conn.session.frame_limit = self.max_frame_bytes
            return
        now = time.monotonic()
        if now - self._last_auth_failure > AUTH_BACKOFF_RESET_S:
            self._auth_failures = 0
        self._auth_failures += 1
        self._last_auth_failure = now
        # Guessing costs time: each recent failure doubles the wait before the next answer,
        # and the waiting connection keeps one of the few pre-auth slots.
        await asyncio.sleep(min(AUTH_BACKOFF_MAX_S, AUTH_BACKOFF_BASE_S * 2 ** min(self._auth_failures - 1, 16)))
        self._close_soon(conn)  # one try per connection
        raise RpcError(ErrorCode.UNAUTHORIZED, "missing or wrong token")

    def _close_soon(self, conn: Connection) -> None:
        """Close after the answer being written has gone out."""
        session = conn.session
        if session is not None:
            asyncio.get_running_loop().call_later(CLOSE_AFTER_ANSWER_S, lambda: asyncio.ensure_future(session.close()))

    def _overdue(self, conn: Connection, why: str) -> None:
        if conn.pending:
            log.info("conn%d: %s; closing", conn.id, why)
            self._close_with(conn, RpcError(ErrorCode.UNAUTHORIZED if not conn.authenticated else ErrorCode.TIMEOUT, why))

    def _evict(self, conn: Connection, pool: int) -> None:
        log.info("conn%d: closed to make room: %d %s connections were waiting", conn.id, pool, conn.transport)
        deadline = self._deadlines.pop(conn.id, None)
        if deadline is not None:
            deadline.cancel()
        self._close_with(conn, RpcError(
            ErrorCode.TOO_MANY_CONNECTIONS,
            f"closed to make room: {pool} connections were waiting for their first message (the oldest goes)"))
        self.connections.pop(conn.id, None)  # out of the pool now, not when the close lands

    def _close_with(self, conn: Connection, error: RpcError) -> None:
        """Say why in one error notification, then close."""
        session = conn.session
        if session is None:
            return
        session.close_reason = error

        async def say_why_and_close() -> None:
            try:
                await asyncio.wait_for(session.send_error_notification(error), 1.0)
            finally:
                await session.close()

        task = asyncio.ensure_future(say_why_and_close())
        task.add_done_callback(lambda done: done.cancelled() or done.exception())  # a failed write is no news
