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

The editor's cursor hints (``focus``: where the cursor came to rest) are written the same way,
their answers only logged; the last one is sent again once a (re)connected daemon is ready.

The daemon's limits come with its ``hello`` answer. A document over them (bytes, or a message
over the frame limit) is kept out: never sent, closed on the daemon if it was open there,
answered locally with ``document_too_large`` when completed, and sent again whole once an edit
brings it under. So one huge file costs nothing but itself. A document the daemon refuses for
its open-bytes budget (``too_many_document_bytes``: the user has too much open) is kept out the
same way, closed there if it held an older text, and offered again whole only after some other
document was closed (which may have made room), not on every edit. A connection that ends soon after
it was made (the daemon closing it for a reason the next one will hit too) makes the next
attempt wait, doubling up to ``RETRY_MAX_S``: the link never reconnects in a tight loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from specd.client import AsyncClient, DaemonUnavailable, last_spawn_error, spawn_daemon, spawn_log_path
from specd.logs import StateFileError
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
STABLE_CONNECTION_S = 10.0  # a connection that lasted this long resets the reconnect back-off
# Bytes of a message besides the document's text (method, uri, version, map headers); with a
# URI's length added, a message is sent only when text + this fits the frame limit.
MESSAGE_OVERHEAD = 1024
# The daemon states in which it answers completions now; loading states mean "wait".
DAEMON_LOADING = ("starting", "loading", "unloaded")


@dataclass
class LinkEvent:
    state: str
    reason: str = ""


class DaemonLink:
    """One concern: specd-lsp's one connection to the daemon, kept up and in step: found or spawned,
    reconnected when lost, the editor's documents and folders mirrored into it, requests sent
    through it (the module's docstring tells how)."""

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
        self.limits: dict[str, int] = {}  # the daemon's, from hello: max_frame_bytes, max_document_bytes, ...
        self.held_out: set[str] = set()  # documents over the limits: not on the daemon
        self.over_budget: dict[str, int] = {}  # refused for the daemon's byte budget, at which close count
        self._closes = 0  # documents closed so far: one may have made room in the budget
        self.daemon_status: dict[str, Any] = {}
        self.connects = 0  # successful connections so far; > 1 means we reconnected
        self.folders: list[str] = []  # the editor's workspace folders (file URIs)
        self._task: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[Any]] = set()
        self._closing = False
        self._ready = asyncio.Event()
        self._served_ready = False  # the current connection reached READY
        self._hint: tuple[str, int, int] | None = None  # the editor's last cursor hint (focus)
        self._focused: dict[str, int] = {}  # per document, the line of the last focus sent
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
                connected_at = time.monotonic()
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
                if self._served_ready:  # it served, then went away: reconnect (or respawn)
                    if time.monotonic() - connected_at >= STABLE_CONNECTION_S:
                        delay = RETRY_MIN_S  # a restart: reconnect at once
                    else:  # closed soon after connecting: whatever closed it may do so again
                        await asyncio.sleep(delay)
                        delay = min(delay * 2, RETRY_MAX_S)
                    if not self._closing:
                        self._set_state(CONNECTING, f"the daemon went away ({failure or 'closed'}); reconnecting")
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

        def spawning() -> None:
            self._set_state(SPAWNING, f"starting `specd serve` (log: {spawn_log_path(cfg)})")
            self._spawned_cfg = cfg

        return await connect_or_spawn(cfg, settings, spawning)

    async def _serve(self, client: AsyncClient) -> None:
        self.client = client
        self.hello = await client.hello(client=CLIENT_NAME)
        limits = self.hello.get("limits")
        self.limits = {k: v for k, v in limits.items() if isinstance(v, int)} if isinstance(limits, dict) else {}
        self.held_out.clear()
        self.over_budget.clear()
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
        self._focused.clear()
        if self._hint is not None:  # a daemon just started or restarted holds no prefill yet
            self.focus(*self._hint)
        await client.wait_closed()

    # -- requests --------------------------------------------------------------------------

    def _ready_client(self) -> AsyncClient:
        client = self.client
        if client is None or client.closed or self.state not in (READY, LOADING):
            raise DaemonUnavailable(self.reason or f"the daemon is {self.state}")
        return client

    async def request(self, method: Method, params: dict[str, Any], timeout: float,
                      on_progress: Callable[[dict[str, Any]], None] | None = None) -> Any:
        """One request; cancelling the awaiting task (or the timeout) cancels the daemon's work.
        ``on_progress`` gets its ``progress`` notifications (a streamed complete) until it ends."""
        client = self._ready_client()
        msgid, future = client.send_request(method, params, on_progress)
        try:
            return await asyncio.wait_for(future, timeout)
        except asyncio.TimeoutError:
            self._cancel_on_daemon(client, msgid)
            raise RpcError(ErrorCode.TIMEOUT, f"no answer to {method.value} within {timeout:.1f} s") from None
        except asyncio.CancelledError:
            self._cancel_on_daemon(client, msgid)
            raise

    async def complete(self, params: dict[str, Any], timeout: float,
                       on_progress: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
        """A daemon ``complete``; with ``on_progress`` it is streamed (settled lines as they come)."""
        if self.state != READY:
            raise DaemonUnavailable(self.reason or f"the daemon is {self.state}")
        uri = params.get("uri")
        text = params.get("text")
        if (text is None and uri in self.held_out) or (text is not None and self._over_limits(uri, text)):
            raise RpcError(ErrorCode.DOCUMENT_TOO_LARGE,
                           f"{uri} is over the daemon's size limits or its open-bytes budget; not completed")
        if on_progress is not None:
            params = {**params, "stream": True}
        return await self.request(Method.COMPLETE, params, timeout, on_progress)

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
        if method == Method.CLOSE and code == ErrorCode.UNKNOWN_DOCUMENT.value:
            return  # closing what the daemon does not hold (a document kept out) is what we wanted
        log.warning("daemon refused %s%s: %s", method.value, f" of {doc.uri}" if doc else "", err)
        current = self.documents.get(doc.uri) if doc is not None else None
        if code == ErrorCode.TOO_MANY_DOCUMENT_BYTES.value and doc is not None and current is doc:
            self.over_budget[doc.uri] = self._closes
            self._hold_out(doc)  # and free what an older text of it holds there
            return
        if method == Method.CHANGE and current is doc and code != ErrorCode.DOCUMENT_TOO_LARGE.value:
            self.open(doc)  # out of step (stale version, unknown document): send it whole

    def _over_limits(self, uri: str | None, text: str, extra: int = 0) -> bool:
        """Would a message carrying ``text`` (and ``extra`` more bytes) break the daemon's limits?"""
        frame = self.limits.get("max_frame_bytes")
        document = self.limits.get("max_document_bytes")
        ceiling = min(filter(None, (frame and frame - MESSAGE_OVERHEAD - len(uri or "") * 4 - extra, document)), default=None)
        return ceiling is not None and utf8_size(text, ceiling) > ceiling

    def _hold_out(self, doc: Document) -> None:
        if doc.uri not in self.held_out:
            log.warning("%s is over the daemon's limits (%s); not sending it", doc.uri, self.limits)
            self.held_out.add(doc.uri)
            self._send(Method.CLOSE, {"uri": doc.uri})  # it may be open there from before (unknown_document is fine)

    def open(self, doc: Document) -> None:
        if self._over_limits(doc.uri, doc.text):
            self._hold_out(doc)
            return
        if self.over_budget.get(doc.uri, -1) == self._closes:
            return  # refused for the budget, and nothing was closed since: it would be again
        self.over_budget.pop(doc.uri, None)
        self.held_out.discard(doc.uri)
        self._send(Method.OPEN, {"uri": doc.uri, "text": doc.text, "version": doc.version,
                                 **({"language": doc.language} if doc.language else {})}, doc)

    def change(self, doc: Document, edits: list[dict[str, Any]]) -> None:
        if doc.uri in self.held_out or self._over_limits(doc.uri, doc.text):
            self.open(doc)  # sends it whole once it fits again, else keeps it out
            return
        frame = self.limits.get("max_frame_bytes")
        edit_bytes = sum(utf8_size(edit.get("text", ""), frame or 1 << 62) + 64 for edit in edits)
        if frame and edit_bytes + MESSAGE_OVERHEAD > frame:
            self.open(doc)  # the edits alone would be over the frame limit: the text is smaller
            return
        self._send(Method.CHANGE, {"uri": doc.uri, "version": doc.version, "edits": edits}, doc)

    def close_document(self, uri: str) -> None:
        self._closes += 1
        self._focused.pop(uri, None)
        if self._hint is not None and self._hint[0] == uri:
            self._hint = None
        self.over_budget.pop(uri, None)
        if uri in self.held_out:
            self.held_out.discard(uri)
            return
        self._send(Method.CLOSE, {"uri": uri})

    def replay_documents(self) -> None:
        """After (re)connecting: the daemon holds nothing of ours, so send every document."""
        for doc in self.documents:
            self.open(doc)

    # -- cursor hints ----------------------------------------------------------------------

    def focus(self, uri: str, line: int, character: int) -> None:
        """The editor's cursor came to rest at code point ``character`` of ``line`` in ``uri``: the
        daemon's ``focus``, so that it prefills there in idle time. A hint, never awaited: sent
        only for a document the daemon holds, while it is ready (the last one waits for that),
        and once per line (a move along the line keeps most of the prompt); dropped silently
        when the daemon cannot take it."""
        self._hint = (uri, line, character)
        client = self.client
        if self.state != READY or client is None or client.closed or uri not in self.documents or uri in self.held_out:
            log.debug("focus on %s not sent: the daemon is %s or does not hold it", uri, self.state)
            return
        if self._focused.get(uri) == line:
            return
        # Code points, as every position specd-lsp sends the daemon (its documents' own unit). A
        # request, never awaited: its answer (``focused``: whether the daemon held the document)
        # goes to the log.
        params = {"uri": uri, "cursor": {"line": line, "character": character}, "encoding": "utf-32"}
        try:
            _, answer = client.send_request(Method.FOCUS, params)
        except (RpcError, TypeError, ValueError) as err:  # closing; a URI msgpack cannot carry
            log.debug("focus on %s not sent: %s", uri, err)
            return
        self._focused[uri] = line
        answer.add_done_callback(_focus_answered)

    # -- workspace folders -----------------------------------------------------------------

    def set_folders(self, folders: list[str]) -> None:
        """The editor's workspace folders: the daemon watches them (lookup drafting, context)."""
        self.folders = list(folders)
        self._send(Method.WORKSPACE, {"folders": self.folders})

    def replay_folders(self) -> None:
        if self.folders:
            self._send(Method.WORKSPACE, {"folders": self.folders})


async def connect_or_spawn(cfg: Any, settings: DaemonSettings, on_spawn: Callable[[], None]) -> AsyncClient:
    """A client of the daemon on ``cfg``'s socket. When none answers and ``settings.spawn``
    allows, ``on_spawn()``, then ``specd serve`` is started and its socket awaited for up to
    ``settings.spawn_timeout_s``; ``DaemonUnavailable`` says why there is none."""
    path = Path(cfg.socket_path)
    try:
        return await AsyncClient.connect_unix(path)
    except DaemonUnavailable as err:
        if not settings.spawn:
            raise DaemonUnavailable(f"{err.message} (start one with `specd serve`, or enable daemon.spawn)") from None
    on_spawn()
    try:
        proc = await asyncio.to_thread(spawn_daemon, cfg)
    except StateFileError as err:  # the spawn log is a FIFO, a symlink, or on a full disk
        raise DaemonUnavailable(f"cannot start the daemon: {err}") from None
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


def utf8_size(text: str, limit: int) -> int:
    """UTF-8 length of ``text``, computed exactly only when it could be near ``limit``."""
    if len(text) * 4 <= limit:
        return len(text)  # surely under the limit; the exact figure is not needed
    return len(text.encode("utf-8", errors="surrogatepass"))


def default_config(settings: DaemonSettings) -> Any:
    """specd's own config (file, SPECD_* environment), with the editor's socket override."""
    from specd.config import load_config

    overrides = {"daemon.socket": settings.socket} if settings.socket else None
    try:
        return load_config(overrides=overrides)
    except Exception as err:  # ConfigError: one line naming the key
        raise RpcError(ErrorCode.DAEMON_UNAVAILABLE, f"specd config: {err}") from None


def _focus_answered(answer: asyncio.Future[Any]) -> None:
    if answer.cancelled():
        return
    if (err := answer.exception()) is not None:
        log.debug("focus not taken: %s", err)  # a hint: a daemon without the method is no failure
    elif isinstance(result := answer.result(), dict) and not result.get("focused"):
        log.debug("focus on %s: the daemon does not hold it", result.get("uri"))


def _log_failure(task: asyncio.Future[Any]) -> None:
    if not task.cancelled() and (err := task.exception()) is not None:
        log.debug("background daemon call failed: %s", err)
