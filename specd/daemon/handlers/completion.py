"""``complete`` and ``cancel``: a completion request built from a buffer (or a stateless text),
queued for the model worker and awaited; a newer complete for a document supersedes the one in
flight; cancel, close and disconnect stop a job at the engine's next step.

The only holder of a queued request's text is its job's closure, so dropping the job (done,
cancelled, superseded) drops the text.
"""

from __future__ import annotations

import asyncio
import collections
import time
from dataclasses import replace
from typing import Any, Callable, Generator

from specd.daemon.admission import Connection
from specd.daemon.buffers import BufferStore, TextIndex, document_index, index_in_steps, locate
from specd.daemon.engine_api import completion_steps
from specd.daemon.handlers.documents import DocumentLocks
from specd.daemon.metrics import LatencyWindow
from specd.daemon.params import CancelParams, CompleteParams, LineCursor
from specd.daemon.scheduler import Job, Scheduler
from specd.engine.types import CompletionRequest
from specd.protocol.errors import ErrorCode, RpcError
from specd.protocol.methods import PROGRESS_NOTIFICATION


def _error_code(err: BaseException) -> str:
    code = getattr(err, "code", None)
    return code if isinstance(code, str) else ErrorCode.ENGINE_ERROR.value


def _completion_job(req: Any, batch: bool, on_step: Callable[[Any], None] | None) -> Job:
    """The model work for one ``complete``, step by step; its closure is the only holder of
    ``req``."""
    def steps(engine: Any, cancel: Any) -> Generator[Any, None, dict[str, Any]]:
        result = yield from completion_steps(engine, req, cancel)
        return result.to_dict()

    return Job(steps=steps, on_step=on_step, label=f"complete {req.uri or '<text>'}", key=req.uri, batch=batch)


# A note whose settled text is unchanged (only the line being written grew) waits this long
# after the last note: every note carries the whole text so far, so one per decoding step would
# cost a fast engine's client quadratic bytes and parsing; at this spacing a client's wait for a
# partial line reads a tail at most a token or two behind a CPU model, and a fast engine's
# stream stays a few dozen notes a second.
TAIL_NOTE_INTERVAL_S = 0.03


class _Stream:
    """Sends a streamed complete's text as ``progress`` notifications: at once when the settled
    lines changed, and when only the line being written (the tail) grew, at most one note per
    ``TAIL_NOTE_INTERVAL_S``. Runs on the worker thread; the notifications are written on the
    event loop, before the result."""

    def __init__(self, conn: Connection, msgid: int):
        self.session = conn.session
        self.msgid = msgid
        self.loop = asyncio.get_running_loop()
        self.sent = ""  # the settled text of the last note
        self.sent_tail = ""
        self.sent_at = float("-inf")  # time.monotonic() of the last note

    def __call__(self, progress: Any) -> None:
        text = progress.text()
        settled = text[:max(text.rfind("\n"), 0)]
        tail = text[len(settled):]
        now = time.monotonic()
        if settled == self.sent and (tail == self.sent_tail or now - self.sent_at < TAIL_NOTE_INTERVAL_S):
            return
        self.sent, self.sent_tail, self.sent_at = settled, tail, now
        note = {"msgid": self.msgid, "text": settled, "tail": tail, "tokens": progress.tokens}
        try:
            self.loop.call_soon_threadsafe(self.session.notify_nowait, PROGRESS_NOTIFICATION, note)
        except RuntimeError:  # the loop closed: nobody is waiting for the stream any more
            pass


class CompletionMethods:
    def __init__(self, buffers: BufferStore, locks: DocumentLocks, completions: Scheduler, *,
                 load_failure: Callable[[], RpcError | None], on_finished: Callable[[], None],
                 max_tokens_cap: int, default_max_tokens: int,
                 on_document_request: Callable[[str], None] | None = None):
        self.buffers = buffers
        # A complete on an open document: the engine's copy of it should be current (the
        # document mirror sends a held update at once).
        self._on_document_request = on_document_request
        # Every complete generates at most max_tokens_cap tokens: a larger ask (or default) is
        # lowered to it, so no client can hold the model for an unbounded job.
        self.max_tokens_cap = max_tokens_cap
        self.default_max_tokens = default_max_tokens
        self.locks = locks
        self.completions = completions
        self._load_failure = load_failure  # the error every request gets once the models failed to load
        self._on_finished = on_finished  # a completion ended: the engine's figures changed
        self.jobs_by_uri: dict[str, Job] = {}  # the complete in flight for each document
        self.latency = LatencyWindow()
        self.counts: collections.Counter[str] = collections.Counter()  # completed, cancelled, failed, superseded

    async def _request(self, params: CompleteParams) -> tuple[CompletionRequest, int | None]:
        """The engine's request for ``params``: the parsed one, with the text it reads, the
        cursor's offset in it and max_tokens within the cap; and the version of that text."""
        asked = params.request
        version = None
        if asked.text is None:
            doc = self.buffers.get(asked.uri)
            text, version = doc.text, doc.version
            index = await document_index(doc) if isinstance(params.cursor, LineCursor) else doc.index
        else:
            text = asked.text
            self.buffers.check_size(text, "text")
            index = await index_in_steps(text) if isinstance(params.cursor, LineCursor) else TextIndex(text)
        offset = locate(index, params.cursor)
        for number, chunk in enumerate(asked.extra_context):
            self.buffers.check_size(chunk.text, f"extra_context[{number}]")
        max_tokens = asked.max_tokens
        if (self.default_max_tokens if max_tokens is None else max_tokens) > self.max_tokens_cap:
            max_tokens = self.max_tokens_cap
        return replace(asked, text=text, offset=offset, max_tokens=max_tokens), version

    async def complete(self, conn: Connection, params: CompleteParams, msgid: int | None) -> dict[str, Any]:
        if params.request.text is None:  # the open document, after the changes sent before this request
            async with self.locks.hold(params.request.uri):
                req, version = await self._request(params)
            if self._on_document_request is not None:
                self._on_document_request(params.request.uri)
        else:
            req, version = await self._request(params)
        if (failure := self._load_failure()) is not None:
            raise failure
        received = time.monotonic()
        msgid = msgid if msgid is not None else 0
        uri, offset = req.uri, req.offset
        # Text this job keeps alive while it waits: a stateless text, or a document snapshot
        # that a later change would otherwise have released.
        held = len(req.text) + sum(len(chunk.text) for chunk in req.extra_context)
        stream = _Stream(conn, msgid) if params.stream and conn.session is not None else None
        job = _completion_job(req, conn.batch if params.batch is None else params.batch, stream)
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
            self._on_finished()  # its requests, acceptance, errors are in the next status
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

    async def cancel(self, conn: Connection, params: CancelParams, msgid: int | None) -> dict[str, Any]:
        targets = []
        if params.msgid is not None and params.msgid in conn.jobs:
            targets.append(conn.jobs[params.msgid])
        if params.uri is not None and params.uri in self.jobs_by_uri:
            targets.append(self.jobs_by_uri[params.uri])
        for job in targets:
            job.request_cancel("cancelled by the client")
            self.completions.discard(job)
        return {"cancelled": len(targets)}

    def document_closed(self, uri: str) -> None:
        job = self.jobs_by_uri.get(uri)
        if job is not None:
            job.request_cancel("the document was closed")

    def disconnected(self, conn: Connection) -> None:
        """``conn``'s peer is gone: its completions are moot."""
        for job in list(conn.jobs.values()):
            job.request_cancel("the client disconnected")
            self.completions.discard(job)
