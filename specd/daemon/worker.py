"""The one thread that does model work, and the thread that mirrors buffers into the engine.

``ModelWorker`` owns the engine: it loads it, runs jobs, releases the models after an idle
period and reloads them for the next job. The event loop only admits jobs to the scheduler and
awaits their futures, so it never blocks on the model.

Jobs run interleaved, step by step, in the order the scheduler (``scheduler.Scheduler``, the
one fairness policy) gives: the worker asks it for the next job, runs one step of it, charges
the time to the job's lane and asks again. A job with ``steps`` is a generator that yields
between its steps (a completion: after its prefill and each decode step,
``Engine.complete_steps``); each job works on its own document's state, and time a job spends
suspended is not charged to its time budget (``speculation.loop``). A job with only ``fn``
runs to its end in one go.

When no job is started or waiting, the worker gives the engine idle time in short slices
(``BACKGROUND_SLICE_S``), running the idle work the engine declares (``engine_api.idle_work``,
in priority order): ``prefill_pending`` prefills the cache of the document just edited (where
the edit ended), ``index_pending_buffers`` re-tokenizes the edited parts of open buffers for
lookup (a completion never does that for a large one), ``index_pending_corpus`` tokenizes
workspace files, ``warm_context`` prefills a document's cache with a new set of context chunks.
A job that arrives waits one slice at most; ``wake`` (the document mirror or the workspace
watcher fed the engine) starts the slices without a job. Idle work never runs while a job is
started: it would move the caches under it.

A job carries a ``threading.Event`` the engine polls between decoding steps; setting it
(``cancel``/supersede/disconnect/shutdown) makes the job raise ``Cancelled`` at its next step. A
job cancelled before it starts never reaches the engine: its future is cancelled at once.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Generator

from specd.daemon.engine_api import CorpusEngine, FocusesDocuments, idle_work
from specd.daemon.heap import ClosedMemory
from specd.daemon.scheduler import Job, Scheduler
from specd.protocol.errors import ErrorCode, RpcError

__all__ = ["DocumentMirror", "ModelWorker"]

log = logging.getLogger("specd.worker")

# Worker states, as `status` reports them.
STARTING = "starting"
LOADING = "loading"
READY = "ready"
UNLOADED = "unloaded"
FAILED = "failed"  # the first load failed; the daemon exits
STOPPED = "stopped"

EngineFactory = Callable[[], Any]

BACKGROUND_SLICE_S = 0.02  # idle work per slice: the longest a new job waits for it


class ModelWorker:
    def __init__(
        self,
        load_engine: EngineFactory,
        scheduler: Scheduler,
        idle_unload_s: float = 0,
        on_state: Callable[[str], None] | None = None,
    ):
        self._load_engine = load_engine
        self.scheduler = scheduler
        self.idle_unload_s = idle_unload_s
        self._on_state = on_state
        self._thread = threading.Thread(target=self._run, name="specd-model-worker", daemon=True)
        self._stopping = False
        self.engine: Any = None
        self.state = STARTING
        self.load_error: BaseException | None = None
        self.current: Job | None = None  # the job whose step runs now (or ran last, until it ends)
        self._steps: dict[Job, Generator[Any, None, Any]] = {}  # started stepped jobs, in the order they began
        self.loaded_at: float | None = None
        self.last_activity = time.monotonic()
        self.load_seconds: float | None = None

    # -- the event loop's side -------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def wake(self) -> None:
        """There is background work (the engine's corpus changed): do it when idle."""
        self.scheduler.wake()

    def stop(self, timeout: float | None = None) -> None:
        """Fail the waiting jobs, finish the started ones, stop."""
        self.scheduler.fail_all(self.load_error if self.state == FAILED else None)
        self._stopping = True
        self.scheduler.wake()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def load_failure(self) -> RpcError | None:
        """The error every request gets once the first load failed; None before or without."""
        if self.state != FAILED:
            return None
        return RpcError(ErrorCode.MODEL_LOAD_ERROR, f"cannot load models: {self.load_error}")

    def set_corpus_file(self, path: str, text: str | None) -> bool:
        """A workspace file for the engine's lookup corpus (None: gone), from the workspace
        watcher's thread; False when there is no engine yet, or it keeps no corpus."""
        engine = self.engine
        if not isinstance(engine, CorpusEngine):
            return False
        engine.set_corpus_file(path, text)
        return True

    # -- the worker thread -----------------------------------------------------------------

    def _set_state(self, state: str) -> None:
        self.state = state
        if self._on_state is not None:
            try:
                self._on_state(state)
            except Exception:  # the callback must never kill the model thread
                log.exception("state callback failed")

    def _ensure_loaded(self) -> None:
        """Load (first time) or reload (after an idle release) the engine; raises on failure."""
        if self.state == READY:
            return
        self._set_state(LOADING)
        started = time.monotonic()
        try:
            if self.engine is None:
                self.engine = self._load_engine()
            else:
                self.engine.ensure_loaded()
        except BaseException as err:
            self.load_error = err
            first_load = self.engine is None
            self._set_state(FAILED if first_load else UNLOADED)
            raise
        self.load_seconds = time.monotonic() - started
        self.loaded_at = time.time()
        self.load_error = None
        self._set_state(READY)

    def _maybe_unload(self) -> None:
        idle = time.monotonic() - self.last_activity
        if self.state == READY and self.idle_unload_s > 0 and idle >= self.idle_unload_s:
            log.info("idle for %.0f s: releasing models and caches", idle)
            try:
                self.engine.release()
            except Exception:
                log.exception("release failed")
            self._set_state(UNLOADED)

    def _poll_interval(self) -> float:
        if self.idle_unload_s <= 0:
            return 1.0
        return max(0.05, min(1.0, self.idle_unload_s / 4))

    def _run(self) -> None:
        try:
            self._ensure_loaded()
        except BaseException as err:  # reported through state FAILED and load_error
            log.error("cannot load models: %s", err)
            return
        self.last_activity = time.monotonic()
        background = True
        while not (self._stopping and not self._steps):
            # Stopping, started jobs finish but no new one starts.
            job = self.scheduler.next_job(0 if background else self._poll_interval(), start=not self._stopping)
            if job is not None:
                self._turn(job)
                self.last_activity = time.monotonic()
                background = True  # a completion may have moved the cursor to where new context belongs
            elif not self._stopping:
                self._maybe_unload()
                background = self.state == READY and self._background()
        self._set_state(STOPPED)

    def _background(self) -> bool:
        """One slice of the engine's idle work; True while more remains. Never loads models and
        does not count as activity (idle unload still happens)."""
        for work in idle_work(self.engine):
            try:
                if work(BACKGROUND_SLICE_S):
                    return True
            except Exception:  # idle work is an optimisation: log it, never die of it
                log.exception("background %s failed", work.__name__)
                return False
        return False

    def _turn(self, job: Job) -> None:
        """The scheduler's choice: ``job``'s first step (starting it) or its next."""
        self.current = job
        if job in self._steps or self._begin(job):
            self._step(job)

    def _begin(self, job: Job) -> bool:
        """Start ``job``: a job in one go runs to its end now; True for a stepped one, kept."""
        try:
            self._ensure_loaded()
            if job.steps is None:
                result = job.fn(self.engine, job.cancel)
            else:
                self._steps[job] = job.steps(self.engine, job.cancel)
                return True
        except BaseException as err:  # handed to the awaiting request, never lost
            self._end(job, error=err)
        else:
            self._end(job, result)
        return False

    def _step(self, job: Job) -> None:
        began = time.monotonic()
        try:
            made = next(self._steps[job])
        except StopIteration as done:
            self.scheduler.charge(job, time.monotonic() - began)
            self._end(job, done.value)
            return
        except BaseException as err:  # handed to the awaiting request, never lost
            self.scheduler.charge(job, time.monotonic() - began)
            self._end(job, error=err)
            return
        self.scheduler.charge(job, time.monotonic() - began)
        if job.on_step is not None:
            try:
                job.on_step(made)
            except Exception:  # a listener's failure must not end the job or the thread
                log.exception("step listener of %s failed", job.label)

    def _end(self, job: Job, result: Any = None, error: BaseException | None = None) -> None:
        self._steps.pop(job, None)
        self.scheduler.ended(job)
        # before answering: whoever got the answer sees the worker idle (or on another job)
        self.current = next(iter(self._steps), None)
        if error is not None:
            job.future.set_exception(error)
        else:
            job.future.set_result(result)


# A large document's update costs the engine work proportional to the whole text (comparing the old
# and new texts to find the edit: tens of milliseconds for a document of several MiB, in C calls
# that hold the GIL; docs/reliability.md has the timings), and then idle work on the model thread
# (prefilling where the edit ended). Such updates wait until the document has been quiet for
# LARGE_QUIET_S (only the latest text is sent), and while others are served (``busy``: a completion
# started or queued on the model thread, or another connection's requests lately), for at most
# LARGE_MAX_DELAY_S in all. A completion on the document itself makes its update due at once
# (``flush``). Opens and closes cost the engine little and are never held. Lossless decoding makes
# the engine's copy an optimisation (lookup drafts, idle prefill), never what a completion's text is
# read from.
LARGE_UPDATE_CHARS = 1 << 20
LARGE_QUIET_S = 0.2
LARGE_MAX_DELAY_S = 5.0
LARGE_POLL_S = 0.01  # how often held updates are looked at again


@dataclass
class _Pending:
    text: str | None  # None: closed, unless ``focus`` is set (a focus alone)
    cursor: int | None = None
    focus: int | None = None  # where the editor's cursor came to rest, after the text (``focus``)
    owner: int | None = None  # the connection that sent it
    first_at: float = 0.0  # when the oldest update not yet sent came in
    last_at: float = 0.0  # when the latest came in
    urgent: bool = False  # a completion on the document is coming: send it now


class DocumentMirror:
    """Keeps the engine's view of open documents current, off the event loop.

    A mirror, not a shared store: the engine reads its documents on the model thread while the
    loop edits the buffers, so the two share only immutable ``str`` snapshots, handed over here.
    Updates coalesce: only the latest text of each document is sent, so fast typing in a large
    file costs one ``update_document`` per pause, not one per keystroke; a large document's
    updates are also held while it is being edited and while model work runs (see
    LARGE_UPDATE_CHARS). Until the engine exists updates are dropped; ``replay`` sends every
    open document once it does. After a batch that closed large documents (their last
    references are dropped here, in the engine), the freed memory goes back to the system
    (``heap.ClosedMemory``).
    """

    def __init__(self, worker: ModelWorker, busy: Callable[[int | None], bool] | None = None):
        self._worker = worker  # whose engine gets the documents, woken after: edited ones get prefilled when idle
        self._busy = busy or (lambda owner: False)  # others than ``owner`` are being served
        self._pending: dict[str, _Pending] = {}  # uri -> its latest text (and cursor), or its close
        self._known: dict[str, int] = {}  # uris the engine has open -> characters of their last text
        self.closed_memory = ClosedMemory()
        self._engine_seen: Any = None
        self._cond = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="specd-doc-mirror", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def set(self, uri: str, text: str, cursor: int | None = None, owner: int | None = None) -> None:
        """The document's latest text and, after a ranged change, where its last edit ended;
        ``owner``: the connection that sent it."""
        now = time.monotonic()
        with self._cond:
            held = self._pending.get(uri)
            first_at = held.first_at if held is not None and held.text is not None else now
            self._pending[uri] = _Pending(text, cursor, owner, first_at, now, held is not None and held.urgent)
            self._cond.notify()

    def focus(self, uri: str, offset: int) -> None:
        """The editor's cursor came to rest at ``offset`` of ``uri``'s latest text: the engine
        hears it after that text (a close meanwhile makes it moot)."""
        with self._cond:
            held = self._pending.get(uri)
            if held is None:
                self._pending[uri] = _Pending(None, focus=offset)
            elif held.text is not None or held.focus is not None:
                held.focus = offset
            self._cond.notify()

    def close(self, uri: str) -> None:
        with self._cond:
            self._pending[uri] = _Pending(None)
            self._cond.notify()

    def flush(self, uri: str) -> None:
        """A completion on ``uri`` is coming: send its held update now."""
        with self._cond:
            held = self._pending.get(uri)
            if held is not None and not held.urgent:
                held.urgent = True
                self._cond.notify()

    def replay(self, documents: dict[str, str]) -> None:
        now = time.monotonic()
        with self._cond:
            self._pending.update({uri: _Pending(text, None, None, now, now) for uri, text in documents.items()})
            self._cond.notify()

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(5)

    def _held(self, uri: str, update: _Pending, now: float) -> bool:
        """Whether ``update`` waits: a large document's update, still being edited or while
        others are served, within LARGE_MAX_DELAY_S."""
        if update.text is None or update.urgent or uri not in self._known:
            return False
        if max(len(update.text), self._known[uri]) < LARGE_UPDATE_CHARS:
            return False
        if now - update.first_at >= LARGE_MAX_DELAY_S:
            return False
        return now - update.last_at < LARGE_QUIET_S or self._busy(update.owner)

    def _take(self) -> dict[str, _Pending] | None:
        """The updates to send now (waiting until there are some); None once stopping."""
        with self._cond:
            while True:
                if self._stopping:
                    return None
                now = time.monotonic()
                due = {uri: update for uri, update in self._pending.items() if not self._held(uri, update, now)}
                if due:
                    for uri in due:
                        del self._pending[uri]
                    return due
                self._cond.wait(LARGE_POLL_S if self._pending else None)

    def _run(self) -> None:
        while True:
            batch = self._take()
            if batch is None:
                return
            engine = self._worker.engine
            if engine is None:
                continue  # replay() resends everything once the engine exists
            if engine is not self._engine_seen:
                self._engine_seen, self._known = engine, {}
            for uri, latest in batch.items():
                try:
                    if latest.text is not None:
                        if uri in self._known:
                            engine.update_document(uri, latest.text, latest.cursor)
                        else:
                            engine.open_document(uri, latest.text)
                        self._known[uri] = len(latest.text)
                    elif latest.focus is None and uri in self._known:  # a close (a focus alone has no text)
                        self.closed_memory.closed(self._known.pop(uri))
                        engine.close_document(uri)
                    if latest.focus is not None and uri in self._known and isinstance(engine, FocusesDocuments):
                        engine.focus_document(uri, latest.focus)
                except Exception:  # the engine's lookup index is an optimisation: log, go on
                    log.exception("engine document sync failed for %s", uri)
            batch = latest = None  # the closed texts' last references, dropped before the trim
            with self._cond:
                settled = not self._pending
            if settled:
                self.closed_memory.settle()
            self._worker.wake()
