"""The daemon: lifecycle, listeners, and the dispatch of each request to its handler.

One ``Daemon`` owns the listeners (a Unix socket, bound here or passed by systemd, and an
optional loopback TCP listener that needs a token), the model worker and the parts the
handlers share, and wires them together. Each connection passes ``admission`` (limits, uid,
token), then runs a ``Session`` whose requests go through one dispatch table keyed by
``Method``: a ``Route`` parses the params (``params``) and calls the handler (``handlers``).
The loop never waits on the model.

Around it: ``listeners`` (socket setup and file safety), ``admission`` (who may connect and
send what), ``params`` (all wire parsing), ``handlers`` (the methods), ``buffers`` (the open
documents), ``scheduler`` (admission and the order of the model's work), ``worker`` (the model
thread and the engine's copy of the documents), ``metrics`` (what status reports), ``engine_api`` (what an
engine must offer).

Limits, per connection: one message at most ``daemon.max_frame_bytes`` however it is streamed,
and complete within ``PARTIAL_MESSAGE_TIMEOUT_S`` once begun; answers left unread stop the
reading (``session.WRITE_HIGH_WATER``); TCP connections as ``admission`` says.
"""

from __future__ import annotations

import asyncio
import importlib
import itertools
import logging
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

from specd.daemon import systemd
from specd.daemon.admission import FIRST_MESSAGE_DEADLINE_S, HELLO_DEADLINE_S, Admission, Connection, refuse
from specd.daemon.buffers import BufferStore
from specd.daemon.engine_api import CompletionEngine
from specd.daemon.handlers import Route
from specd.daemon.handlers.completion import CompletionMethods
from specd.daemon.handlers.documents import DocumentLocks, DocumentMethods
from specd.daemon.handlers.folders import FolderMethods
from specd.daemon.handlers.status import ENGINE_FIGURES_MAX_AGE_S, EngineStats, StatusMethods
from specd.daemon.listeners import RuntimeLock, StartupError, bind_tcp, bind_unix, peer_uid
from specd.daemon.metrics import EngineFigures
from specd.daemon.params import (
    MAX_URI_CHARS,
    no_params,
    parse_cancel,
    parse_change,
    parse_close,
    parse_complete,
    parse_focus,
    parse_hello,
    parse_open,
    parse_workspace,
)
from specd.daemon.scheduler import Scheduler
from specd.daemon.worker import FAILED, LOADING, READY, STARTING, DocumentMirror, ModelWorker
from specd.daemon.workspace import Workspace, WorkspaceOptions
from specd.protocol import session as session_limits
from specd.protocol.errors import ErrorCode, RpcError
from specd.protocol.messages import Notification, Request
from specd.protocol.methods import Method
from specd.protocol.session import Session

__all__ = ["Daemon", "StartupError", "serve_forever"]

log = logging.getLogger("specd.daemon")

# Test hook: "module:callable" building the engine from the config instead of specd.engine.
ENGINE_FACTORY_ENV = "SPECD_TEST_ENGINE_FACTORY"

SHUTDOWN_GRACE_S = 10.0  # beyond the time budget, how long a running completion may finish
SESSIONS_GRACE_S = 5.0  # how long answers already due may take to be written at shutdown
# Once every client is answered, how long the model, mirror and workspace threads get to stop
# before a process started with ``exit_hard`` ends regardless (a load stuck in a progress bar's
# lock, or in a driver, must not keep a stopped daemon alive).
THREADS_GRACE_S = 2.0
# The serving process's GIL switch interval (Python's default is 5 ms). The loop, the model
# worker and the document mirror all need the GIL; a request answered on the loop while the
# worker runs Python between its forwards waits up to one interval at each hand-over, so a
# shorter one keeps `status` and the socket within a millisecond or two of idle.
SWITCH_INTERVAL_S = 0.001
# A connection that sent a request this recently is being served: large documents' updates to
# the engine wait (``worker.DocumentMirror``) while connections other than their sender are.
OTHERS_ACTIVE_S = 0.5
NOTIFIABLE = (Method.CANCEL, Method.FOCUS)  # methods a client may send as notifications


def exit_hard_after(seconds: float, exit_code: Callable[[], int]) -> threading.Timer:
    """End the process ``seconds`` from now with ``os._exit``: no lock, atexit hook or thread
    join can hold it. A daemon thread, so a process that ends sooner is not kept waiting."""
    def _exit() -> None:
        os._exit(exit_code())

    timer = threading.Timer(seconds, _exit)
    timer.daemon = True
    timer.name = "specd-hard-exit"
    timer.start()
    return timer


def load_engine(cfg: Any) -> CompletionEngine:
    hook = os.environ.get(ENGINE_FACTORY_ENV)
    if hook:
        module_name, _, attr = hook.partition(":")
        return getattr(importlib.import_module(module_name), attr)(cfg)
    from specd.engine.loading import load_engine as load  # torch and transformers load here, in the worker thread

    return load(cfg)  # the resident pair, or a RemoteEngine for model.backend = "remote"


class Daemon:
    """One concern: the daemon's lifecycle. It builds and wires the parts (listeners, admission,
    scheduler, worker, mirror, workspace, handlers), starts them, serves each connection through
    the dispatch table, and stops them in order; the work itself is the parts'."""

    def __init__(
        self,
        cfg: Any,
        *,
        engine_factory: Callable[[], CompletionEngine] | None = None,
        allowed_uid: int | None = None,
        idle_unload_s: float | None = None,
        tcp: str | None = None,
        exit_hard: bool = False,
    ):
        """``exit_hard``: this is the serving process (``specd serve``), which a stop must end in
        bounded time; in-process daemons (tests) leave their process alone."""
        self.cfg = cfg
        self.exit_hard = exit_hard
        self.socket_path = Path(cfg.socket_path)
        self.max_frame_bytes = cfg["daemon.max_frame_bytes"]
        self.tcp_spec = cfg["daemon.tcp"] if tcp is None else tcp
        self.tcp_token = cfg["daemon.tcp_token"]
        self.buffers = BufferStore(cfg["daemon.max_documents"], cfg["daemon.max_document_bytes"],
                                   cfg["daemon.max_open_bytes"], cfg["daemon.max_open_bytes_per_connection"])
        idle = cfg["daemon.idle_unload_s"] if idle_unload_s is None else idle_unload_s
        self.scheduler = Scheduler(max_queued_chars=max(self.max_frame_bytes, self.buffers.max_document_bytes))
        self.worker = ModelWorker(engine_factory or (lambda: load_engine(cfg)), self.scheduler, idle,
                                  self._on_worker_state)
        self.mirror = DocumentMirror(self.worker, self._serving_others)
        self._last_request: dict[int, float] = {}  # connection id -> when its last request came (monotonic)
        self.workspace = Workspace(WorkspaceOptions.from_config(cfg), self.worker.set_corpus_file, self.worker.wake)
        self.connections: dict[int, Connection] = {}
        self.admission = Admission(
            self.connections, allowed_uid=os.getuid() if allowed_uid is None else allowed_uid,
            max_connections=cfg["daemon.max_connections"], max_frame_bytes=self.max_frame_bytes, tcp_token=self.tcp_token,
        )
        # Per-connection limits, read when a connection starts (tests shorten them).
        self.partial_message_timeout_s = session_limits.PARTIAL_MESSAGE_TIMEOUT_S
        self.hello_deadline_s = HELLO_DEADLINE_S
        self.first_message_deadline_s = FIRST_MESSAGE_DEADLINE_S
        self._document_locks = DocumentLocks()
        self._engine_figures = EngineFigures(ENGINE_FIGURES_MAX_AGE_S)
        engine_stats = EngineStats(self.worker, self._engine_figures)
        self.completion = CompletionMethods(self.buffers, self._document_locks, self.scheduler,
                                            load_failure=self.worker.load_failure, on_finished=self._engine_figures.invalidate,
                                            max_tokens_cap=cfg["daemon.max_tokens_cap"],
                                            default_max_tokens=cfg["engine.max_tokens"],
                                            on_document_request=self.mirror.flush)
        # A status fetching figures, a completion's steps on the model thread, or one admitted
        # while the worker finishes a piece of idle work it then waits for: all need the GIL the
        # loop would hold, so long edits and large messages go slower meanwhile.
        self._waiting_on_thread = lambda: (engine_stats.waiting > 0 or self.worker.current is not None
                                           or len(self.scheduler) > 0)
        self.documents = DocumentMethods(self.buffers, self._document_locks, self.mirror,
                                         on_closed=self.completion.document_closed,
                                         waiting_on_thread=self._waiting_on_thread)
        self.status = StatusMethods(cfg, socket_path=self.socket_path, worker=self.worker, buffers=self.buffers,
                                    completions=self.scheduler, completion=self.completion, workspace=self.workspace,
                                    connections=self.connections, engine=engine_stats, limits=self.limits,
                                    focus_counts=self.documents.focus_counts)
        self.folders = FolderMethods(self.workspace)
        self.methods: dict[str, Route] = {
            Method.HELLO: Route(parse_hello, self.status.hello),
            Method.OPEN: Route(parse_open, self.documents.open),
            Method.CHANGE: Route(parse_change, self.documents.change),
            Method.CLOSE: Route(parse_close, self.documents.close),
            Method.COMPLETE: Route(parse_complete, self.completion.complete),
            Method.CANCEL: Route(parse_cancel, self.completion.cancel),
            Method.STATUS: Route(no_params, self.status.status),
            Method.SHUTDOWN: Route(no_params, self.shutdown),
            Method.WORKSPACE: Route(parse_workspace, self.folders.workspace_folders),
            Method.FOCUS: Route(parse_focus, self.documents.focus),
        }
        self._ids = itertools.count(1)
        self.shutting_down = False
        self.exit_code = 0
        self._stop = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._servers: list[asyncio.base_events.Server] = []
        self._bound_socket: tuple[Path, int] | None = None  # (path, inode) we must remove at exit
        self._lock = RuntimeLock(self.socket_path)
        self._ready_announced = False

    def _serving_others(self, owner: int | None) -> bool:
        """A completion runs on the model thread or waits for it, or a connection other than
        ``owner`` sent a request in the last OTHERS_ACTIVE_S. Read from the document mirror's
        thread: each read is one attribute, one ``len`` or one copy of a dict, atomic under the GIL."""
        if self.worker.current is not None or len(self.scheduler) > 0:
            return True
        since = time.monotonic() - OTHERS_ACTIVE_S
        return any(conn != owner and at > since for conn, at in list(self._last_request.items()))

    def limits(self) -> dict[str, Any]:
        """The limits a client must keep to, as hello reports them."""
        return {
            "max_frame_bytes": self.max_frame_bytes,
            "max_document_bytes": self.buffers.max_document_bytes,
            "max_documents": self.buffers.max_documents,
            "max_open_bytes": self.buffers.max_open_bytes,
            "max_open_bytes_per_connection": self.buffers.max_open_bytes_per_connection,
            "max_connections": self.admission.max_connections,
            "max_uri_chars": MAX_URI_CHARS,
            "max_queued_per_connection": self.scheduler.max_per_connection,
            "max_tokens_cap": self.completion.max_tokens_cap,
            "partial_message_timeout_s": self.partial_message_timeout_s,
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
        if self.exit_hard:  # the serving process owns its interpreter; in-process tests keep theirs
            sys.setswitchinterval(SWITCH_INTERVAL_S)
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
        self.folders.add_configured(self.cfg["workspace.folders"])
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
            if self.exit_hard:  # the backstop: every wait of the graceful path, then the threads'
                budget_s = self.cfg["engine.time_budget_ms"] / 1000 + SHUTDOWN_GRACE_S
                exit_hard_after(budget_s + SESSIONS_GRACE_S + THREADS_GRACE_S + 1.0, lambda: self.exit_code)
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
                self.mirror.replay(self.buffers.texts())
                self.workspace.replay()
        elif state == FAILED:
            self.scheduler.fail_all(self.worker.load_failure())
            # One line, whatever the exception held: it is what `specd serve`, the spawn log and
            # systemd's STATUS= show.
            message = " ".join(f"cannot load models: {self.worker.load_error}".split())
            # One write of the whole line: print() writes the text and the newline separately, and
            # the model thread's log record could land between them.
            try:
                sys.stderr.write(f"specd: {message}\n")
                sys.stderr.flush()
            except OSError:  # stderr on a full disk: status still tells it, and the stop goes on
                pass
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
        # Queued work is refused now; the started completions get a bounded time to finish.
        self.scheduler.fail_all(self.worker.load_failure())
        started = self.scheduler.started()
        if started:
            budget_s = self.cfg["engine.time_budget_ms"] / 1000 + SHUTDOWN_GRACE_S
            await asyncio.wait([asyncio.wrap_future(job.future) for job in started], timeout=budget_s)
            for job in started:
                job.request_cancel("the daemon is shutting down")
        sessions = [c.session for c in self.connections.values() if c.session is not None]
        if sessions:
            await asyncio.wait([asyncio.create_task(s.wait_answered()) for s in sessions], timeout=SESSIONS_GRACE_S)
        for session in sessions:
            await session.close()
        if self.exit_hard:  # every client has its answer: the threads get a short bound
            exit_hard_after(THREADS_GRACE_S, lambda: self.exit_code)
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
        if (refusal := self.admission.peer_refusal(uid)) is not None:
            await refuse(reader, writer, refusal)
            return
        await self._serve(reader, writer, Connection(next(self._ids), transport="unix", uid=uid))

    async def _accept_tcp(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await self._serve(reader, writer, Connection(next(self._ids), transport="tcp", authenticated=False))

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, conn: Connection) -> None:
        if self.shutting_down:
            # A client that connects while the daemon stops because its models failed to load
            # (the one that spawned it, typically) is told why, not only that it stops.
            await refuse(reader, writer, self.worker.load_failure()
                         or RpcError(ErrorCode.SHUTTING_DOWN, "the daemon is shutting down"))
            return
        if (refusal := self.admission.refusal(conn)) is not None:
            await refuse(reader, writer, refusal)
            return
        session = conn.session = Session(
            reader, writer,
            max_frame_bytes=self.max_frame_bytes,
            handler=lambda request: self._dispatch(conn, request),
            on_notification=lambda note: self._notification(conn, note),
            on_eof=lambda: self.completion.disconnected(conn),
            name=f"conn{conn.id}",
            partial_message_timeout_s=self.partial_message_timeout_s,
            yield_to_others=self._waiting_on_thread,
        )
        self.admission.admit(conn, self.hello_deadline_s, self.first_message_deadline_s)
        log.debug("conn%d: connected (%s, uid %s)", conn.id, conn.transport, conn.uid)
        try:
            await session.run()
        finally:
            self.admission.leave(conn)
            self._last_request.pop(conn.id, None)
            self.documents.release(conn)
            self.workspace.release_owner(conn.id)
            # Break Connection -> Session -> handler closures -> Connection, so a closed
            # connection is freed by reference counting, not at the next full collection.
            session.release_callbacks()
            conn.session = None
            conn.jobs.clear()
            log.debug("conn%d: closed", conn.id)

    async def _dispatch(self, conn: Connection, request: Request) -> Any:
        self.admission.spoke(conn)  # a complete request: a Unix connection is a client now
        self._last_request[conn.id] = time.monotonic()
        route = self.methods.get(request.method)
        if route is None:
            raise RpcError(ErrorCode.METHOD_NOT_FOUND, f"no method {request.method!r}; known: {', '.join(m.value for m in Method)}")
        await self.admission.gate(conn, request.method, request.params)
        if self.shutting_down and request.method not in (Method.STATUS, Method.HELLO):
            # Stopping because the models failed to load: say why (the client that spawned it
            # asked exactly once, and "shutting down" would hide the cause).
            raise self.worker.load_failure() or RpcError(ErrorCode.SHUTTING_DOWN, "the daemon is shutting down")
        return await route(conn, request.params, request.msgid)

    async def _notification(self, conn: Connection, note: Notification) -> None:
        # Notifications have no answer; only cancel and focus make sense as one (Neovim's
        # rpcnotify, a hint sent without waiting). A bad one is logged, as there is no one to tell.
        try:
            self.admission.spoke(conn)
        except RpcError as err:
            log.debug("conn%d: notification %s refused: %s", conn.id, note.method, err)
            return
        if note.method in NOTIFIABLE and conn.authenticated:
            try:
                await self.methods[note.method](conn, note.params, None)
            except RpcError as err:
                log.debug("conn%d: notification %s failed: %s", conn.id, note.method, err)
        else:
            log.debug("conn%d: ignored notification %s", conn.id, note.method)

    async def shutdown(self, conn: Connection, params: None, msgid: int | None) -> dict[str, Any]:
        # The graceful path waits for this very answer to be written before closing sessions.
        self.request_stop(f"shutdown requested by conn{conn.id}")
        return {"ok": True}


async def serve_forever(cfg: Any, **kwargs: Any) -> int:
    return await Daemon(cfg, **kwargs).run()
