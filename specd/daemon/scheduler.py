"""Completions waiting for the model: bounded, fair between connections, dropped when moot.

Jobs wait here, not in the worker's queue, so that

- a job cancelled or superseded while waiting leaves at once, and its text with it (a job in
  the worker's queue would keep its request alive until the worker reached it);
- each connection has at most one job in the worker, and the worker interleaves the jobs it
  holds step by step (``worker``): a client with 64 queued completes delays another's single
  complete by a few of its steps, not by 64 jobs;
- the next job handed over comes from a connection with none in the worker, interactive before
  batch, then the connection served longest ago (one not served yet comes first);
- what one connection may have waiting is bounded in count and in text; a ``busy`` refusal
  carries ``retry_after_ms``, when this connection's job in the worker should be done, from the
  recent service time of its completes (``retry_after_ms``).

The worker holds at most ``WORKER_DEPTH`` jobs, each with its document's state; beyond that,
connections wait here in turn.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import time
from typing import Callable

from specd.daemon.worker import Job
from specd.protocol.errors import ErrorCode, RpcError

log = logging.getLogger("specd.daemon")

WORKER_DEPTH = 8  # jobs the worker holds at once, one per connection (each holds a KV state)
MAX_QUEUED_PER_CONNECTION = 16
# busy's retry hint: a service time seen lately (an exponential average of started-to-done
# seconds, per connection and over all), within these bounds.
RETRY_AFTER_MIN_MS = 10
RETRY_AFTER_MAX_MS = 60_000
RETRY_AFTER_DEFAULT_MS = 100  # before any completion has finished
SERVICE_AVERAGE_WEIGHT = 0.3  # of the newest job in the average
RETRY_AFTER_LATE_SHARE = 0.25  # of the service time: the hint once the running job is past it


def _skipped(_engine: object, _cancel: object) -> None:
    """What a job cancelled before it started runs instead (never, in fact: the worker skips it)."""


def _averaged(average: float | None, sample: float) -> float:
    return sample if average is None else average + SERVICE_AVERAGE_WEIGHT * (sample - average)


class CompletionQueue:
    def __init__(self, submit: Callable[[Job], object], max_queued_chars: int,
                 max_per_connection: int = MAX_QUEUED_PER_CONNECTION):
        self._submit = submit  # the worker's submit
        self.max_queued_chars = max_queued_chars  # per connection, over the queued jobs' texts
        self.max_per_connection = max_per_connection
        self._lanes: collections.OrderedDict[int, collections.deque[Job]] = collections.OrderedDict()
        self._waiting: dict[Job, tuple[int, int]] = {}  # job -> (lane, chars it holds)
        self._lane_chars: collections.Counter[int] = collections.Counter()
        self._in_worker: set[Job] = set()
        self._served: dict[int, int] = {}  # lane -> when it was last served (a tick count)
        self._tick = 0
        self._service_s: dict[int, float] = {}  # lane -> recent started-to-done seconds (average)
        self._service_all_s: float | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def __len__(self) -> int:
        return len(self._waiting)

    def waiting(self, lane: int) -> int:
        """How many of ``lane``'s completions wait here (not yet handed to the worker)."""
        return len(self._lanes.get(lane, ()))

    def handed(self, lane: int) -> int:
        """How many of ``lane``'s completions the worker holds (queued there or started)."""
        return sum(1 for job in self._in_worker if job.lane == lane and not job.future.done())

    def put(self, lane: int, job: Job, chars: int) -> None:
        """Queue ``job`` for connection ``lane``; ``chars`` is the text it keeps alive."""
        self._loop = asyncio.get_running_loop()
        waiting = self._lanes.get(lane)
        if waiting is not None and len(waiting) >= self.max_per_connection:
            raise self._busy(lane, f"{len(waiting)} completions of this connection are already waiting (the limit)")
        if waiting and self._lane_chars[lane] + chars > self.max_queued_chars:
            raise self._busy(lane, f"completions waiting on this connection already hold {self._lane_chars[lane]} "
                                   f"characters of text (the limit is {self.max_queued_chars})")
        job.lane = lane
        self._lanes.setdefault(lane, collections.deque()).append(job)
        self._waiting[job] = (lane, chars)
        self._lane_chars[lane] += chars
        self._pump()

    def _busy(self, lane: int, message: str) -> RpcError:
        after_ms = self.retry_after_ms(lane)
        return RpcError(ErrorCode.BUSY, f"{message}; retry in about {after_ms} ms", {"retry_after_ms": after_ms})

    def retry_after_ms(self, lane: int) -> int:
        """About when ``lane``'s job in the worker is done, making room in its queue: its recent
        service time (everyone's when it has none yet) less what its running job has had."""
        service_s = self._service_s.get(lane, self._service_all_s)
        if service_s is None:
            return RETRY_AFTER_DEFAULT_MS
        now = time.monotonic()
        running = max((now - job.started_at for job in self._in_worker if job.lane == lane and job.started_at is not None),
                      default=0.0)
        # A job past the usual service time may end any moment, or not for long: a quarter of
        # the longer of the two (a job that has run 3 s is no 80 ms one, whatever other
        # connections' completes take) spaces the retries without leaving the room unused long.
        left_s = max(service_s - running, RETRY_AFTER_LATE_SHARE * max(service_s, running))
        return int(min(RETRY_AFTER_MAX_MS, max(RETRY_AFTER_MIN_MS, left_s * 1000)))

    def _served_in(self, job: Job) -> None:
        """Note how long ``job`` took from its start to its end (it ran and is done)."""
        if job.started_at is None or job.cancel.is_set():  # a cut job says nothing of service time
            return
        seconds = time.monotonic() - job.started_at
        self._service_s[job.lane] = _averaged(self._service_s.get(job.lane), seconds)
        self._service_all_s = _averaged(self._service_all_s, seconds)
        if len(self._service_s) > 4 * len(self._lanes) + 64:  # forget connections long gone
            live = set(self._lanes) | {other.lane for other in self._in_worker}
            self._service_s = {key: value for key, value in self._service_s.items() if key in live}

    def discard(self, job: Job) -> None:
        """Forget ``job`` if it is still waiting (it was cancelled or superseded)."""
        if job not in self._waiting:
            return
        lane = self._waiting[job][0]
        waiting = self._lanes[lane]
        waiting.remove(job)
        self._forget(lane, job)
        if not waiting:
            del self._lanes[lane]

    def fail_all(self, error: BaseException | None) -> None:
        """Answer every waiting job: with ``error`` when given, else as cancelled."""
        for lane, waiting in list(self._lanes.items()):
            while waiting:
                job = waiting.popleft()
                self._forget(lane, job)
                if error is not None and job.future.set_running_or_notify_cancel():
                    job.future.set_exception(error)
                else:
                    job.request_cancel("the daemon is shutting down")
        self._lanes.clear()

    def _forget(self, lane: int, job: Job) -> None:
        self._lane_chars[lane] -= self._waiting.pop(job)[1]
        if self._lane_chars[lane] <= 0:
            del self._lane_chars[lane]

    def _next(self) -> Job | None:
        """The next live job: from a connection with none in the worker, interactive before
        batch, then the connection served longest ago."""
        busy = {job.lane for job in self._in_worker}
        while True:
            lanes = [lane for lane in self._lanes if lane not in busy]
            if not lanes:
                return None
            lane = min(lanes, key=lambda key: (self._lanes[key][0].batch, self._served.get(key, -1)))
            waiting = self._lanes[lane]
            job = waiting.popleft()
            self._forget(lane, job)
            if not waiting:
                del self._lanes[lane]
            if not job.future.done():
                self._tick += 1
                self._served[lane] = self._tick
                if len(self._served) > 4 * len(self._lanes) + 64:  # forget connections long gone
                    self._served = {key: tick for key, tick in self._served.items() if key in self._lanes}
                return job

    def _pump(self) -> None:
        for job in [job for job in self._in_worker if job.future.done()]:
            self._in_worker.discard(job)
            self._served_in(job)
        while len(self._in_worker) < WORKER_DEPTH:
            job = self._next()
            if job is None:
                return
            self._in_worker.add(job)
            job.future.add_done_callback(self._finished)
            self._submit(job)

    def _finished(self, future: concurrent.futures.Future) -> None:
        """A job left the worker (on the worker thread, or on the loop when cancelled)."""
        if future.cancelled():
            # Cancelled before it started: the worker will skip it, but it stays in the worker's
            # queue until then. Drop what it would have run (its request, with the text) now.
            for job in list(self._in_worker):
                if job.future is future:
                    job.fn, job.steps, job.on_step = _skipped, None, None
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(self._pump)
        except RuntimeError:  # the loop closed meanwhile
            pass
