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

HTTP, the event stream and cancellation: ``specd.engine.remote.client``.
"""

from __future__ import annotations

import http.client
import logging
import socket
import threading
import time
from collections import deque
from typing import Any

from specd.engine.front.engine_front import EngineFront, Fronted
from specd.engine.front.prompt import Prompt
from specd.engine.front.boundaries import BoundaryRules, Surroundings, surroundings
from specd.engine.front.stops import StopRules
from specd.engine.options import EngineOptions, context_window, resolve_request
from specd.engine.remote.client import (RemoteClient, RemoteError, RemoteOptions, Stream, Watch,
                                        event_text)
from specd.engine.types import Cancelled, CompletionRequest, CompletionResult, EngineError, ModelLoadError

log = logging.getLogger(__name__)

LATENCY_WINDOW = 100  # requests the latency figures cover


# -- stop rules on streamed text -----------------------------------------------------------------


class TextStops(StopRules):
    """specd's stop rules (``StopRules``: single line, end of block) on text as it streams in,
    plus the FIM stop tokens as strings (a server that renders special tokens shows them)."""

    def __init__(self, stop_texts: list[str], single_line: bool, block_indent: str | None, *,
                 rules: BoundaryRules | None = None, around: Surroundings | None = None):
        super().__init__(None, set(), single_line, block_indent, rules=rules, around=around)
        self.stop_texts = [s for s in stop_texts if s]
        self.streamed = ""
        self._delta = ""

    def feed(self, delta: str) -> str | None:
        self.streamed += delta
        self._delta = delta
        for stop in self.stop_texts:
            at = self.streamed.find(stop)
            if at >= 0:
                self.streamed = self.streamed[:at]
                return "eos"
        return self(-1)  # the rules read the text through _after_cursor, not the token

    def _breaks(self, token: int) -> bool:
        return "\r" in self._delta or "\n" in self._delta  # the text streams in deltas, not tokens

    def _after_cursor(self) -> str:
        return self.streamed


# -- the engine ----------------------------------------------------------------------------------


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


class RemoteEngine(Fronted):
    """A ``CompletionEngine`` whose completions come from a remote server (module docstring)."""

    def __init__(self, options: EngineOptions, remote: RemoteOptions, tokenizer_source: str = ""):
        self.options = options
        self.remote = remote
        self.client = RemoteClient(remote)
        self.tokenizer_source = tokenizer_source or options.target
        self.tokenizer = None
        self.front = EngineFront(options, track_edits=False)  # no idle prefill: the server caches prefixes
        self._lock = threading.Lock()  # the counters: stats() reads them from other threads
        self._as_text = remote.prompt == "text"
        self._model_name: str | None = remote.model or None
        self._model_checked = bool(remote.model)
        self.latency = _Latency()
        self.requests = self.failures = self.cancelled = 0
        self.last_error: str | None = None

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
        self.front.install(self.tokenizer, source, context_window(source))  # no healing vocabulary: healing off
        self.stop_ids = sorted(self.prompts.stop_ids())
        self.stop_texts = sorted({self.tokenizer.convert_ids_to_tokens(i) for i in self.stop_ids} - {None})
        log.info("remote backend: %s, tokenizer %s, FIM family %s (%s layout)", self.client.url, source,
                 self.template.name, self.prompts.layout)

    def release(self) -> None:
        """Idle policy: nothing heavy is held; the kept-alive connection is closed."""
        self.client.close()

    # -- documents -------------------------------------------------------------------------

    def open_document(self, uri: str, text: str) -> None:
        self.front.documents.open(uri, text)

    def update_document(self, uri: str, text: str, cursor: int | None = None) -> None:
        self.front.documents.update(uri, text, cursor)

    def close_document(self, uri: str) -> None:
        self.front.close_document(uri)

    def set_corpus_file(self, name: str, text: str | None) -> None:
        """Workspace files: candidates for the prompt's context chunks (no lookup index here)."""
        self.front.corpus.set(name, text)

    def warm_context(self, budget_s: float) -> bool:
        """Idle work: choose the latest document's context chunks, as the local engine does
        (nothing to prefill: the server's prefix cache fills on the next request)."""
        return self.front.warm_context(budget_s)

    # -- prompts ---------------------------------------------------------------------------

    def build_prompt(self, uri: str | None, text: str, offset: int, chunks=None, path: str | None = None) -> Prompt:
        """The document's prompt, as ``Engine.build_prompt`` builds it, without token healing."""
        return self.front.build_prompt(uri, text, offset, chunks, path, heal=False)

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
        text, offset = self.front.resolve(req)
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
        prompt = self.front.request_prompt(req, text, offset, heal=False)
        settings = resolve_request(req, self.options)
        stops = TextStops(self.stop_texts, req.single_line, prompt.indent, rules=settings.rules,
                          around=surroundings(text, offset))
        with Watch(self.client, cancel, started + settings.budget_s) as watch:
            prompt_ids, stream = self._open(req, prompt.ids, settings.max_tokens, watch)
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
        stop_reason = stops.finish(stop_reason)  # a boundary the finished text shows
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
              watch: Watch) -> tuple[list[int], Stream]:
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
                return seen, Stream(response)
            except RemoteError as err:
                self._raise_if_watched(watch)
                if self._as_text or self.remote.prompt != "auto" or not _refused_ids(err):
                    raise
                log.warning("the remote server refused a prompt of token ids (%s); sending prompt text from now "
                            "on (set model.remote_prompt = \"text\" to skip this try)", err)
                self._as_text = True

    def _raise_if_watched(self, watch: Watch) -> None:
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
            remote = {"url": self.client.url, "model": self._model_name, "requests": self.requests,
                      "failed": self.failures, "cancelled": self.cancelled, "last_error": self.last_error,
                      "prompt": "text" if self._as_text else "tokens", "token_healing": False, **latency}
        return {
            "loaded": self.loaded,
            "backend": "remote",
            "models": {"target": f"{self._model_name or 'remote model'} at {self.client.where}", "draft": None,
                       "tokenizer": self.tokenizer_source},
            "device": describe_remote(remote),
            **self.front.stats(),
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
