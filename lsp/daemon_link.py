"""specd-lsp's connection to the daemon: find or spawn it, keep it, mirror documents into it.

One supervisor task owns the connection. It connects to the socket; when nothing answers it
spawns ``specd serve`` (unless told not to) and waits for it; once connected it re-sends every
open document, waits for the models to load, and then watches the connection. When the daemon
goes away (restart, crash, SIGKILL) the pending requests fail at once with ``connection_lost``
and the supervisor starts over. Callers never wait for any of this: while the link is not
``ready`` they get ``DaemonUnavailable`` immediately and the editor gets an empty answer.

Document sync is ordered by construction: every open/change/close is written to the socket
synchronously, in the order the editor's notifications arrive, and only its answer is awaited
(in a callback that re-sends the whole document if the daemon refused an edit).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from specd.client import AsyncClient, DaemonUnavailable, last_spawn_error, spawn_daemon, spawn_log_path
from specd.protocol.errors import ErrorCode, RpcError
from specd.protocol.methods import Method

from specd_lsp.documents import Document, DocumentStore
from specd_lsp.options import DaemonSettings

log = logging.getLogger("specd_lsp.daemon")

# Link states, as specd/status reports them.
CONNECTING = "connecting"
SPAWNING = "spawning"
LOADING = "loading"  # connected; the daemon is loading its models
READY = "ready"
UNAVAILABLE = "unavailable"  # nothing answers and none could be started; retried in the background
STOPPED = "stopped"

RETRY_MIN_S = 0.5
RETRY_MAX_S = 4.0  # a daemon started by hand is picked up within this
LOAD_POLL_S = 0.25  # how often to ask a loading daemon whether it is ready
CLIENT_NAME = "specd-lsp"
# The daemon states in which it answers completions now; loading states mean "wait".
DAEMON_LOADING = ("starting", "loading", "unloaded")


@dataclass
class LinkEvent:
    state: str
    reason: str = ""


class DaemonLink:
    def __init__(
        self,
        documents: DocumentStore,
        settings: Callable[[], DaemonSettings],
        on_state: Callable[[LinkEvent], None] | None = None,
        load_config: Callable[[DaemonSettings], Any] | None = None,
    ):
        self.documents = documents
        self._settings = settings
        self._on_state = on_state
        self._load_config = load_config or default_config
        self.client: AsyncClient | None = None
        self.state = CONNECTING
        self.reason = ""
        self.hello: dict[str, Any] = {}
        self.daemon_status: dict[str, Any] = {}
        self.connects = 0  # successful connections so far; > 1 means we reconnected
        self.folders: list[str] = []  # the editor's workspace folders (file URIs)
        self._task: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[Any]] = set()
        self._closing = False
        self._ready = asyncio.Event()
        self._served_ready = False  # the current connection reached READY
        self._spawned_cfg: Any = None  # the config of the daemon we last spawned, for its log

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._supervise(), name="specd-daemon-link")

    async def close(self) -> None:
        self._closing = True
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self.client is not None:
            await self.client.close()
            self.client = None
        self._set_state(STOPPED)

    async def wait_ready(self, timeout: float) -> bool:
        try:
            await asyncio.wait_for(self._ready.wait(), timeout)
        except asyncio.TimeoutError:
            return False
        return True

    def _set_state(self, state: str, reason: str = "") -> None:
        if state == self.state and reason == self.reason:
            return
        self.state, self.reason = state, reason
        if state == READY:
            self._ready.set()
        else:
            self._ready.clear()
        log.info("daemon link: %s%s", state, f" ({reason})" if reason else "")
        if self._on_state is not None:
            self._on_state(LinkEvent(state, reason))

    async def _supervise(self) -> None:
        delay = RETRY_MIN_S
        while not self._closing:
            failure, lost_code = "", ""
            try:
                client = await self._connect()
            except Exception as err:  # DaemonUnavailable, or a bug: say so, keep trying
                if not isinstance(err, RpcError):
                    log.exception("connecting to the daemon failed")
                failure = err.message if isinstance(err, RpcError) else f"{type(err).__name__}: {err}"
            else:
                self._served_ready = False
                try:
                    await self._serve(client)
                except RpcError as err:
                    failure, lost_code = err.message, err.code
                    log.info("daemon connection ended: %s", err)
                except Exception as err:
                    failure = f"{type(err).__name__}: {err}"
                    log.exception("daemon connection failed")
                finally:
                    self.client = None
                    await client.close()
                if self._served_ready:  # it served, then went away: reconnect (or respawn) at once
                    delay = RETRY_MIN_S
                    if not self._closing:
                        self._set_state(CONNECTING, "the daemon went away; reconnecting")
                    continue
                spawn_failure = self._spawn_failure()
                if not spawn_failure and lost_code == ErrorCode.CONNECTION_LOST.value:
                    # A dying daemon's socket can still accept for a moment: just try again.
                    self._set_state(CONNECTING, "the daemon went away; reconnecting")
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, RETRY_MAX_S)
                    continue
                # It closed before it was ready: a failed start (models, config). Say why.
                failure = spawn_failure or failure or "the daemon closed the connection while starting"
            if self._closing:
                return
            self._set_state(UNAVAILABLE, failure)
            await asyncio.sleep(delay)
            delay = min(delay * 2, RETRY_MAX_S)

    def _spawn_failure(self) -> str:
        """The spawned daemon's own last word, when we started the one that just failed."""
        return last_spawn_error(self._spawned_cfg) if self._spawned_cfg is not None else ""

    async def _connect(self) -> AsyncClient:
        settings = self._settings()
        self._spawned_cfg = None
        cfg = self._load_config(settings)
        path = Path(cfg.socket_path)
        try:
            return await AsyncClient.connect_unix(path)
        except DaemonUnavailable as err:
            if not settings.spawn:
                raise DaemonUnavailable(f"{err.message} (start one with `specd serve`, or enable daemon.spawn)") from None
        self._set_state(SPAWNING, f"starting `specd serve` (log: {spawn_log_path(cfg)})")
        self._spawned_cfg = cfg
        proc = await asyncio.to_thread(spawn_daemon, cfg)
        deadline = time.monotonic() + settings.spawn_timeout_s
        pause = 0.02
        while time.monotonic() < deadline:
            try:
                return await AsyncClient.connect_unix(path)
            except DaemonUnavailable:
                pass
            if proc.poll() is not None:
                try:  # it may have lost a start-up race to another daemon, which answers now
                    return await AsyncClient.connect_unix(path)
                except DaemonUnavailable:
                    reason = last_spawn_error(cfg) or f"exit status {proc.returncode}"
                    raise DaemonUnavailable(f"the daemon did not start: {reason} (log: {spawn_log_path(cfg)})") from None
            await asyncio.sleep(pause)  # bounded polling for the socket to appear
            pause = min(pause * 2, 0.25)
        raise DaemonUnavailable(f"no daemon answered at {path} within {settings.spawn_timeout_s:.0f} s")

    async def _serve(self, client: AsyncClient) -> None:
        self.client = client
        self.hello = await client.hello(client=CLIENT_NAME)
        self.connects += 1
        self.replay_documents()
        self.replay_folders()
        state = self.hello.get("state")
        while state in DAEMON_LOADING:
            self._set_state(LOADING, f"the daemon is loading models ({state})")
            await asyncio.sleep(LOAD_POLL_S)
            self.daemon_status = await client.status()
            state = self.daemon_status.get("state")
        if state == "failed":
            raise RpcError(ErrorCode.MODEL_LOAD_ERROR, self.daemon_status.get("last_error") or "model load failed")
        self._served_ready = True
        self._set_state(READY)
        await client.wait_closed()

    # -- requests --------------------------------------------------------------------------

    def _ready_client(self) -> AsyncClient:
        client = self.client
        if client is None or client.closed or self.state not in (READY, LOADING):
            raise DaemonUnavailable(self.reason or f"the daemon is {self.state}")
        return client

    async def request(self, method: Method, params: dict[str, Any], timeout: float) -> Any:
        """One request; cancelling the awaiting task (or the timeout) cancels the daemon's work."""
        client = self._ready_client()
        msgid, future = client.send_request(method, params)
        try:
            return await asyncio.wait_for(future, timeout)
        except asyncio.TimeoutError:
            self._cancel_on_daemon(client, msgid)
            raise RpcError(ErrorCode.TIMEOUT, f"no answer to {method.value} within {timeout:.1f} s") from None
        except asyncio.CancelledError:
            self._cancel_on_daemon(client, msgid)
            raise

    async def complete(self, params: dict[str, Any], timeout: float) -> dict[str, Any]:
        if self.state != READY:
            raise DaemonUnavailable(self.reason or f"the daemon is {self.state}")
        return await self.request(Method.COMPLETE, params, timeout)

    async def status(self, timeout: float = 2.0) -> dict[str, Any]:
        self.daemon_status = await self.request(Method.STATUS, {}, timeout)
        return self.daemon_status

    def cancel_document(self, uri: str) -> None:
        """Cancel whatever completion the daemon is running for ``uri``."""
        client = self.client
        if client is not None and not client.closed:
            self._spawn_task(client.notify(Method.CANCEL, {"uri": uri}))

    def _cancel_on_daemon(self, client: AsyncClient, msgid: int) -> None:
        if not client.closed:
            self._spawn_task(client.notify(Method.CANCEL, {"msgid": msgid}))

    def _spawn_task(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        task.add_done_callback(_log_failure)

    # -- documents -------------------------------------------------------------------------

    def _send(self, method: Method, params: dict[str, Any], doc: Document | None = None) -> None:
        """Write now (keeping the editor's order); check the answer later."""
        client = self.client
        if client is None or client.closed:
            return  # replay_documents sends everything once we are connected again
        try:
            _, future = client.send_request(method, params)
        except RpcError:
            return
        except (TypeError, ValueError) as err:  # text msgpack cannot carry (a lone surrogate)
            log.warning("cannot send %s%s to the daemon: %s", method.value, f" of {doc.uri}" if doc else "", err)
            return
        future.add_done_callback(lambda f: self._sent(f, method, doc))

    def _sent(self, future: asyncio.Future[Any], method: Method, doc: Document | None) -> None:
        if future.cancelled():
            return
        err = future.exception()
        if err is None:
            return
        code = getattr(err, "code", "")
        if code in (ErrorCode.CONNECTION_LOST.value, ErrorCode.SHUTTING_DOWN.value):
            return  # the replay after reconnecting puts it right
        log.warning("daemon refused %s%s: %s", method.value, f" of {doc.uri}" if doc else "", err)
        current = self.documents.get(doc.uri) if doc is not None else None
        if method == Method.CHANGE and current is doc and code != ErrorCode.DOCUMENT_TOO_LARGE.value:
            self.open(doc)  # out of step (stale version, unknown document): send it whole

    def open(self, doc: Document) -> None:
        self._send(Method.OPEN, {"uri": doc.uri, "text": doc.text, "version": doc.version,
                                 **({"language": doc.language} if doc.language else {})}, doc)

    def change(self, doc: Document, edits: list[dict[str, Any]]) -> None:
        self._send(Method.CHANGE, {"uri": doc.uri, "version": doc.version, "edits": edits}, doc)

    def close_document(self, uri: str) -> None:
        self._send(Method.CLOSE, {"uri": uri})

    def replay_documents(self) -> None:
        """After (re)connecting: the daemon holds nothing of ours, so send every document."""
        for doc in self.documents:
            self.open(doc)

    # -- workspace folders -----------------------------------------------------------------

    def set_folders(self, folders: list[str]) -> None:
        """The editor's workspace folders: the daemon watches them (lookup drafting, context)."""
        self.folders = list(folders)
        self._send(Method.WORKSPACE, {"folders": self.folders})

    def replay_folders(self) -> None:
        if self.folders:
            self._send(Method.WORKSPACE, {"folders": self.folders})


def default_config(settings: DaemonSettings) -> Any:
    """specd's own config (file, SPECD_* environment), with the editor's socket override."""
    from specd.config import load_config

    overrides = {"daemon.socket": settings.socket} if settings.socket else None
    try:
        return load_config(overrides=overrides)
    except Exception as err:  # ConfigError: one line naming the key
        raise RpcError(ErrorCode.DAEMON_UNAVAILABLE, f"specd config: {err}") from None


def _log_failure(task: asyncio.Future[Any]) -> None:
    if not task.cancelled() and (err := task.exception()) is not None:
        log.debug("background daemon call failed: %s", err)
