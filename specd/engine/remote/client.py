"""HTTP to an OpenAI-compatible ``/v1/completions`` endpoint: one streamed completion at a
time, its server-sent events, one-line errors, and a watch that cuts the socket on cancel.

The standard library's ``http.client``, not httpx or requests: one request shape and a
line-oriented event stream need little, and cancellation needs the socket itself: another thread
(the daemon's cancel) must cut a read that is blocked waiting for the server, and
``socket.shutdown`` does that at once, where the libraries offer no thread-safe way. The daemon
gains no dependency. The connection is kept alive between requests that end cleanly.
"""

from __future__ import annotations

import http.client
import json
import socket
import ssl
import threading
import time
from dataclasses import dataclass
from typing import Any, Iterator
from urllib.parse import urlsplit

from specd.engine.types import EngineError, ModelLoadError

COMPLETIONS_PATH = "/v1/completions"
MODELS_PATH = "/v1/models"
CANCEL_POLL_S = 0.01  # how often a running request looks at its cancel flag and deadline
ERROR_DETAIL_CHARS = 200  # of a server's error message, in the one line the user sees
# Of an error response, read to find its message (a validation error may quote the whole prompt).
ERROR_BODY_BYTES = 4 * 1024 * 1024


class RemoteError(EngineError):
    """The remote server could not serve a completion; ``str(err)`` is one line for the editor."""

    code = "engine_error"
    status: int | None = None  # the HTTP status, when the server answered one
    detail: str = ""  # the server's whole error message


@dataclass(frozen=True)
class RemoteOptions:
    url: str
    api_key: str = ""
    model: str = ""
    prompt: str = "auto"  # auto | tokens | text
    connect_timeout_s: float = 3.0
    read_timeout_s: float = 10.0
    body: dict[str, Any] | None = None  # merged into each request (None values are dropped)

    @classmethod
    def from_config(cls, cfg) -> "RemoteOptions":
        if not cfg["model.remote_url"]:
            raise ModelLoadError("model.backend is remote but model.remote_url is empty; "
                                 "set it to the server's base URL, e.g. http://gpu-box:8000")
        body = cfg["model.remote_body"]
        return cls(url=cfg["model.remote_url"], api_key=cfg["model.remote_api_key"], model=cfg["model.remote_model"],
                   prompt=cfg["model.remote_prompt"], connect_timeout_s=cfg["model.remote_connect_timeout_ms"] / 1000,
                   read_timeout_s=cfg["model.remote_read_timeout_ms"] / 1000, body=json.loads(body) if body else None)


def completions_url(base: str) -> str:
    """The completions endpoint of ``base``: a server root, its ``/v1``, or the endpoint itself."""
    base = base.strip().rstrip("/")
    if base.endswith(COMPLETIONS_PATH):
        return base
    return base + "/completions" if base.endswith("/v1") else base + COMPLETIONS_PATH


# -- HTTP: one streamed completion ------------------------------------------------------------


class Stream:
    """One request's response: server-sent events read off a connection the caller owns."""

    def __init__(self, response: http.client.HTTPResponse):
        self.response = response
        self.done = False  # the server sent [DONE] (the connection may then be reused)

    def events(self) -> Iterator[dict[str, Any]]:
        """Each ``data:`` payload as JSON, until ``[DONE]`` or the end of the body. Comments
        (``: ping``), ``event:`` and ``id:`` lines and blank separators are skipped."""
        while True:
            line = self.response.readline()
            if not line:
                return
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                self.done = True
                return
            try:
                event = json.loads(data)
            except ValueError:
                raise RemoteError(f"remote backend: malformed stream from the server (not JSON: "
                                  f"{data[:60].decode(errors='replace')!r})") from None
            if not isinstance(event, dict):
                raise RemoteError("remote backend: malformed stream from the server (an event that is not an object)")
            yield event


def event_text(event: dict[str, Any]) -> tuple[str, str | None]:
    """(text, finish_reason) of one completion chunk; RemoteError when it is not shaped like one
    (an ``error`` object mid-stream is the server's message)."""
    if "error" in event:
        error = event["error"]
        message = error.get("message") if isinstance(error, dict) else error
        raise RemoteError(f"remote backend: the server failed mid-completion: {_first_line(str(message))}")
    choices = event.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict) \
            or not isinstance(choices[0].get("text", ""), str):
        raise RemoteError("remote backend: malformed stream from the server (a chunk without choices[0].text)")
    return choices[0].get("text") or "", choices[0].get("finish_reason")


def _first_line(text: str) -> str:
    """``text`` on one line (whitespace runs collapsed), cut at ``ERROR_DETAIL_CHARS``."""
    line = " ".join(text.split())
    return line if len(line) <= ERROR_DETAIL_CHARS else line[:ERROR_DETAIL_CHARS] + "..."


def _error_detail(payload: bytes) -> str:
    """The server's error message out of an error body (OpenAI, FastAPI or plain text), whole."""
    try:
        body = json.loads(payload)
    except ValueError:
        return payload.decode(errors="replace")
    if isinstance(body, dict):
        for value in (body.get("error"), body.get("detail"), body.get("message")):
            if isinstance(value, dict):
                value = value.get("message")
            if value:
                return str(value)
    return str(body)


class RemoteClient:
    """POSTs to one OpenAI-compatible server and streams the answer. Used by one thread at a time
    (the daemon's model worker); ``close`` may come from any."""

    def __init__(self, options: RemoteOptions):
        self.options = options
        self.url = completions_url(options.url)
        parts = urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ModelLoadError(f"model.remote_url {options.url!r} is not an http:// or https:// URL")
        self.scheme, self.host, self.port = parts.scheme, parts.hostname, parts.port
        self.path = parts.path or COMPLETIONS_PATH
        self.root = self.path[: -len(COMPLETIONS_PATH)] if self.path.endswith(COMPLETIONS_PATH) else ""
        self._conn: http.client.HTTPConnection | None = None
        self.interrupted = False  # set by a request's Watch when it cut the socket: no retry then

    @property
    def where(self) -> str:
        return f"{self.scheme}://{self.host}" + (f":{self.port}" if self.port else "")

    def _connect(self) -> http.client.HTTPConnection:
        if self.scheme == "https":
            conn = http.client.HTTPSConnection(self.host, self.port, timeout=self.options.connect_timeout_s,
                                               context=ssl.create_default_context())
        else:
            conn = http.client.HTTPConnection(self.host, self.port, timeout=self.options.connect_timeout_s)
        try:
            conn.connect()
        except OSError as err:
            conn.close()
            raise self._connection_error(err) from None
        conn.sock.settimeout(self.options.read_timeout_s)
        return conn

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()

    def _headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
        if self.options.api_key:
            headers["Authorization"] = f"Bearer {self.options.api_key}"
        return headers

    def request(self, method: str, path: str, body: dict[str, Any] | None = None) -> http.client.HTTPResponse:
        """Send one request (on the kept-alive connection, or a new one when that went stale) and
        return its response once the status line is in. Raises RemoteError for HTTP errors."""
        payload = json.dumps(body).encode() if body is not None else None
        for attempt in (0, 1):
            fresh = self._conn is None
            if fresh:
                self._conn = self._connect()
            if self.interrupted:
                raise self._interrupted()
            try:
                self._conn.request(method, path, payload, self._headers())
                response = self._conn.getresponse()
                break
            except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError) as err:
                self.close()
                if self.interrupted:
                    raise self._interrupted() from None
                if fresh or attempt:  # a kept-alive connection the server closed meanwhile: once more
                    raise self._connection_error(err) from None
            except (OSError, http.client.HTTPException) as err:
                self.close()
                if self.interrupted:
                    raise self._interrupted() from None
                if isinstance(err, socket.timeout):  # connected, request sent, no status line in time
                    raise RemoteError(f"remote backend: {self.where} sent nothing for "
                                      f"{self.options.read_timeout_s:g} s (model.remote_read_timeout_ms)") from None
                raise self._connection_error(err) from None
        if response.status >= 400:
            detail = _error_detail(response.read(ERROR_BODY_BYTES))
            self.close()
            raise self._http_error(response.status, response.reason, detail)
        return response

    def finish(self, stream: Stream) -> None:
        """After a stream: keep the connection for the next request only if it ended cleanly."""
        if stream.done and not stream.response.will_close:
            try:
                stream.response.read()  # the chunked body's terminator
                return
            except (OSError, http.client.HTTPException):
                pass
        self.close()

    def models(self) -> list[str]:
        response = self.request("GET", self.root + MODELS_PATH)
        try:
            listed = json.loads(response.read())
        except (ValueError, OSError, http.client.HTTPException):
            self.close()
            return []
        data = listed.get("data") if isinstance(listed, dict) else None
        return [m["id"] for m in data or [] if isinstance(m, dict) and isinstance(m.get("id"), str)]

    # -- one-line errors ---------------------------------------------------------------------

    def _interrupted(self) -> RemoteError:
        return RemoteError(f"remote backend: the request to {self.where} was interrupted")

    def _connection_error(self, err: BaseException) -> RemoteError:
        where = self.where
        if isinstance(err, ConnectionRefusedError):
            why = "connection refused; is the server running?"
        elif isinstance(err, socket.timeout):
            why = f"no answer within {self.options.connect_timeout_s:g} s (model.remote_connect_timeout_ms)"
        elif isinstance(err, socket.gaierror):
            why = f"cannot resolve {self.host}"
        elif isinstance(err, ssl.SSLError):
            why = f"TLS failed: {err.reason or err}"
        elif isinstance(err, (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError)):
            why = "the server closed the connection"
        else:
            why = _first_line(str(err)) or type(err).__name__
        return RemoteError(f"remote backend: cannot reach {where}: {why}")

    def _http_error(self, status: int, reason: str, detail: str) -> RemoteError:
        head = f"remote backend: {self.where} answered {status} {reason}".rstrip()
        if status in (401, 403):
            err = RemoteError(f"{head}: the API key was refused; check model.remote_api_key")
        elif status == 404:
            err = RemoteError(f"{head} for {self.path}: {_first_line(detail) or 'not found'}; check "
                              f"model.remote_url and model.remote_model")
        else:
            err = RemoteError(f"{head}: {_first_line(detail)}" if detail.strip() else head)
        err.status, err.detail = status, detail
        return err


class Watch:
    """Cuts the request's socket when ``cancel`` is set or ``deadline`` passes, so a read blocked
    on the server returns at once. ``why`` says which happened (None: neither)."""

    def __init__(self, client: RemoteClient, cancel: threading.Event | None, deadline: float):
        self.client, self.cancel, self.deadline = client, cancel, deadline
        self.budget_ms = (deadline - time.monotonic()) * 1000
        self.why: str | None = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="specd-remote-watch", daemon=True)

    def __enter__(self) -> "Watch":
        self.client.interrupted = False
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._done.set()
        self._thread.join()

    def check(self) -> None:
        """Between events: the same decision without waiting for the watcher."""
        if self.why is None:
            self._decide()

    def _decide(self) -> bool:
        if self.cancel is not None and self.cancel.is_set():
            self.why = "cancelled"
        elif time.monotonic() >= self.deadline:
            self.why = "time_budget"
        return self.why is not None

    def _run(self) -> None:
        while not self._done.wait(CANCEL_POLL_S):
            if self.why is not None or self._decide():
                self.client.interrupted = True
                conn = self.client._conn
                sock = conn.sock if conn is not None else None
                if sock is not None:
                    try:
                        sock.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass
                return
