"""The daemon: asyncio socket server in front of the model worker.

One ``Daemon`` owns the listeners (a Unix socket, bound here or passed by systemd, and an
optional loopback TCP listener that needs a token), the open buffers, the model worker and
the per-request bookkeeping (supersede, cancel, queue, latency). Handlers are short: validate
the params, touch the buffers, queue a job, await it. The loop never waits on the model.

Around it: ``listeners`` (socket setup and file safety), ``params`` (parameter checkers),
``scheduler`` (the completion queue), ``metrics`` (what status reports), ``engine_api`` (what
an engine must offer).

Limits, per connection: one message at most ``daemon.max_frame_bytes`` however it is streamed,
and complete within ``PARTIAL_MESSAGE_TIMEOUT_S`` once begun; answers left unread stop the
reading (``session.WRITE_HIGH_WATER``); TCP connections must present the token within
``HELLO_DEADLINE_S``, at most ``MAX_PREAUTH_CONNECTIONS`` at once, with messages of at most
``PREAUTH_MAX_FRAME_BYTES``, and each wrong token delays the next answer (``AUTH_BACKOFF_*``).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hmac
import importlib
import itertools
import logging
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable, Callable

from specd import __version__
from specd.daemon import systemd
from specd.daemon.buffers import BufferStore, TextIndex, edit_index, index_in_steps, last_edit_end, resolve_cursor
from specd.daemon.engine_api import CompletionEngine, CorpusEngine
from specd.daemon.listeners import RuntimeLock, StartupError, bind_tcp, bind_unix, peer_uid
from specd.daemon.metrics import EngineFigures, LatencyWindow, device_memory, process_memory
from specd.daemon.params import (
    MAX_URI_CHARS,
    check_encoding,
    completion_options,
    get_folders,
    get_int,
    get_str,
    get_uri,
    param_error,
)
from specd.daemon.scheduler import CompletionQueue
from specd.daemon.worker import FAILED, LOADING, READY, STARTING, DocumentMirror, Job, ModelWorker
from specd.daemon.workspace import Workspace, WorkspaceOptions
from specd.protocol import session as session_limits
from specd.protocol.errors import ErrorCode, RpcError
from specd.protocol.framing import pack
from specd.protocol.messages import Notification, Request
from specd.protocol.methods import CAPABILITIES, ERROR_FORMATS, ERROR_NOTIFICATION, POSITION_ENCODINGS, PROTOCOL_VERSION, Method
from specd.protocol.session import Session, linger_close

__all__ = ["Daemon", "StartupError", "serve_forever"]

log = logging.getLogger("specd.daemon")

# Test hook: "module:callable" building the engine from the config instead of specd.engine.
ENGINE_FACTORY_ENV = "SPECD_TEST_ENGINE_FACTORY"

SHUTDOWN_GRACE_S = 10.0  # beyond the time budget, how long a running completion may finish
# A change with many ranged edits is applied in steps of about this long, the loop serving
# other clients in between. A request takes three loop turns to be answered (the read, the
# session's dispatch, the handler), and one more when it arrives during a turn, so between two
# steps the loop gets EDIT_YIELD_TURNS turns (~6 us each when nothing is waiting). A request
# that waits on a thread (`status` when the engine's figures are older than
# ENGINE_FIGURES_MAX_AGE_S) makes the loop sleep EDIT_PAUSE_S between steps too (epoll rounds it
# up to 1 ms; a request arriving ends it early): a sleeping loop lets go of the GIL, a busy one
# makes the thread wait out the interpreter's 5 ms switch interval, each time. Figures for
# another client's `status` p95 during 400-edit changes on 1 MiB (tests/test_daemon_limits.py,
# p95 test): 45-56 ms with 5 ms steps and one turn; 3-7 ms with 0.5 ms steps, 3 turns and a
# thread hop per status; see docs/reliability.md (issue 17) for these settings.
EDIT_STEP_S = 0.00025
EDIT_YIELD_TURNS = 8
EDIT_PAUSE_S = 0.0005
# `status` (and hello's model names) reuse the engine's figures for this long, unless a
# completion ended or the models loaded or were released since (metrics.EngineFigures).
ENGINE_FIGURES_MAX_AGE_S = 0.1

# TCP connections before their hello with the token: few, small and short-lived, so that a
# user without the token can neither lock the owner out nor grow the daemon.
MAX_PREAUTH_CONNECTIONS = 8
PREAUTH_MAX_FRAME_BYTES = 64 * 1024
HELLO_DEADLINE_S = 10.0
# A wrong token delays its answer by BASE * 2**(recent failures - 1) s, at most MAX; the count
# resets after a success or AUTH_BACKOFF_RESET_S without failures.
AUTH_BACKOFF_BASE_S = 0.1
AUTH_BACKOFF_MAX_S = 5.0
AUTH_BACKOFF_RESET_S = 60.0


def load_engine(cfg: Any) -> CompletionEngine:
    hook = os.environ.get(ENGINE_FACTORY_ENV)
    if hook:
        module_name, _, attr = hook.partition(":")
        return getattr(importlib.import_module(module_name), attr)(cfg)
    from specd.engine.loading import load_engine as load  # torch and transformers load here, in the worker thread

    return load(cfg)  # the resident pair, or a RemoteEngine for model.backend = "remote"


def _error_code(err: BaseException) -> str:
    code = getattr(err, "code", None)
    return code if isinstance(code, str) else ErrorCode.ENGINE_ERROR.value


@dataclass(eq=False)
class Connection:
    id: int
    session: Session | None = None  # cleared when the connection closes (no cycle through the handlers)
    transport: str = "unix"  # unix | tcp
    uid: int | None = None
    authenticated: bool = True  # TCP connections start False until hello presents the token
    client: str = ""
    jobs: dict[int, Job] = field(default_factory=dict)  # msgid -> running complete


# -- the daemon ---------------------------------------------------------------------------------


def _completion_job(req: Any) -> Job:
    """The model work for one ``complete``; its closure is the only holder of ``req``."""
    return Job(fn=lambda engine, cancel: engine.complete(req, cancel).to_dict(),
               label=f"complete {req.uri or '<text>'}", key=req.uri)


class Daemon:
    def __init__(
        self,
        cfg: Any,
        *,
        engine_factory: Callable[[], CompletionEngine] | None = None,
        allowed_uid: int | None = None,
        idle_unload_s: float | None = None,
        tcp: str | None = None,
    ):
        self.cfg = cfg
        self.socket_path = Path(cfg.socket_path)
        self.max_frame_bytes = cfg["daemon.max_frame_bytes"]
        self.max_connections = cfg["daemon.max_connections"]
        self.tcp_spec = cfg["daemon.tcp"] if tcp is None else tcp
        self.tcp_token = cfg["daemon.tcp_token"]
        self.allowed_uid = os.getuid() if allowed_uid is None else allowed_uid
        self.buffers = BufferStore(cfg["daemon.max_documents"], cfg["daemon.max_document_bytes"])
        idle = cfg["daemon.idle_unload_s"] if idle_unload_s is None else idle_unload_s
        self.worker = ModelWorker(engine_factory or (lambda: load_engine(cfg)), idle, self._on_worker_state)
        self.mirror = DocumentMirror(lambda: self.worker.engine, self.worker.wake)
        self.workspace = Workspace(WorkspaceOptions.from_config(cfg), self._corpus_sink, self.worker.wake)
        self.completions = CompletionQueue(self.worker.submit, max_queued_chars=max(self.max_frame_bytes, self.buffers.max_document_bytes))
        self.connections: dict[int, Connection] = {}
        # One lock per document in use: a change applied in steps, and the requests after it on
        # that document, keep their order (asyncio locks are FIFO; uncontended, they cost nothing).
        self._document_locks: dict[str, tuple[asyncio.Lock, int]] = {}
        self._off_loop = 0  # requests waiting on a thread for something (engine stats)
        self._engine_figures = EngineFigures(ENGINE_FIGURES_MAX_AGE_S)
        # Per-connection limits, read when a connection starts (tests shorten them).
        self.partial_message_timeout_s = session_limits.PARTIAL_MESSAGE_TIMEOUT_S
        self.hello_deadline_s = HELLO_DEADLINE_S
        self._auth_failures = 0
        self._last_auth_failure = 0.0
        self._ids = itertools.count(1)
        self.jobs_by_uri: dict[str, Job] = {}
        self.latency = LatencyWindow()
        self.counts = collections.Counter()
        self.started_at = time.time()
        self.shutting_down = False
        self.exit_code = 0
        self._stop = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._servers: list[asyncio.base_events.Server] = []
        self._bound_socket: tuple[Path, int] | None = None  # (path, inode) we must remove at exit
        self._lock = RuntimeLock(self.socket_path)
        self._ready_announced = False
        self.handlers: dict[str, Callable[[Connection, dict[str, Any], Request], Awaitable[Any]]] = {
            Method.HELLO: self.hello,
            Method.OPEN: self.open_document,
            Method.CHANGE: self.change_document,
            Method.CLOSE: self.close_document,
            Method.COMPLETE: self.complete,
            Method.CANCEL: self.cancel,
            Method.STATUS: self.status,
            Method.SHUTDOWN: self.shutdown,
            Method.WORKSPACE: self.workspace_folders,
        }

    # -- lifecycle -------------------------------------------------------------------------

    def _listeners(self, activated: list[socket.socket]) -> list[socket.socket]:
        unix = [s for s in activated if s.family == socket.AF_UNIX]
        inet = [s for s in activated if s.family in (socket.AF_INET, socket.AF_INET6)]
        if self.tcp_spec and not inet and not self.tcp_token:  # refuse before binding anything
            raise StartupError("daemon.tcp is set but daemon.tcp_token is empty; a TCP listener needs a token")
        bound: list[socket.socket] = []
        try:
            if not unix:
                sock = bind_unix(self.socket_path)
                bound.append(sock)
                self._bound_socket = (self.socket_path, self.socket_path.stat().st_ino)
                unix = [sock]
            if self.tcp_spec and not inet:
                inet = [bind_tcp(self.tcp_spec)]
        except BaseException:
            for sock in bound:
                sock.close()
            self._remove_socket_file()
            raise
        for sock in unix + inet:
            sock.setblocking(False)
        return unix + inet

    async def run(self, activated: list[socket.socket] | None = None) -> int:
        """Serve until SIGTERM/SIGINT or the shutdown method; return the exit code."""
        self._loop = asyncio.get_running_loop()
        activated = systemd.listen_fds() if activated is None else activated
        if not any(s.family == socket.AF_UNIX for s in activated):
            self._lock.acquire()  # under socket activation systemd guarantees one instance
        try:
            listeners = self._listeners(activated)
        except BaseException:
            self._lock.release()
            raise
        for sock in listeners:
            if sock.family == socket.AF_UNIX:
                server = await asyncio.start_unix_server(self._accept_unix, sock=sock)
            else:
                server = await asyncio.start_server(self._accept_tcp, sock=sock)
            self._servers.append(server)
        if threading.current_thread() is threading.main_thread():  # in-process tests run it on a thread
            for signum in (signal.SIGTERM, signal.SIGINT):
                self._loop.add_signal_handler(signum, self.request_stop, f"signal {signal.Signals(signum).name}")
        log.info("listening on %s%s (pid %d)", self.socket_path, " (socket-activated)" if activated else "", os.getpid())
        systemd.notify("STATUS=loading models")
        self.mirror.start()
        self.worker.start()
        self._configured_folders()
        watchdog = asyncio.create_task(self._watchdog())
        try:
            await self._stop.wait()
        finally:
            watchdog.cancel()
            await self._shutdown()
        return self.exit_code

    def request_stop(self, why: str = "shutdown", exit_code: int = 0) -> None:
        if not self._stop.is_set():
            log.info("stopping: %s", why)
            self.exit_code = exit_code
        self._stop.set()

    def _on_worker_state(self, state: str) -> None:
        """Called on the worker thread; hop to the loop."""
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._state_changed, state)

    def _state_changed(self, state: str) -> None:
        if state == READY:
            systemd.notify("STATUS=ready")
            if not self._ready_announced:
                self._ready_announced = True
                systemd.notify("READY=1")
                log.info("models loaded in %.1f s; ready", self.worker.load_seconds or 0.0)
                self.mirror.replay({uri: doc.text for uri, doc in self.buffers.docs.items()})
                self.workspace.replay()
        elif state == FAILED:
            self.completions.fail_all(self._load_failure())
            self.worker.fail_queued(self._load_failure())
            # One line, whatever the exception held: it is what `specd serve`, the spawn log and
            # systemd's STATUS= show.
            message = " ".join(f"cannot load models: {self.worker.load_error}".split())
            # One write of the whole line: print() writes the text and the newline separately, and
            # the model thread's log record could land between them (CI saw the two on one line).
            sys.stderr.write(f"specd: {message}\n")
            sys.stderr.flush()
            systemd.notify(f"STATUS={message}")
            self.request_stop("model load failed", exit_code=1)
        elif state == LOADING:
            systemd.notify("STATUS=loading models")
        else:
            systemd.notify(f"STATUS={state}")

    async def _watchdog(self) -> None:
        interval = systemd.watchdog_interval()
        if interval is None:
            return
        while True:
            # The ping says "the loop turns and the model thread lives"; a wedged loop stops it.
            if self.worker.is_alive() or self.worker.state in (STARTING, LOADING):
                systemd.notify("WATCHDOG=1")
            await asyncio.sleep(interval)

    async def _shutdown(self) -> None:
        self.shutting_down = True
        systemd.notify("STOPPING=1")
        for server in self._servers:
            server.close()
        self._remove_socket_file()
        # Queued work is refused now; the running completion gets a bounded time to finish.
        self.completions.fail_all(self._load_failure())
        self.worker.fail_queued(self._load_failure())
        current = self.worker.current
        if current is not None:
            budget_s = self.cfg["engine.time_budget_ms"] / 1000 + SHUTDOWN_GRACE_S
            await asyncio.wait([asyncio.wrap_future(current.future)], timeout=budget_s)
            current.request_cancel("the daemon is shutting down")
        sessions = [c.session for c in self.connections.values() if c.session is not None]
        if sessions:
            await asyncio.wait([asyncio.create_task(s.wait_answered()) for s in sessions], timeout=5)
        for session in sessions:
            await session.close()
        await asyncio.to_thread(self.worker.stop, 10)
        self.mirror.stop()
        await asyncio.to_thread(self.workspace.stop)
        self._lock.release()
        log.info("stopped")

    def _remove_socket_file(self) -> None:
        """Remove the socket we bound, unless something else has replaced it meanwhile."""
        if self._bound_socket is None:
            return  # socket-activated: systemd owns the file
        path, inode = self._bound_socket
        try:
            if path.stat().st_ino == inode:
                path.unlink()
        except FileNotFoundError:
            pass
        self._bound_socket = None

    # -- connections -----------------------------------------------------------------------

    async def _accept_unix(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        sock = writer.get_extra_info("socket")
        uid = peer_uid(sock) if sock is not None else None
        if uid is not None and uid != self.allowed_uid:
            log.warning("refused a connection from uid %s (serving uid %s)", uid, self.allowed_uid)
            await self._refuse(reader, writer, RpcError(ErrorCode.UNAUTHORIZED, f"uid {uid} may not use this daemon"))
            return
        await self._serve(reader, writer, Connection(next(self._ids), transport="unix", uid=uid))

    async def _accept_tcp(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await self._serve(reader, writer, Connection(next(self._ids), transport="tcp", authenticated=False))

    async def _refuse(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, error: RpcError) -> None:
        """Say why in one error notification, then close without serving anything."""
        try:
            writer.write(pack(Notification(ERROR_NOTIFICATION, error.to_wire()).to_wire()))
        except (ConnectionError, OSError, RuntimeError):
            pass
        await linger_close(reader, writer)

    def _authenticated_count(self) -> int:
        return sum(1 for conn in self.connections.values() if conn.authenticated)

    def _too_many(self) -> RpcError:
        return RpcError(
            ErrorCode.TOO_MANY_CONNECTIONS,
            f"{self._authenticated_count()} clients are connected, the limit (daemon.max_connections)",
        )

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, conn: Connection) -> None:
        if self.shutting_down:
            # A client that connects while the daemon stops because its models failed to load
            # (the one that spawned it, typically) is told why, not only that it stops.
            await self._refuse(reader, writer, self._load_failure()
                               or RpcError(ErrorCode.SHUTTING_DOWN, "the daemon is shutting down"))
            return
        if conn.authenticated and self._authenticated_count() >= self.max_connections:
            await self._refuse(reader, writer, self._too_many())
            return
        if not conn.authenticated and len(self.connections) - self._authenticated_count() >= MAX_PREAUTH_CONNECTIONS:
            await self._refuse(reader, writer, RpcError(
                ErrorCode.TOO_MANY_CONNECTIONS, f"{MAX_PREAUTH_CONNECTIONS} connections are waiting to authenticate, the limit",
            ))
            return
        session = conn.session = Session(
            reader, writer,
            max_frame_bytes=self.max_frame_bytes,
            handler=lambda request: self._dispatch(conn, request),
            on_notification=lambda note: self._notification(conn, note),
            on_eof=lambda: self._disconnected(conn),
            name=f"conn{conn.id}",
            partial_message_timeout_s=self.partial_message_timeout_s,
        )
        deadline = None
        if not conn.authenticated:
            session.frame_limit = min(PREAUTH_MAX_FRAME_BYTES, self.max_frame_bytes)
            deadline = asyncio.get_running_loop().call_later(self.hello_deadline_s, self._hello_overdue, conn)
        self.connections[conn.id] = conn
        log.debug("conn%d: connected (%s, uid %s)", conn.id, conn.transport, conn.uid)
        try:
            await session.run()
        finally:
            if deadline is not None:
                deadline.cancel()
            self.connections.pop(conn.id, None)
            for uri in self.buffers.release_owner(conn.id):
                self.mirror.close(uri)
            self.workspace.release_owner(conn.id)
            # Break Connection -> Session -> handler closures -> Connection, so a closed
            # connection is freed by reference counting, not at the next full collection.
            session.release_callbacks()
            conn.session = None
            conn.jobs.clear()
            log.debug("conn%d: closed", conn.id)

    def _hello_overdue(self, conn: Connection) -> None:
        session = conn.session
        if conn.authenticated or session is None:
            return
        log.info("conn%d: no hello with the token within %g s; closing", conn.id, self.hello_deadline_s)
        session.close_reason = RpcError(ErrorCode.UNAUTHORIZED, f"no hello with the token within {self.hello_deadline_s:g} s")

        async def say_why_and_close() -> None:
            try:
                await asyncio.wait_for(session.send_error_notification(session.close_reason), 1.0)
            finally:
                await session.close()

        task = asyncio.ensure_future(say_why_and_close())
        task.add_done_callback(lambda done: done.cancelled() or done.exception())  # a failed write is no news

    def _disconnected(self, conn: Connection) -> None:
        for job in list(conn.jobs.values()):
            job.request_cancel("the client disconnected")
            self.completions.discard(job)

    async def _dispatch(self, conn: Connection, request: Request) -> Any:
        handler = self.handlers.get(request.method)
        if handler is None:
            raise RpcError(ErrorCode.METHOD_NOT_FOUND, f"no method {request.method!r}; known: {', '.join(m.value for m in Method)}")
        if not conn.authenticated and request.method != Method.HELLO:
            raise RpcError(ErrorCode.UNAUTHORIZED, "send hello with the token first (TCP connections need daemon.tcp_token)")
        if self.shutting_down and request.method not in (Method.STATUS, Method.HELLO):
            # Stopping because the models failed to load: say why (the client that spawned it
            # asked exactly once, and "shutting down" would hide the cause).
            raise self._load_failure() or RpcError(ErrorCode.SHUTTING_DOWN, "the daemon is shutting down")
        return await handler(conn, request.params, request)

    async def _notification(self, conn: Connection, note: Notification) -> None:
        # Notifications have no answer; only cancel makes sense as one (Neovim's rpcnotify).
        if note.method == Method.CANCEL and conn.authenticated:
            await self.cancel(conn, note.params, None)
        else:
            log.debug("conn%d: ignored notification %s", conn.id, note.method)

    # -- methods ---------------------------------------------------------------------------

    def _models(self) -> dict[str, Any]:
        return {"target": self.cfg["model.target"] or "demo", "draft": self.cfg["model.draft"] or None}

    async def _authenticate(self, conn: Connection, token: Any) -> None:
        """Check a TCP connection's token; a wrong one is answered late and the connection closed."""
        if isinstance(token, str) and hmac.compare_digest(token.encode(), self.tcp_token.encode()):
            if self._authenticated_count() >= self.max_connections:
                self._close_soon(conn)
                raise self._too_many()
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
            asyncio.get_running_loop().call_later(0.05, lambda: asyncio.ensure_future(session.close()))

    async def hello(self, conn: Connection, params: dict[str, Any], request: Request | None) -> dict[str, Any]:
        if conn.transport == "tcp" and not conn.authenticated:
            await self._authenticate(conn, params.get("token"))
        client = params.get("client")
        conn.client = client if isinstance(client, str) else ""
        errors = params.get("errors", "map")
        if errors not in ERROR_FORMATS:
            raise RpcError(ErrorCode.INVALID_PARAMS, f"errors must be one of {', '.join(ERROR_FORMATS)}")
        if conn.session is not None:
            conn.session.encode_error = RpcError.to_text if errors == "string" else RpcError.to_wire
        return {
            "server": "specd",
            "version": __version__,
            "protocol": PROTOCOL_VERSION,
            "pid": os.getpid(),
            "capabilities": list(CAPABILITIES),
            "methods": [m.value for m in Method],
            "position_encodings": list(POSITION_ENCODINGS),
            "error_formats": list(ERROR_FORMATS),
            "models": await self._model_names(),
            "state": self.worker.state,
            "limits": {
                "max_frame_bytes": self.max_frame_bytes,
                "max_document_bytes": self.buffers.max_document_bytes,
                "max_documents": self.buffers.max_documents,
                "max_connections": self.max_connections,
                "max_uri_chars": MAX_URI_CHARS,
                "max_queued_per_connection": self.completions.max_per_connection,
                "partial_message_timeout_s": self.partial_message_timeout_s,
            },
        }

    @contextlib.asynccontextmanager
    async def _document(self, uri: str) -> AsyncIterator[None]:
        """Hold ``uri`` for one request, after the requests on it that came before."""
        lock, users = self._document_locks.get(uri) or (asyncio.Lock(), 0)
        self._document_locks[uri] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            lock, users = self._document_locks[uri]
            if users == 1:
                del self._document_locks[uri]
            else:
                self._document_locks[uri] = (lock, users - 1)

    async def open_document(self, conn: Connection, params: dict[str, Any], request: Request | None) -> dict[str, Any]:
        uri = get_uri(params)
        text = get_str(params, "text")
        version = get_int(params, "version", 0, 2**63 - 1) or 0
        language = get_str(params, "language", required=False)
        async with self._document(uri):
            self.buffers.check_size(text, uri)
            index = await index_in_steps(text)  # a large text's line index, built without stalling the loop
            doc = self.buffers.open(uri, text, version, conn.id, language)
            doc._index = index
        self.mirror.set(uri, doc.text)
        return {"uri": uri, "version": doc.version}

    async def change_document(self, conn: Connection, params: dict[str, Any], request: Request | None) -> dict[str, Any]:
        uri = get_uri(params)
        version = get_int(params, "version", 0, 2**63 - 1)
        text = get_str(params, "text", required=False)
        edits = params.get("edits")
        if (text is None) == (edits is None):
            raise param_error("change needs exactly one of text (full) or edits (ranged)")
        if edits is not None and not isinstance(edits, list):
            raise param_error("edits must be an array")
        encoding = check_encoding(params.get("encoding"))
        async with self._document(uri):
            doc = self.buffers.changeable(uri, version)
            if text is not None:
                self.buffers.check_size(text, uri)
                index = await index_in_steps(text)
            else:
                index = doc.index
                loop = asyncio.get_running_loop()
                step_ends = loop.time() + EDIT_STEP_S
                for number in range(len(edits)):
                    if loop.time() > step_ends:
                        await self._serve_others()
                        step_ends = loop.time() + EDIT_STEP_S
                    index = edit_index(index, edits[number:number + 1], encoding, number)
            doc = self.buffers.commit(doc, index, version)
            cursor = None if edits is None else last_edit_end(index, edits, encoding)
        self.mirror.set(uri, doc.text, cursor)  # idle prefill warms the cache where the user types
        return {"uri": uri, "version": doc.version}

    async def _serve_others(self) -> None:
        """Between two steps of a long change: a few loop turns for other clients' requests,
        and a short sleep while one of them waits on a thread (see EDIT_STEP_S)."""
        for _turn in range(EDIT_YIELD_TURNS):
            await asyncio.sleep(0)
        if self._off_loop:
            await asyncio.sleep(EDIT_PAUSE_S)

    async def close_document(self, conn: Connection, params: dict[str, Any], request: Request | None) -> dict[str, Any]:
        uri = get_uri(params)
        async with self._document(uri):
            closed = self.buffers.close(uri, conn.id)
        if closed:
            self.mirror.close(uri)
            job = self.jobs_by_uri.get(uri)
            if job is not None:
                job.request_cancel("the document was closed")
        return {"uri": uri, "closed": closed}

    async def _completion_request(self, params: dict[str, Any]) -> tuple[Any, int | None]:
        from specd.engine.types import CompletionRequest, ContextChunk

        uri = get_uri(params, required=False)
        text = get_str(params, "text", required=False)
        version = None
        if text is None:
            if uri is None:
                raise param_error("complete needs uri (an open document) or text")
            doc = self.buffers.get(uri)
            text, version, index = doc.text, doc.version, doc.index
        else:
            self.buffers.check_size(text, "text")
            cursor = params.get("cursor")
            needs_lines = isinstance(cursor, dict) and "line" in cursor
            index = await index_in_steps(text) if needs_lines else TextIndex(text)
        if "cursor" not in params:
            raise param_error("complete needs a cursor")
        offset = resolve_cursor(index, params["cursor"], params.get("encoding"))
        extra = params.get("extra_context") or []
        if not isinstance(extra, list):
            raise param_error("extra_context must be an array of {path, text}")
        chunks = []
        for number, item in enumerate(extra):
            if not isinstance(item, dict):
                raise param_error(f"extra_context[{number}] must be a map {{path, text}}")
            chunk_text = get_str(item, "text")
            self.buffers.check_size(chunk_text, f"extra_context[{number}]")
            chunks.append(ContextChunk(path=get_uri(item, "path"), text=chunk_text))
        request = CompletionRequest(
            uri=uri,
            text=text,
            offset=offset,
            path=get_uri(params, "path", required=False),
            extra_context=chunks,
            **completion_options(params.get("options")),
        )
        return request, version

    async def complete(self, conn: Connection, params: dict[str, Any], request: Request | None) -> dict[str, Any]:
        uri = params.get("uri")
        if isinstance(uri, str) and params.get("text") is None:  # the open document, after changes before it
            async with self._document(get_uri(params)):
                req, version = await self._completion_request(params)
        else:
            req, version = await self._completion_request(params)
        if (failure := self._load_failure()) is not None:
            raise failure
        received = time.monotonic()
        msgid = request.msgid if request is not None else 0
        uri, offset = req.uri, req.offset
        # Text this job keeps alive while it waits: a stateless text, or a document snapshot
        # that a later change would otherwise have released.
        held = len(req.text) + sum(len(chunk.text) for chunk in req.extra_context)
        job = _completion_job(req)
        del req  # only the job holds the request now: dropping the job drops its text
        if uri is not None:
            previous = self.jobs_by_uri.get(uri)
            if previous is not None:
                previous.request_cancel(f"superseded by a newer complete for {uri}")
                self.completions.discard(previous)
                self.counts["superseded"] += 1
        self.completions.put(conn.id, job, held)
        if uri is not None:
            self.jobs_by_uri[uri] = job
        conn.jobs[msgid] = job
        try:
            result = await asyncio.wrap_future(job.future)
        except (asyncio.CancelledError, Exception) as err:
            if isinstance(err, asyncio.CancelledError):  # this request's task was cut (connection closing)
                job.request_cancel(job.cancel_reason or "the request was cancelled")
            self.counts["cancelled" if job.cancel.is_set() else "failed"] += 1
            if job.cancel.is_set() or isinstance(err, asyncio.CancelledError) or _error_code(err) == ErrorCode.CANCELLED:
                raise RpcError(ErrorCode.CANCELLED, job.cancel_reason or "cancelled") from None
            if isinstance(err, RpcError):
                raise
            raise RpcError(_error_code(err), str(err) or type(err).__name__) from None
        finally:
            self._engine_figures.invalidate()  # its requests, acceptance, errors are in the next status
            self.completions.discard(job)
            conn.jobs.pop(msgid, None)
            if job.key is not None and self.jobs_by_uri.get(job.key) is job:
                del self.jobs_by_uri[job.key]
        done = time.monotonic()
        self.latency.add((done - received) * 1000)
        self.counts["completed"] += 1
        started = job.started_at or received
        result.update(
            uri=uri,
            version=version,
            offset=offset,
            queued_ms=round((started - received) * 1000, 2),
            latency_ms=round((done - received) * 1000, 2),
        )
        return result

    async def cancel(self, conn: Connection, params: dict[str, Any], request: Request | None) -> dict[str, Any]:
        msgid = get_int(params, "msgid", 0, 2**32 - 1)
        uri = get_uri(params, required=False)
        if msgid is None and uri is None:
            raise RpcError(ErrorCode.INVALID_PARAMS, "cancel needs msgid (of a complete on this connection) or uri")
        targets = []
        if msgid is not None and msgid in conn.jobs:
            targets.append(conn.jobs[msgid])
        if uri is not None and uri in self.jobs_by_uri:
            targets.append(self.jobs_by_uri[uri])
        for job in targets:
            job.request_cancel("cancelled by the client")
            self.completions.discard(job)
        return {"cancelled": len(targets)}

    async def status(self, conn: Connection, params: dict[str, Any], request: Request | None) -> dict[str, Any]:
        engine_stats = await self._engine_stats()
        models = engine_stats.get("models") if isinstance(engine_stats.get("models"), dict) else self._models()
        current = self.worker.current
        out = {
            "state": self.worker.state,
            "pid": os.getpid(),
            "version": __version__,
            "protocol": PROTOCOL_VERSION,
            "socket": str(self.socket_path),
            "uptime_s": round(time.time() - self.started_at, 1),
            "loaded_at": self.worker.loaded_at,
            "load_seconds": self.worker.load_seconds,
            "idle_unload_s": self.worker.idle_unload_s,
            "models": models,
            "device": engine_stats.get("device", models.get("device")),
            "dtype": engine_stats.get("dtype", models.get("dtype")),
            "memory": {**process_memory(), **device_memory()},
            "cache": engine_stats.get("cache"),
            "acceptance": engine_stats.get("acceptance"),
            "latency_ms": self.latency.summary(),
            "requests": {
                "completed": self.counts["completed"],
                "cancelled": self.counts["cancelled"],
                "failed": self.counts["failed"],
                "superseded": self.counts["superseded"],
                "queued": len(self.completions) + self.worker.queued(),
                "running": current.label if current is not None else None,
            },
            "documents": {"open": len(self.buffers), "chars": self.buffers.total_chars()},
            "workspace": {**self.workspace.stats(), "index": engine_stats.get("workspace")},
            "connections": len(self.connections),
            "engine": engine_stats,
        }
        if self.worker.load_error is not None:
            out["last_error"] = str(self.worker.load_error)
        return out

    async def _engine_stats(self) -> dict[str, Any]:
        engine = self.worker.engine
        if engine is None:
            return {}
        source = (engine, self.worker.state)  # figures taken before a load or a release are not reused
        if (figures := self._engine_figures.fresh(source)) is not None:
            return figures
        error: Exception | None = None
        for _attempt in range(2):  # stats() reads counters the worker may be updating: retry once
            self._off_loop += 1
            token = self._engine_figures.begin()
            try:  # off the loop: stats may walk caches, and call torch
                stats = await asyncio.wait_for(asyncio.to_thread(engine.stats), timeout=5)
                figures = stats if isinstance(stats, dict) else {"stats": stats}
                self._engine_figures.keep(token, source, figures)
                return figures
            except Exception as err:
                error = err
            finally:
                self._off_loop -= 1
        return {"error": f"{type(error).__name__}: {error}"}

    async def _model_names(self) -> dict[str, Any]:
        models = (await self._engine_stats()).get("models")
        if isinstance(models, dict) and "target" in models:
            return {"target": models.get("target"), "draft": models.get("draft")}
        return self._models()

    def _load_failure(self) -> RpcError | None:
        if self.worker.state != FAILED:
            return None
        return RpcError(ErrorCode.MODEL_LOAD_ERROR, f"cannot load models: {self.worker.load_error}")

    # -- workspace -------------------------------------------------------------------------

    def _corpus_sink(self, path: str, text: str | None) -> bool:
        """The workspace watcher's output (on its thread): into the engine's lookup corpus."""
        engine = self.worker.engine
        if not isinstance(engine, CorpusEngine):
            return False
        engine.set_corpus_file(path, text)
        return True

    def _configured_folders(self) -> None:
        if not self.workspace.options.enabled:
            return
        for folder in filter(None, self.cfg["workspace.folders"].split(os.pathsep)):
            try:
                self.workspace.add(folder, owner=0)  # held for the daemon's life
            except OSError as err:
                log.warning("workspace.folders: %s", err)

    async def workspace_folders(self, conn: Connection, params: dict[str, Any], request: Request | None) -> dict[str, Any]:
        """Set (``folders``) or change (``add``/``remove``) the folders this connection works in.
        A folder is watched while any connection (or ``workspace.folders``) holds it."""
        replace, add, remove = (get_folders(params, name) for name in ("folders", "add", "remove"))
        if not self.workspace.options.enabled:
            return {"enabled": False, "folders": [], "watched": []}
        add, remove = [*(replace or []), *(add or [])], remove or []
        if replace is not None:
            wanted = {str(Path(folder).resolve()) for folder in replace}
            remove += [folder for folder in self.workspace.folders(conn.id) if folder not in wanted]
        missing = [folder for folder in add if not Path(folder).is_dir()]
        if missing:  # checked first: a failed call changes nothing
            raise RpcError(ErrorCode.INVALID_PARAMS, f"not a directory: {', '.join(missing)}")
        for folder in add:
            self.workspace.add(folder, owner=conn.id)
        for folder in remove:
            self.workspace.remove(folder, owner=conn.id)
        return {"enabled": True, "folders": self.workspace.folders(conn.id), "watched": self.workspace.folders()}

    async def shutdown(self, conn: Connection, params: dict[str, Any], request: Request | None) -> dict[str, Any]:
        # The graceful path waits for this very answer to be written before closing sessions.
        self.request_stop(f"shutdown requested by conn{conn.id}")
        return {"ok": True}


async def serve_forever(cfg: Any, **kwargs: Any) -> int:
    return await Daemon(cfg, **kwargs).run()
