"""A small client for the daemon's socket API, synchronous and asyncio.

    from specd.client import Client
    with Client.connect_unix(cfg.socket_path) as client:
        client.open_document("file:///x.py", text)
        result = client.complete(uri="file:///x.py", cursor={"line": 3, "character": 8})

``Client`` is for the CLI, scripts and tests: the same asyncio session run on a private loop
thread, so several threads may share one client and ``cancel`` can be sent while a
``complete`` waits.
``AsyncClient`` is the same API on asyncio for the LSP front end. ``ensure_daemon`` connects,
or starts ``python -m specd serve`` detached and waits for its socket.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

from specd.protocol.errors import ErrorCode, RpcError
from specd.protocol.framing import READ_CHUNK
from specd.protocol.messages import Notification
from specd.protocol.methods import ERROR_NOTIFICATION, PROGRESS_NOTIFICATION, Method
from specd.protocol.session import Session

# Replies can carry long completions plus stats; the client side allows more than a request.
CLIENT_MAX_FRAME = 64 * 1024 * 1024
CONNECT_TIMEOUT_S = 5.0
SPAWN_TIMEOUT_S = 60.0  # for the socket to answer; model loading happens after that
# A daemon answers hello from its event loop at once, even while models load; one that does
# not within this is stopped (SIGSTOP) or wedged, and waiting out a completion's timeout on it
# helps nobody.
RESPONSIVE_TIMEOUT_S = 10.0


class DaemonUnavailable(RpcError):
    """Nothing answers at the socket, and no daemon could be (or was allowed to be) started.
    ``daemon_exit``: the exit status of a daemon spawned for the call that ended before it
    listened (2: it refused its configuration or surroundings, told in the message)."""

    def __init__(self, message: str, daemon_exit: int | None = None):
        super().__init__(ErrorCode.DAEMON_UNAVAILABLE, message)
        self.daemon_exit = daemon_exit


def _params(**values: Any) -> dict[str, Any]:
    return {key: value for key, value in values.items() if value is not None}


class _Methods:
    """The daemon's methods as calls; ``request`` is sync in Client, a coroutine in AsyncClient."""

    def request(self, method: str, params: dict[str, Any] | None = None, timeout: float | None = None,
                on_progress: Callable[[dict[str, Any]], None] | None = None) -> Any:
        """Send ``method`` and wait for its result; ``on_progress`` gets the request's
        ``progress`` notifications' params until then."""
        raise NotImplementedError

    def hello(self, client: str = "specd.client", token: str | None = None, errors: str | None = None,
              timeout: float | None = 10.0, batch: bool | None = None):
        """Introduce this client; ``batch`` marks its completes as batch work (they yield to
        editors' typing)."""
        return self.request(Method.HELLO.value, _params(client=client, token=token, errors=errors, batch=batch), timeout)

    def open_document(self, uri: str, text: str, version: int = 0, language: str | None = None,
                      timeout: float | None = 30.0):
        return self.request(Method.OPEN.value, _params(uri=uri, text=text, version=version, language=language), timeout)

    def change_document(self, uri: str, version: int | None = None, *, text: str | None = None,
                        edits: list[dict[str, Any]] | None = None, encoding: str | None = None,
                        timeout: float | None = 30.0):
        return self.request(
            Method.CHANGE.value, _params(uri=uri, version=version, text=text, edits=edits, encoding=encoding), timeout
        )

    def close_document(self, uri: str, timeout: float | None = 10.0):
        return self.request(Method.CLOSE.value, {"uri": uri}, timeout)

    def focus(self, uri: str, cursor: Any, encoding: str | None = None, timeout: float | None = 10.0):
        """The editor's cursor came to rest in the open document ``uri``: the daemon prefills
        for a completion there in idle time. {"uri", "focused"}: focused is False where the
        document is not open."""
        return self.request(Method.FOCUS.value, _params(uri=uri, cursor=cursor, encoding=encoding), timeout)

    def complete(self, uri: str | None = None, cursor: Any = None, *, text: str | None = None,
                 options: dict[str, Any] | None = None, extra_context: list[dict[str, str]] | None = None,
                 path: str | None = None, encoding: str | None = None, timeout: float | None = 300.0,
                 stream: Callable[[dict[str, Any]], None] | None = None, batch: bool | None = None):
        """A completion. With ``stream``, it is called with each ``progress`` notification's
        params ({msgid, text, tail, tokens}: the settled lines so far) before the result comes
        (on the client's loop thread for ``Client``). ``batch`` marks it batch work."""
        params = _params(uri=uri, cursor=cursor, text=text, options=options, extra_context=extra_context,
                         path=path, encoding=encoding, stream=True if stream is not None else None, batch=batch)
        return self.request(Method.COMPLETE.value, params, timeout, on_progress=stream)

    def cancel(self, msgid: int | None = None, uri: str | None = None, timeout: float | None = 10.0):
        return self.request(Method.CANCEL.value, _params(msgid=msgid, uri=uri), timeout)

    def status(self, timeout: float | None = 10.0):
        return self.request(Method.STATUS.value, {}, timeout)

    def workspace(self, folders: list[str] | None = None, *, add: list[str] | None = None,
                  remove: list[str] | None = None, timeout: float | None = 10.0):
        """Set (``folders``) or change (``add``/``remove``) this connection's workspace folders."""
        return self.request(Method.WORKSPACE.value, _params(folders=folders, add=add, remove=remove), timeout)

    def shutdown(self, timeout: float | None = 30.0):
        return self.request(Method.SHUTDOWN.value, {}, timeout)


# -- synchronous -------------------------------------------------------------------------------


class Client(_Methods):
    """The synchronous client: a facade over the asyncio ``Session`` (the same one the daemon and
    ``AsyncClient`` use), run on a private event loop thread, as pynvim's sync session wraps its
    async one. So there is one implementation of framing, limits and response routing; a call
    here hands its request to that loop and waits on a ``concurrent.futures.Future``."""

    def __init__(self, sock: socket.socket, *, max_frame_bytes: int = CLIENT_MAX_FRAME):
        self.sock = sock
        self.server_error: RpcError | None = None  # last specd/error notification (why we were refused)
        self.notifications: list[Notification] = []
        self._progress: dict[int, Callable[[dict[str, Any]], None]] = {}  # msgid -> a streamed complete's listener
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run_loop, name="specd-client-loop", daemon=True)
        self._thread.start()
        try:
            self._call(self._open(max_frame_bytes))
        except BaseException:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(2)
            sock.close()
            raise

    def _run_loop(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_forever()
        finally:
            self._loop.close()

    async def _open(self, max_frame_bytes: int) -> None:
        self.sock.setblocking(False)
        if self.sock.family == socket.AF_UNIX:
            reader, writer = await asyncio.open_unix_connection(sock=self.sock, limit=READ_CHUNK)
        else:
            reader, writer = await asyncio.open_connection(sock=self.sock, limit=READ_CHUNK)
        self.session = Session(reader, writer, max_frame_bytes=max_frame_bytes,
                               on_notification=self._on_notification, name="client")
        self._runner = asyncio.ensure_future(self.session.run())
        # Once the connection is over, the loop has nothing left to do: let its thread end
        # (a moment later, so the failures of pending requests are delivered first).
        self._runner.add_done_callback(lambda _: self._loop.call_later(0.1, self._loop.stop))

    def _on_notification(self, note: Notification) -> None:
        if note.method == PROGRESS_NOTIFICATION:
            _progress(self._progress, note)
            return
        if note.method == ERROR_NOTIFICATION:
            self.server_error = RpcError.from_wire(note.params)
            self.session.close_reason = self.server_error
        self.notifications.append(note)
        del self.notifications[:-100]

    def _lost(self) -> RpcError:
        return self.server_error or RpcError(ErrorCode.CONNECTION_LOST, "the daemon closed the connection")

    def _call(self, coro: Any) -> Any:
        """Run ``coro`` on the client's loop and return its result (raising what it raises)."""
        try:
            future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        except RuntimeError:  # the loop has ended with the connection
            coro.close()
            raise self._lost() from None
        while True:
            try:
                return future.result(0.1)  # returns as soon as it is done; the slices only notice a dead loop
            except concurrent.futures.TimeoutError:
                if not self._thread.is_alive():
                    future.cancel()
                    raise self._lost() from None

    @classmethod
    def connect_unix(cls, path: str | os.PathLike[str], timeout: float = CONNECT_TIMEOUT_S) -> Client:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        try:
            sock.connect(os.fspath(path))
        except OSError as err:
            sock.close()
            raise DaemonUnavailable(f"no daemon at {path}: {err.strerror or err}") from None
        return cls(sock)

    @classmethod
    def connect_tcp(cls, host: str, port: int, token: str, timeout: float = CONNECT_TIMEOUT_S) -> Client:
        try:
            sock = socket.create_connection((host, port), timeout=timeout)
        except OSError as err:
            raise DaemonUnavailable(f"no daemon at {host}:{port}: {err.strerror or err}") from None
        client = cls(sock)
        client.hello(token=token)
        return client

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def send_request(self, method: str, params: dict[str, Any] | None = None,
                     on_progress: Callable[[dict[str, Any]], None] | None = None
                     ) -> tuple[int, concurrent.futures.Future[Any]]:
        """Send without waiting: (msgid, future). For concurrent requests and ``cancel(msgid)``."""
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        name = str(method.value if isinstance(method, Method) else method)

        async def send() -> int:
            msgid, answer = self.session.send_request(name, params)
            _listen(self._progress, msgid, answer, on_progress)
            answer.add_done_callback(lambda done: _copy_outcome(done, future))
            return msgid

        return self._call(send()), future

    def request(self, method: str, params: dict[str, Any] | None = None, timeout: float | None = None,
                on_progress: Callable[[dict[str, Any]], None] | None = None) -> Any:
        msgid, future = self.send_request(method, params, on_progress)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            raise RpcError(ErrorCode.TIMEOUT, f"no answer to {method} within {timeout} s") from None
        finally:
            if not future.done():  # forget it: a late answer is dropped
                try:
                    self._loop.call_soon_threadsafe(self.session.forget, msgid)
                except RuntimeError:
                    pass

    def notify(self, method: str, params: dict[str, Any] | None = None) -> None:
        self._call(self.session.notify(str(method.value if isinstance(method, Method) else method), params))

    def send_raw(self, data: bytes) -> None:
        """Write bytes as they are (tests use it to send malformed frames)."""
        async def write() -> None:
            if self.session.closed or self.session.writer.is_closing():
                raise self._lost()
            self.session.writer.write(data)
            await self.session.writer.drain()

        self._call(write())

    @property
    def closed(self) -> bool:
        return self.session.closed

    def close(self) -> None:
        async def close() -> None:
            try:
                await asyncio.wait_for(self.session.close(), 2.0)
            except asyncio.TimeoutError:  # the peer reads nothing: drop what is unsent
                self.session.writer.transport.abort()
            self._runner.cancel()
            await asyncio.gather(self._runner, return_exceptions=True)

        try:
            self._call(close())
        except RpcError:
            pass  # the connection had ended already
        if self._thread is not threading.current_thread():
            self._thread.join(2)


def _listen(listeners: dict[int, Callable[[dict[str, Any]], None]], msgid: int, answer: asyncio.Future[Any],
            on_progress: Callable[[dict[str, Any]], None] | None) -> None:
    """Route ``msgid``'s progress notifications to ``on_progress`` until its answer comes."""
    if on_progress is not None:
        listeners[msgid] = on_progress
        answer.add_done_callback(lambda _: listeners.pop(msgid, None))


def _progress(listeners: dict[int, Callable[[dict[str, Any]], None]], note: Notification) -> None:
    params = note.params if isinstance(note.params, dict) else {}
    listener = listeners.get(params.get("msgid"))  # type: ignore[arg-type]
    if listener is not None:
        listener(params)


def _copy_outcome(source: asyncio.Future[Any], target: concurrent.futures.Future[Any]) -> None:
    if target.done():
        return
    if source.cancelled():
        target.cancel()
    elif source.exception() is not None:
        target.set_exception(source.exception())
    else:
        target.set_result(source.result())


# -- asyncio -----------------------------------------------------------------------------------


class AsyncClient(_Methods):
    """The same calls on asyncio: ``await client.complete(...)``."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.server_error: RpcError | None = None
        self._progress: dict[int, Callable[[dict[str, Any]], None]] = {}  # msgid -> a streamed complete's listener
        self.session = Session(
            reader, writer, max_frame_bytes=CLIENT_MAX_FRAME, on_notification=self._on_notification, name="client"
        )
        self._runner = asyncio.create_task(self.session.run(), name="specd-client")

    @classmethod
    async def connect_unix(cls, path: str | os.PathLike[str], timeout: float = CONNECT_TIMEOUT_S) -> AsyncClient:
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_unix_connection(os.fspath(path), limit=READ_CHUNK), timeout
            )
        except (OSError, asyncio.TimeoutError) as err:
            raise DaemonUnavailable(f"no daemon at {path}: {getattr(err, 'strerror', None) or err or 'timeout'}") from None
        return cls(reader, writer)

    @classmethod
    async def connect_tcp(cls, host: str, port: int, token: str, timeout: float = CONNECT_TIMEOUT_S) -> AsyncClient:
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
        except (OSError, asyncio.TimeoutError) as err:
            raise DaemonUnavailable(f"no daemon at {host}:{port}: {err}") from None
        client = cls(reader, writer)
        await client.hello(token=token)
        return client

    def _on_notification(self, note: Notification) -> None:
        if note.method == PROGRESS_NOTIFICATION:
            _progress(self._progress, note)
        elif note.method == ERROR_NOTIFICATION:
            self.server_error = RpcError.from_wire(note.params)
            self.session.close_reason = self.server_error

    async def request(self, method: str, params: dict[str, Any] | None = None, timeout: float | None = None,
                      on_progress: Callable[[dict[str, Any]], None] | None = None) -> Any:
        name = str(method.value if isinstance(method, Method) else method)
        if on_progress is None:
            return await self.session.request(name, params, timeout)
        msgid, answer = self.send_request(name, params, on_progress)
        try:
            return await asyncio.wait_for(answer, timeout)
        except asyncio.TimeoutError:
            raise RpcError(ErrorCode.TIMEOUT, f"no answer to {name} within {timeout} s") from None
        finally:
            self.session.forget(msgid)

    def send_request(self, method: str, params: dict[str, Any] | None = None,
                     on_progress: Callable[[dict[str, Any]], None] | None = None) -> tuple[int, asyncio.Future[Any]]:
        msgid, answer = self.session.send_request(str(method.value if isinstance(method, Method) else method), params)
        _listen(self._progress, msgid, answer, on_progress)
        return msgid, answer

    async def notify(self, method: str, params: dict[str, Any] | None = None) -> None:
        await self.session.notify(str(method.value if isinstance(method, Method) else method), params)

    @property
    def closed(self) -> bool:
        return self.session.closed

    async def wait_closed(self) -> None:
        await asyncio.shield(self._runner)

    async def close(self) -> None:
        await self.session.close()
        self._runner.cancel()
        try:
            await self._runner
        except (asyncio.CancelledError, Exception):
            pass

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()


# -- finding or starting the daemon -------------------------------------------------------------


def spawn_log_path(cfg: Any) -> Path:
    from specd.config import state_dir

    return state_dir() / "spawn.log"


def _child_environment(cfg: Any) -> dict[str, str]:
    """Our environment plus the config this process was given, so the daemon sees the same."""
    # Our own service-manager handshake (if this process runs under systemd) is not the daemon's.
    inherited = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "LISTEN_FDS", "LISTEN_PID", "LISTEN_FDNAMES")
    env = {name: value for name, value in os.environ.items() if name not in inherited}
    package_root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH", "")) if p)
    if getattr(cfg, "file", None):
        env["SPECD_CONFIG"] = str(cfg.file)
    for dotted, source in getattr(cfg, "sources", {}).items():
        if source == "command line":  # flags do not reach the child; environment overrides do
            value = cfg[dotted]
            env["SPECD_" + dotted.replace(".", "_").upper()] = str(value).lower() if isinstance(value, bool) else str(value)
    return env


def spawn_daemon(cfg: Any) -> subprocess.Popen[bytes]:
    """Start ``python -m specd serve`` in its own session, its stderr kept in the spawn log.

    Raises ``specd.logs.StateFileError`` (one line) when the spawn log cannot be a regular file
    of ours: a symlink, FIFO or device there, or no space for it. The daemon is then not
    started, since nothing it said about a failed start could be read back."""
    from specd.logs import open_private

    with open_private(spawn_log_path(cfg), "w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "specd", "serve"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=stderr,
            env=_child_environment(cfg),
            cwd="/",
            start_new_session=True,  # survives the editor or LSP process that started it
            close_fds=True,
        )
    # Reap it whenever it exits, so a daemon that dies while we live leaves no zombie.
    threading.Thread(target=proc.wait, name="specd-daemon-reaper", daemon=True).start()
    return proc


def last_spawn_error(cfg: Any) -> str:
    """The last line the spawned daemon wrote to stderr (its one-line reason for exiting)."""
    from specd.logs import read_private_tail

    try:  # never a plain read: a FIFO put there would block it until some writer came
        lines = read_private_tail(spawn_log_path(cfg)).strip().splitlines()
    except OSError:
        return ""
    for line in reversed(lines):
        if line.startswith("specd:"):
            return line
    return lines[-1] if lines else ""


def ensure_daemon(cfg: Any, spawn: bool = True, timeout: float = SPAWN_TIMEOUT_S) -> Client:
    """Connect to the daemon at ``cfg.socket_path``, starting one first when none answers."""
    path = Path(cfg.socket_path)
    try:
        return Client.connect_unix(path)
    except DaemonUnavailable as err:
        if not spawn:
            raise DaemonUnavailable(f"{err.message} (start one with `specd serve`)") from None
    proc = spawn_daemon(cfg)
    deadline = time.monotonic() + timeout
    delay = 0.02
    while time.monotonic() < deadline:
        try:
            return Client.connect_unix(path)
        except DaemonUnavailable:
            pass
        if proc.poll() is not None:
            # It exited: maybe because another daemon won a start-up race (then it answers now).
            try:
                return Client.connect_unix(path)
            except DaemonUnavailable:
                reason = last_spawn_error(cfg) or f"exit status {proc.returncode}"
                raise DaemonUnavailable(f"the daemon did not start: {reason} (log: {spawn_log_path(cfg)})",
                                        daemon_exit=proc.returncode) from None
        time.sleep(delay)
        delay = min(delay * 2, 0.25)
    raise DaemonUnavailable(f"no daemon answered at {path} within {timeout:.0f} s (log: {spawn_log_path(cfg)})")


def complete_via_daemon(
    cfg: Any,
    text: str,
    *,
    line: int | None = None,
    character: int | None = None,
    offset: int | None = None,
    path: str | os.PathLike[str] | None = None,
    options: dict[str, Any] | None = None,
    spawn: bool = True,
    timeout: float = 300.0,
) -> dict[str, Any]:
    """Complete ``text`` at a cursor through the daemon and return the result map.

    The cursor is ``offset`` (code points) or ``line`` + ``character`` (both 0-based, character
    in code points). ``path`` names the file: it keys the daemon's per-document KV cache
    (``file://`` URI) and appears in repo-level prompts. Raises RpcError (DaemonUnavailable
    when nothing answers and ``spawn`` is off or the spawned daemon failed).
    """
    if offset is not None:
        cursor: Any = {"offset": offset}
    elif line is not None and character is not None:
        cursor = {"line": line, "character": character}
    else:
        raise ValueError("give offset, or line and character")
    uri = Path(path).resolve().as_uri() if path is not None else None
    client = ensure_daemon(cfg, spawn=spawn)
    try:
        try:
            client.hello(client="specd complete", timeout=RESPONSIVE_TIMEOUT_S)
        except RpcError as err:
            if err.code == ErrorCode.TIMEOUT.value:
                raise DaemonUnavailable(
                    f"the daemon at {cfg.socket_path} accepted the connection but did not answer within "
                    f"{RESPONSIVE_TIMEOUT_S:g} s (stopped or wedged?)"
                ) from None
            raise
        return client.complete(uri=uri, cursor=cursor, text=text, options=options,
                               path=os.fspath(path) if path is not None else None, timeout=timeout)
    except RpcError as err:
        if err.code == ErrorCode.CONNECTION_LOST.value and (reason := last_spawn_error(cfg)):
            raise RpcError(ErrorCode.CONNECTION_LOST, f"the daemon went away: {reason}") from None
        raise
    finally:
        client.close()
