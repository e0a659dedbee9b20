"""The remote backend: specd's front (documents, context, prompts, stop rules) in front of a
serving engine that already batches, caches prefixes and speculates (vLLM, llama.cpp's
llama-server, llama-cpp-python's server, TGI), reached through its OpenAI-compatible
``/v1/completions`` endpoint with streaming.

What stays local: the tokenizer named by ``model.target`` (its ``tokenizer.json`` and
``tokenizer_config.json``; ``config.json`` and ``specd.json`` beside it, when present, give the
context window and the FIM family; the weights are never read). The prompt is built exactly as
the local engine builds it (``PromptBuilder``: FIM template, layout and anchor, windows, context
chunks chosen by the same ``ContextSelector``), and sent as token ids, so the server sees the
ids specd chose. Servers that take only strings (llama-cpp-python's, TGI) get the prompt's text
instead (``model.remote_prompt``; ``auto`` falls back on the first refusal), which the server
tokenizes back to the same ids when it has the same tokenizer.

Token healing is off here: it constrains the first generated tokens to re-type the text cut
from the prompt, a per-step logit mask that no OpenAI-compatible server takes. The prompt ends
at the cursor, as in every other FIM client of these servers.

Decoding is greedy unless the request asks for a temperature, with the server's repetition
penalty turned off, so the output is the target model's own. The server stops at its end-of-text
token and the FIM stop tokens (``stop`` strings and vLLM's ``stop_token_ids``); specd's text
rules (single line, end of block) run on the streamed text and close the stream when they fire.
Cancel, supersede and the time budget close the stream too, which servers take as "stop
generating".

HTTP: the standard library's ``http.client``, not httpx or requests. One request shape and a
line-oriented event stream need little, and cancellation needs the socket itself: another thread
(the daemon's cancel) must cut a read that is blocked waiting for the server, and
``socket.shutdown`` does that at once, where the libraries offer no thread-safe way. The daemon
gains no dependency. The connection is kept alive between requests that end cleanly.
"""

from __future__ import annotations

import http.client
import json
import logging
import socket
import ssl
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator
from urllib.parse import urlsplit

from specd.engine.front.context import ContextSelector
from specd.engine.front.corpus import Corpus
from specd.engine.front.prompt import FimTemplate, Prompt, PromptBuilder, detect_family
from specd.engine.front.stops import StopRules
from specd.engine.options import EngineOptions, context_window, fit_prompt_budget
from specd.engine.types import Cancelled, CompletionRequest, CompletionResult, EngineError, ModelLoadError

log = logging.getLogger(__name__)

COMPLETIONS_PATH = "/v1/completions"
MODELS_PATH = "/v1/models"
LATENCY_WINDOW = 100  # requests the latency figures cover
CANCEL_POLL_S = 0.01  # how often a running request looks at its cancel flag and deadline
ERROR_DETAIL_CHARS = 200  # of a server's error message, in the one line the user sees
# Of an error response, read to find its message (a validation error may quote the whole prompt).
ERROR_BODY_BYTES = 4 * 1024 * 1024
ANONYMOUS = "<anonymous>"


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


class _Stream:
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
        self.interrupted = False  # set by a request's _Watch when it cut the socket: no retry then

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

    def finish(self, stream: _Stream) -> None:
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


class _Watch:
    """Cuts the request's socket when ``cancel`` is set or ``deadline`` passes, so a read blocked
    on the server returns at once. ``why`` says which happened (None: neither)."""

    def __init__(self, client: RemoteClient, cancel: threading.Event | None, deadline: float):
        self.client, self.cancel, self.deadline = client, cancel, deadline
        self.budget_ms = (deadline - time.monotonic()) * 1000
        self.why: str | None = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="specd-remote-watch", daemon=True)

    def __enter__(self) -> "_Watch":
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


# -- stop rules on streamed text -----------------------------------------------------------------


class TextStops(StopRules):
    """specd's stop rules (``StopRules``: single line, end of block) on text as it streams in,
    plus the FIM stop tokens as strings (a server that renders special tokens shows them)."""

    def __init__(self, stop_texts: list[str], single_line: bool, block_indent: str | None):
        super().__init__(None, set(), single_line, block_indent)
        self.stop_texts = [s for s in stop_texts if s]
        self.streamed = ""

    def feed(self, delta: str) -> str | None:
        self.streamed += delta
        for stop in self.stop_texts:
            at = self.streamed.find(stop)
            if at >= 0:
                self.streamed = self.streamed[:at]
                return "eos"
        return self(-1)  # the rules read the text through _after_cursor, not the token

    def _after_cursor(self) -> str:
        return self.streamed


# -- the engine ----------------------------------------------------------------------------------


class _NoKV:
    """The KV state ``ContextSelector.warm_step`` fills: none here, the server caches prefixes."""

    class _Ids:
        ids: list[int] = []

    def __init__(self) -> None:
        self.target = self._Ids()
        self.last_prefix = self.last_completion = ""

    def prefill(self, ids: list[int], deadline: float, piece: int) -> bool:
        return True


class _NoCaches:
    def get(self, key: str) -> None:
        return None

    def put(self, key: str, state: Any) -> None:
        pass

    def enforce_budget(self, keep: str | None = None) -> None:
        pass


class _Latency:
    """The last ``LATENCY_WINDOW`` requests' times (ms), for ``specd status``."""

    def __init__(self) -> None:
        self.first_token: deque[float] = deque(maxlen=LATENCY_WINDOW)
        self.total: deque[float] = deque(maxlen=LATENCY_WINDOW)

    def add(self, first_token_ms: float | None, total_ms: float) -> None:
        if first_token_ms is not None:
            self.first_token.append(first_token_ms)
        self.total.append(total_ms)

    @staticmethod
    def _summary(values: deque[float]) -> dict[str, float] | None:
        if not values:
            return None
        ordered = sorted(values)
        pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
        return {"p50": round(pick(0.5), 1), "p95": round(pick(0.95), 1), "count": len(ordered)}

    def describe(self) -> dict[str, Any]:
        return {"first_token_ms": self._summary(self.first_token), "total_ms": self._summary(self.total)}


class RemoteEngine:
    """A ``CompletionEngine`` whose completions come from a remote server (module docstring)."""

    def __init__(self, options: EngineOptions, remote: RemoteOptions, tokenizer_source: str = ""):
        self.options = options
        self.remote = remote
        self.client = RemoteClient(remote)
        self.tokenizer_source = tokenizer_source or options.target
        self.tokenizer = None
        self.template: FimTemplate | None = None
        self.prompts: PromptBuilder | None = None
        self.context = ContextSelector(options.context_tokens)
        self._corpus = Corpus()
        self._docs: dict[str, str] = {}
        self._anchors: dict[str, int] = {}
        self._lock = threading.Lock()  # documents and counters: stats() reads them from other threads
        self._as_text = remote.prompt == "text"
        self._model_name: str | None = remote.model or None
        self._model_checked = bool(remote.model)
        self.latency = _Latency()
        self.requests = self.failures = self.cancelled = 0
        self.last_error: str | None = None

    @classmethod
    def from_config(cls, cfg) -> "RemoteEngine":
        engine = cls(EngineOptions.from_config(cfg), RemoteOptions.from_config(cfg))
        engine.ensure_loaded()
        return engine

    # -- lifecycle -------------------------------------------------------------------------

    @property
    def loaded(self) -> bool:
        return self.prompts is not None

    def ensure_loaded(self) -> None:
        """Load the tokenizer (the server is not asked: it may come up later; each request says
        what went wrong with it)."""
        if self.prompts is not None:
            return
        from specd.engine.models import load_tokenizer

        source = self.tokenizer_source or _demo_target()
        self.tokenizer_source = source
        self.tokenizer = load_tokenizer(source, self.options.trust_remote_code)
        self.template = detect_family(self.tokenizer, source, self.options.fim_family)
        prefix, suffix, context = fit_prompt_budget(
            self.options.prefix_tokens, self.options.suffix_tokens, self.options.context_tokens,
            context_window(source), self.options.max_tokens)
        self.prompts = PromptBuilder(self.tokenizer, self.template, prefix, suffix, context,
                                     layout=self.options.fim_layout)  # no healing vocabulary: healing off
        self.stop_ids = sorted(self.prompts.stop_ids())
        self.stop_texts = sorted({self.tokenizer.convert_ids_to_tokens(i) for i in self.stop_ids} - {None})
        log.info("remote backend: %s, tokenizer %s, FIM family %s (%s layout)", self.client.url, source,
                 self.template.name, self.prompts.layout)

    def release(self) -> None:
        """Idle policy: nothing heavy is held; the kept-alive connection is closed."""
        self.client.close()

    # -- documents -------------------------------------------------------------------------

    def open_document(self, uri: str, text: str) -> None:
        with self._lock:
            self._docs[uri] = text

    def update_document(self, uri: str, text: str, cursor: int | None = None) -> None:
        self.open_document(uri, text)

    def close_document(self, uri: str) -> None:
        with self._lock:
            self._docs.pop(uri, None)
            self._anchors.pop(uri, None)
        self.context.forget(uri)

    def set_corpus_file(self, name: str, text: str | None) -> None:
        """Workspace files: candidates for the prompt's context chunks (no lookup index here)."""
        self._corpus.set(name, text)

    def warm_context(self, budget_s: float) -> bool:
        """Idle work: choose the latest document's context chunks, as the local engine does
        (nothing to prefill: the server's prefix cache fills on the next request)."""
        if self.prompts is None or not self.options.auto_context or not self.template.file_sep:
            return False
        with self._lock:
            open_docs = dict(self._docs)
        self.context.budget_tokens = self.prompts.extra_tokens
        return self.context.warm_step(
            open_docs=open_docs, corpus=self._corpus, encode=self.prompts.encode,
            prompt_ids=lambda key, text, offset, chunks, path: self.prompts.build(
                text, offset, chunks, path, self._anchors.get(key), heal=False).ids,
            caches=_NoCaches(), new_state=_NoKV, budget_s=budget_s)

    # -- prompts ---------------------------------------------------------------------------

    def build_prompt(self, uri: str | None, text: str, offset: int, chunks=None, path: str | None = None) -> Prompt:
        """The document's prompt, as ``Engine.build_prompt`` builds it, without token healing."""
        with self._lock:
            previous = self._anchors.get(uri) if uri else None
        prompt = self.prompts.build(text, offset, chunks, path, previous, heal=False)
        if uri and self.prompts.anchored:
            with self._lock:
                self._anchors[uri] = prompt.anchor
        return prompt

    def _body(self, req: CompletionRequest, prompt: list[int] | str, max_tokens: int) -> dict[str, Any]:
        body: dict[str, Any] = {
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": max(0.0, req.temperature),
            "top_p": req.top_p,
            "stream": True,
            "stop": self.stop_texts,
            "stop_token_ids": self.stop_ids,  # vLLM: special tokens are not in its text, so strings miss them
            # llama.cpp servers: the model's own distribution (llama-cpp-python's default is 1.1)
            "repeat_penalty": 1.0,
        }
        if self._model_name:
            body["model"] = self._model_name
        if req.seed is not None:
            body["seed"] = req.seed
        body.update(self.remote.body or {})
        return {key: value for key, value in body.items() if value is not None}

    # -- completion ------------------------------------------------------------------------

    def complete(self, req: CompletionRequest, cancel: threading.Event | None = None) -> CompletionResult:
        self.ensure_loaded()
        with self._lock:
            text = req.text if req.text is not None else (self._docs.get(req.uri) if req.uri else None)
        if text is None:
            raise EngineError(f"document {req.uri!r} is not open and no text was given")
        offset = len(text) if req.offset is None else req.offset
        if not 0 <= offset <= len(text):
            raise EngineError(f"cursor offset {offset} is out of range 0..{len(text)}")
        started = time.monotonic()
        try:
            result = self._complete(req, text, offset, cancel, started)
        except Cancelled:
            with self._lock:
                self.cancelled += 1
            raise
        except RemoteError as err:
            with self._lock:
                self.failures += 1
                self.last_error = str(err)
            log.warning("%s", err)
            raise
        with self._lock:
            self.requests += 1
            self.last_error = None
            self.latency.add(result.first_token_ms if result.token_ids else None, result.total_ms)
        return result

    def _complete(self, req: CompletionRequest, text: str, offset: int, cancel: threading.Event | None,
                  started: float) -> CompletionResult:
        chunks = req.extra_context
        if not chunks and req.uri and self.options.auto_context:
            chunks = self.context.chunks_for(req.uri, text, offset, req.path or req.uri)
        prompt = self.build_prompt(req.uri, text, offset, chunks, req.path or req.uri)
        if not prompt.ids:
            raise EngineError("empty prompt: nothing before the cursor and no FIM template to frame it")
        budget_s = (self.options.time_budget_ms if req.time_budget_ms is None else req.time_budget_ms) / 1000
        max_tokens = max(1, self.options.max_tokens if req.max_tokens is None else req.max_tokens)
        stops = TextStops(self.stop_texts, req.single_line, prompt.indent if req.stop_at_block_end else None)
        with _Watch(self.client, cancel, started + budget_s) as watch:
            prompt_ids, stream = self._open(req, prompt.ids, max_tokens, watch)
            finish = stop_reason = first_token_s = None
            lost: BaseException | None = None
            try:
                for event in stream.events():
                    delta, finish = event_text(event)
                    if delta and first_token_s is None:
                        first_token_s = time.monotonic() - started
                    stop_reason = stops.feed(delta) if delta else None
                    watch.check()
                    if stop_reason or watch.why:
                        break  # after a finish_reason the stream still ends with [DONE]: read on
            except (OSError, http.client.HTTPException) as err:
                lost = err  # a cut socket (cancel, time budget) reads as an error too: decided below
            except RemoteError:
                self.client.close()
                raise
            if stream.done and lost is None and not stop_reason and not watch.why:
                self.client.finish(stream)  # kept alive for the next request
            else:
                self.client.close()  # closing the stream is how a server learns to stop generating
        if watch.why == "cancelled":
            raise Cancelled("completion cancelled")
        if watch.why is None and stop_reason is None and finish is None:
            raise self._lost(lost, stops.streamed)  # the stream ended without the server saying it was done
        stop_reason = stop_reason or watch.why or ("max_tokens" if finish == "length" else "eos")
        total_s = time.monotonic() - started
        return CompletionResult(
            text=stops.text(),
            token_ids=self.prompts.encode(stops.streamed),  # the server streams text: re-tokenized here
            prompt_ids=prompt_ids,
            stop_reason=stop_reason,
            first_token_ms=(first_token_s or total_s) * 1000,
            total_ms=total_s * 1000,
        )

    def _open(self, req: CompletionRequest, ids: list[int], max_tokens: int,
              watch: _Watch) -> tuple[list[int], _Stream]:
        """Send the prompt (ids, or text when the server takes only strings); the ids the server
        sees (text: what the same tokenizer makes of it) and the response's stream."""
        try:
            if not self._model_checked:
                self._model_name, self._model_checked = self._first_model(), True
        except RemoteError:
            self._raise_if_watched(watch)
            raise
        while True:
            if self._as_text:
                prompt: list[int] | str = self.tokenizer.decode(ids, skip_special_tokens=False,
                                                                clean_up_tokenization_spaces=False)
                seen = self.prompts.encode(prompt)
            else:
                prompt, seen = list(ids), list(ids)
            try:
                response = self.client.request("POST", self.client.path, self._body(req, prompt, max_tokens))
                return seen, _Stream(response)
            except RemoteError as err:
                self._raise_if_watched(watch)
                if self._as_text or self.remote.prompt != "auto" or not _refused_ids(err):
                    raise
                log.warning("the remote server refused a prompt of token ids (%s); sending prompt text from now "
                            "on (set model.remote_prompt = \"text\" to skip this try)", err)
                self._as_text = True

    def _raise_if_watched(self, watch: _Watch) -> None:
        """A request that failed because the watch cut it: say why (cancel, time budget)."""
        watch.check()
        if watch.why == "cancelled":
            raise Cancelled("completion cancelled") from None
        if watch.why == "time_budget":
            raise RemoteError(f"remote backend: no answer from {self.client.where} within the time "
                              f"budget ({watch.budget_ms:.0f} ms, engine.time_budget_ms)") from None

    def _first_model(self) -> str | None:
        """The server's first listed model, for servers that want one named (vLLM); None when it
        lists none (the request then names no model)."""
        try:
            names = self.client.models()
        except RemoteError as err:
            if err.status == 404:
                return None
            raise
        return names[0] if names else None

    def _lost(self, err: BaseException | None, streamed: str) -> RemoteError:
        got = f" after {len(streamed)} characters" if streamed else ""
        if isinstance(err, socket.timeout):
            return RemoteError(f"remote backend: {self.client.where} sent nothing for "
                               f"{self.remote.read_timeout_s:g} s{got} (model.remote_read_timeout_ms)")
        return RemoteError(f"remote backend: {self.client.where} closed the stream mid-completion{got}")

    # -- reporting -------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        with self._lock:
            latency = self.latency.describe()
            documents = len(self._docs)
            remote = {"url": self.client.url, "model": self._model_name, "requests": self.requests,
                      "failed": self.failures, "cancelled": self.cancelled, "last_error": self.last_error,
                      "prompt": "text" if self._as_text else "tokens", "token_healing": False, **latency}
        return {
            "loaded": self.loaded,
            "backend": "remote",
            "models": {"target": f"{self._model_name or 'remote model'} at {self.client.where}", "draft": None,
                       "tokenizer": self.tokenizer_source},
            "device": describe_remote(remote),
            "fim_family": self.template.name if self.template else None,
            "documents": documents,
            "corpus_files": len(self._corpus),
            "context": self.context.stats(),
            "requests": remote["requests"],
            "remote": remote,
        }


def doctor_report(cfg) -> tuple[bool, list[str]]:
    """``specd doctor``'s model section for the remote backend: the tokenizer loads, the server
    lists its models and writes a few tokens (with the times it took)."""
    try:
        engine = RemoteEngine(EngineOptions.from_config(cfg), RemoteOptions.from_config(cfg))
        engine.ensure_loaded()
    except EngineError as err:
        return False, [f"FAILED: {err}"]
    lines = [f"tokenizer: {engine.tokenizer_source} (FIM family {engine.template.name}, {engine.prompts.layout} "
             "layout; token healing off for remote)", f"server: {engine.client.url}"]
    started = time.monotonic()
    try:
        names = engine.client.models()
    except RemoteError as err:
        if err.status != 404:
            return False, lines + [f"FAILED: {err}"]
        names = []
    lines.append(f"models listed: {', '.join(names) or 'none'} ({(time.monotonic() - started) * 1000:.0f} ms)")
    try:
        result = engine.complete(CompletionRequest(text="def add(a, b):\n    return ", offset=26, max_tokens=4))
    except EngineError as err:
        return False, lines + [f"FAILED: {err}"]
    lines.append(f"a 4-token completion {result.text!r}: first token {result.first_token_ms:.0f} ms, total "
                 f"{result.total_ms:.0f} ms (prompt sent as {engine.stats()['remote']['prompt']})")
    engine.release()
    return True, lines


def describe_remote(remote: dict[str, Any]) -> str:
    """One line for ``specd status``: where, and how fast it answers."""
    line = f"remote {remote['url']}"
    first, total = remote.get("first_token_ms"), remote.get("total_ms")
    if total:
        line += (f" (first token p50 {first['p50']:.0f} ms, p95 {first['p95']:.0f} ms; " if first else " (")
        line += f"total p50 {total['p50']:.0f} ms; last {total['count']})"
    if remote.get("last_error"):
        line += f"; last error: {remote['last_error']}"
    return line


def _refused_ids(err: RemoteError) -> bool:
    """Whether an HTTP error reads like a server that takes only string prompts (a validation
    error about ``prompt``: llama-cpp-python answers 500, TGI and others 4xx)."""
    lowered = err.detail.lower()
    return err.status not in (None, 401, 403, 404) and "prompt" in lowered \
        and any(word in lowered for word in ("string", "str", "type", "valid"))


def _demo_target() -> str:
    from specd.demo import demo_pair_paths

    paths = demo_pair_paths()
    if paths is None:
        raise ModelLoadError("model.backend is remote and model.target is empty: set model.target to the "
                             "served model's tokenizer (a local folder or hub id)")
    return str(paths[0])

