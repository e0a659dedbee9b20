"""The one scheduler: which completions are admitted, and whose step the model runs next.

Every job passes through here from its admission to its end, on one fairness policy. The
event loop admits and cancels (``put``, ``discard``); the model worker asks for each next step
(``next_job``), charges the model time the step took (``charge``) and reports the job's end
(``ended``). The two threads share the state under one lock, held for bookkeeping only, never
across a step.

- **Admission.** What one connection (its *lane*) may have waiting behind the job it has (or
  is about to have) started is bounded in count and in text; a ``busy`` refusal carries
  ``retry_after_ms``: when this connection's running job should be done, from the recent
  service time of its completes.
- **Moot jobs leave at once.** A waiting job cancelled or superseded leaves with its text (its
  future's cancel drops it), so no request outlives the client's interest in it.
- **One policy for the next step.** A lane runs one job at a time, and at most
  ``MAX_STARTED`` jobs are started at once (each holds its document's KV state). The next
  step is a started job's next or a waiting job's first, chosen alike: a cancelled started
  job first (its step ends it, freeing what it holds), then interactive before batch, then
  the lane that had the least model time lately (an exponentially decayed sum, half-life
  ``LANE_HALF_LIFE_S``), then the job that came first. So a client with 64 queued completes
  delays another's single complete by a few of its steps, not by 64 jobs, and two long jobs
  share the model in turns.
"""

from __future__ import annotations

import collections
import concurrent.futures
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Generator

from specd.protocol.errors import ErrorCode, RpcError

MAX_STARTED = 8  # jobs started at once, one per connection (each holds a KV state)
MAX_QUEUED_PER_CONNECTION = 16
LANE_HALF_LIFE_S = 2.0  # how fast a lane's model time is forgotten when choosing the next step
# busy's retry hint: a service time seen lately (an exponential average of started-to-done
# seconds, per connection and over all), within these bounds.
RETRY_AFTER_MIN_MS = 10
RETRY_AFTER_MAX_MS = 60_000
RETRY_AFTER_DEFAULT_MS = 100  # before any completion has finished
SERVICE_AVERAGE_WEIGHT = 0.3  # of the newest job in the average
RETRY_AFTER_LATE_SHARE = 0.25  # of the service time: the hint once the running job is past it
FORGET_AFTER = 64  # lanes remembered past the live ones (model time, service time)


@dataclass(eq=False)
class Job:
    fn: Callable[[Any, threading.Event], Any] | None = None  # (engine, cancel) -> result, in one go
    steps: Callable[[Any, threading.Event], Generator[Any, None, Any]] | None = None  # or step by step
    on_step: Callable[[Any], None] | None = None  # what each step yields, on the worker thread
    label: str = "job"
    key: str | None = None  # the document it works on, for supersede
    lane: int = 0  # who asked (a connection): model time is shared between lanes
    batch: bool = False  # batch work runs only when no interactive step is waiting
    held_chars: int = 0  # text it keeps alive while it waits (admission's bound)
    model_s: float = 0.0  # model time it has had so far
    cancel: threading.Event = field(default_factory=threading.Event)
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    cancel_reason: str = ""
    enqueued_at: float = field(default_factory=time.monotonic)
    started_at: float | None = None

    def request_cancel(self, reason: str) -> None:
        """Stop this job: at once if still waiting, at the engine's next step if running."""
        if not self.cancel.is_set():
            self.cancel_reason = reason
            self.cancel.set()
        self.future.cancel()  # only succeeds while the job is still waiting

    @property
    def running(self) -> bool:
        return self.started_at is not None and not self.future.done()


def _averaged(average: float | None, sample: float) -> float:
    return sample if average is None else average + SERVICE_AVERAGE_WEIGHT * (sample - average)


class Scheduler:
    def __init__(self, max_queued_chars: int, max_per_connection: int = MAX_QUEUED_PER_CONNECTION,
                 max_started: int = MAX_STARTED):
        self.max_queued_chars = max_queued_chars  # per connection, over its waiting jobs' texts
        self.max_per_connection = max_per_connection
        self.max_started = max_started
        # Reentrant: answering a job's future runs its callbacks, which may come back here.
        self._lock = threading.Condition(threading.RLock())
        self._lanes: dict[int, collections.deque[Job]] = {}  # lane -> its waiting jobs, oldest first
        self._waiting: dict[concurrent.futures.Future, Job] = {}  # every waiting job, by its future
        self._started: list[Job] = []  # begun and not ended, in the order they began
        self._lane_time: dict[int, tuple[float, float]] = {}  # lane -> (decayed model seconds, as of when)
        self._service_s: dict[int, float] = {}  # lane -> recent started-to-done seconds (average)
        self._service_all_s: float | None = None
        self._woken = False  # the worker has idle work to look at: its next wait ends at once

    # -- the event loop's side: admission, cancel, what status shows -------------------------

    def __len__(self) -> int:
        """Jobs waiting (admitted, not started)."""
        return len(self._waiting)

    def waiting(self, lane: int) -> int:
        """How many of ``lane``'s jobs wait (admitted, not started)."""
        return len(self._lanes.get(lane, ()))

    def handed(self, lane: int) -> int:
        """How many of ``lane``'s jobs the worker holds (started, not ended)."""
        with self._lock:
            return sum(1 for job in self._started if job.lane == lane)

    def started(self) -> list[Job]:
        """The jobs begun and not ended, in the order they began."""
        with self._lock:
            return list(self._started)

    def put(self, lane: int, job: Job, chars: int) -> None:
        """Admit ``job`` for connection ``lane``; ``chars`` is the text it keeps alive. Raises
        ``busy`` past the lane's bounds."""
        with self._lock:
            behind = self._behind(lane)
            if len(behind) >= self.max_per_connection:
                raise self._busy(lane, f"{len(behind)} completions of this connection are already waiting (the limit)")
            held = sum(other.held_chars for other in behind)
            if behind and held + chars > self.max_queued_chars:
                raise self._busy(lane, f"completions waiting on this connection already hold {held} "
                                       f"characters of text (the limit is {self.max_queued_chars})")
            job.lane, job.held_chars = lane, chars
            self._lanes.setdefault(lane, collections.deque()).append(job)
            self._waiting[job.future] = job
            self._lock.notify()
        job.future.add_done_callback(self._left)  # a cancel while waiting drops it (and its text) at once

    def _behind(self, lane: int) -> list[Job]:
        """``lane``'s waiting jobs behind the one it has started, or would start next."""
        waiting = list(self._lanes.get(lane, ()))
        starts_next = len(self._started) < self.max_started and all(job.lane != lane for job in self._started)
        return waiting[1:] if starts_next else waiting

    def _busy(self, lane: int, message: str) -> RpcError:
        after_ms = self.retry_after_ms(lane)
        return RpcError(ErrorCode.BUSY, f"{message}; retry in about {after_ms} ms", {"retry_after_ms": after_ms})

    def retry_after_ms(self, lane: int) -> int:
        """About when ``lane``'s running job is done, making room in its queue: its recent
        service time (everyone's when it has none yet) less what its running job has had."""
        service_s = self._service_s.get(lane, self._service_all_s)
        if service_s is None:
            return RETRY_AFTER_DEFAULT_MS
        now = time.monotonic()
        with self._lock:
            running = max((now - job.started_at for job in self._started
                           if job.lane == lane and job.started_at is not None), default=0.0)
        # A job past the usual service time may end any moment, or not for long: a quarter of
        # the longer of the two (a job that has run 3 s is no 80 ms one, whatever other
        # connections' completes take) spaces the retries without leaving the room unused long.
        left_s = max(service_s - running, RETRY_AFTER_LATE_SHARE * max(service_s, running))
        return int(min(RETRY_AFTER_MAX_MS, max(RETRY_AFTER_MIN_MS, left_s * 1000)))

    def discard(self, job: Job) -> None:
        """Forget ``job`` if it is still waiting (it was cancelled or superseded)."""
        with self._lock:
            self._take(job)

    def _left(self, future: concurrent.futures.Future) -> None:
        """A job's future is done: if it was still waiting (cancelled), it leaves now."""
        with self._lock:
            job = self._waiting.get(future)
            if job is not None:
                self._take(job)

    def _take(self, job: Job) -> bool:
        """Remove ``job`` from the waiting ones; False if it was not waiting."""
        if self._waiting.pop(job.future, None) is None:
            return False
        waiting = self._lanes[job.lane]
        waiting.remove(job)
        if not waiting:
            del self._lanes[job.lane]
        return True

    def fail_all(self, error: BaseException | None) -> None:
        """Answer every waiting job: with ``error`` when given, else as cancelled."""
        with self._lock:
            jobs = list(self._waiting.values())
            for job in jobs:
                self._take(job)
        for job in jobs:
            if error is not None and job.future.set_running_or_notify_cancel():
                job.future.set_exception(error)
            else:
                job.request_cancel("the daemon is shutting down")

    def lane_seconds(self, lane: int) -> float:
        """``lane``'s recent model time (decayed, half-life ``LANE_HALF_LIFE_S``), seconds."""
        with self._lock:
            return self._lane_seconds(lane, time.monotonic())

    # -- the worker's side -----------------------------------------------------------------

    def wake(self) -> None:
        """The worker has idle work to look at: its wait in ``next_job`` ends now."""
        with self._lock:
            self._woken = True
            self._lock.notify()

    def next_job(self, timeout: float, start: bool = True) -> Job | None:
        """The job whose step runs next, waiting up to ``timeout`` seconds for one: a started
        job, or (``start``) a waiting one started now (its future running, ``started_at``
        set). None when there is none, or ``wake`` was called."""
        with self._lock:
            job = self._choose(start)
            if job is None and timeout > 0 and not self._woken:
                self._lock.wait(timeout)
                job = self._choose(start)
            self._woken = False
            return job

    def _choose(self, start: bool) -> Job | None:
        now = time.monotonic()
        while True:
            candidates = list(self._started)
            if start and len(self._started) < self.max_started:
                running = {job.lane for job in self._started}
                candidates += [waiting[0] for lane, waiting in self._lanes.items() if lane not in running]
            if not candidates:
                return None
            job = min(candidates, key=lambda job: (not job.cancel.is_set(), job.batch,
                                                   self._lane_seconds(job.lane, now), job.enqueued_at))
            if job.started_at is not None:
                return job
            self._take(job)
            if job.future.set_running_or_notify_cancel():  # else cancelled meanwhile: look again
                job.started_at = now
                self._started.append(job)
                return job

    def charge(self, job: Job, seconds: float) -> None:
        """``job`` had ``seconds`` of model time: its lane's share grows by as much."""
        now = time.monotonic()
        with self._lock:
            job.model_s += seconds
            self._lane_time[job.lane] = (self._lane_seconds(job.lane, now) + seconds, now)
            if len(self._lane_time) > 4 * FORGET_AFTER:  # forget lanes long quiet
                self._lane_time = {lane: value for lane, value in self._lane_time.items()
                                   if self._lane_seconds(lane, now) > 1e-3}

    def ended(self, job: Job) -> None:
        """``job`` ran to its end (or failed): it leaves the started ones, its service time noted."""
        with self._lock:
            if job in self._started:
                self._started.remove(job)
            self._served_in(job)

    def _lane_seconds(self, lane: int, now: float) -> float:
        spent, when = self._lane_time.get(lane, (0.0, now))
        return spent * 0.5 ** ((now - when) / LANE_HALF_LIFE_S)

    def _served_in(self, job: Job) -> None:
        """Note how long ``job`` took from its start to its end."""
        if job.started_at is None or job.cancel.is_set():  # a cut job says nothing of service time
            return
        seconds = time.monotonic() - job.started_at
        self._service_s[job.lane] = _averaged(self._service_s.get(job.lane), seconds)
        self._service_all_s = _averaged(self._service_all_s, seconds)
        live = set(self._lanes) | {other.lane for other in self._started}
        if len(self._service_s) > 4 * len(live) + FORGET_AFTER:  # forget connections long gone
            self._service_s = {key: value for key, value in self._service_s.items() if key in live}
