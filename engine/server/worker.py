"""One thread owns the model: requests wait in one bounded queue and run one sequence at a time.

The HTTP layer submits a job (a function of the ChatSession that yields its events) and reads the events
from an asyncio queue; the desktop app submits its chat window's turns to the same queue with a callback of
its own, so an API request and a window turn never run at once. Cancelling a job that is running asks the
session to stop, which it does between tokens or between layers of a prefill chunk.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from engine.runtime.events import TurnFinished
from engine.runtime.prefix_cache import PrefixCache
from engine.runtime.session import ChatSession

STOPPED_MESSAGE = (
    "the model was unloaded (or the server stopped) before this request was answered; send it again "
    "once a model is loaded"
)


class QueueFull(Exception):
    """The queue holds as many waiting requests as it may."""


class Stopped(Exception):
    """The worker has stopped (its model unloaded, or the server shutting down): it runs nothing more."""


@dataclass
class LastRequest:
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generated_tokens: int = 0
    tokens_per_s: float = 0.0
    stop_reason: str = ""


def _to_loop(loop: asyncio.AbstractEventLoop, events: asyncio.Queue) -> Callable[[object], None]:
    """A deliver function handing each event to `events` on `loop`, from the engine's thread."""

    def deliver(event) -> None:
        try:
            loop.call_soon_threadsafe(events.put_nowait, event)
        except RuntimeError:  # the server's event loop has closed (shutting down): nobody reads this job any more
            pass

    return deliver


class Job:
    """One run: its events go to `deliver` on the engine's thread, None last; by default `deliver` puts them on
    `events`, an asyncio queue on the submitting loop. `from_api`: an HTTP request (counted in the stats)."""

    def __init__(
        self,
        worker: EngineWorker,
        run: Callable[[ChatSession], Iterator],
        deliver: Callable[[object], None] | None = None,
        *,
        from_api: bool = True,
    ):
        self._worker, self._run, self.from_api = worker, run, from_api
        self.events: asyncio.Queue | None = None
        if deliver is None:
            self.events = asyncio.Queue()
            deliver = _to_loop(asyncio.get_running_loop(), self.events)
        self._put = deliver
        self.cancelled = threading.Event()
        self.dropped = False  # ended by the worker's stop() (the model going away), not by its client
        self.cancel_requested_at: float | None = None  # the worker's clock, when cancel() was called
        self.cancel_seen_at: float | None = None  # when the worker had stopped the run

    def cancel(self) -> None:
        """Stop this job: dropped if still waiting, stopped at the next token or layer if running."""
        if self.cancelled.is_set():
            return
        self.cancel_requested_at = self._worker.clock()
        self.cancelled.set()
        self._worker._withdraw(self)

    async def stream(self):
        """The job's events as they come."""
        while (event := await self.events.get()) is not None:
            yield event


class EngineWorker:
    """The model's only user: a daemon thread running queued jobs in order."""

    def __init__(
        self,
        session: ChatSession,
        prefix_cache: PrefixCache | None,
        *,
        max_queue: int,
        clock: Callable[[], float] = time.monotonic,
        on_change: Callable[[EngineWorker], None] | None = None,
    ):
        """`on_change(worker)` is called on the engine's thread after each job starts and after it ends."""
        if max_queue < 0:
            raise ValueError(f"--max-queue must be 0 or more, got {max_queue}")
        self.session, self.prefix_cache, self.max_queue, self.clock = session, prefix_cache, max_queue, clock
        self._on_change = on_change
        self.requests_served = 0
        self.requests_refused = 0
        self.last = LastRequest()
        self.last_cancel: tuple[float, float] | None = None  # (asked, stopped) on `clock`, for the latest cancel
        self._waiting: deque[Job] = deque()
        self._running: Job | None = None
        self._lock = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="engine-worker", daemon=True)
        self._thread.start()

    @property
    def queued(self) -> int:
        return len(self._waiting)

    @property
    def busy(self) -> bool:
        return self._running is not None

    @property
    def busy_with_api(self) -> bool:
        """Whether the job running is an HTTP request (not the app's own chat)."""
        running = self._running
        return running is not None and running.from_api

    def submit(
        self,
        run: Callable[[ChatSession], Iterator],
        deliver: Callable[[object], None] | None = None,
        *,
        from_api: bool = True,
    ) -> Job:
        """Queue a job (see Job for `deliver` and `from_api`); an HTTP request is refused with QueueFull when
        max_queue jobs already wait, the app's own turns never are (its window sends one at a time). Stopped
        once stop() has been called."""
        job = Job(self, run, deliver, from_api=from_api)
        with self._lock:
            if self._stopping:  # its thread has ended or is ending: the job would wait forever
                raise Stopped(STOPPED_MESSAGE)
            if from_api and len(self._waiting) >= self.max_queue and self._running is not None:
                self.requests_refused += 1
                raise QueueFull(
                    f"the engine is busy: {len(self._waiting)} requests are already waiting (the limit "
                    f"is {self.max_queue}, --max-queue); try again shortly"
                )
            self._waiting.append(job)
            self._lock.notify()
        return job

    def stop(self) -> None:
        """Cancel what runs and waits, and end the thread."""
        with self._lock:
            self._stopping = True
            jobs = [*self._waiting, *([self._running] if self._running else [])]
            self._lock.notify()
        for job in jobs:
            job.dropped = True
            job.cancel()
        self._thread.join(timeout=10)

    def replace_session(self, session: ChatSession | None) -> None:
        """Run the jobs after the one running against `session`; called by that job on the engine's thread, so no
        job runs against either meanwhile. None while the job builds the next one (the old one's memory freed)."""
        with self._lock:
            self.session = session

    def _withdraw(self, job: Job) -> None:
        """Stop `job` if it runs; take it out of the queue (its place goes to the next client) if it waits."""
        with self._lock:
            if self._running is job:
                if self.session is not None:  # None: a job is replacing the session, and stops by itself
                    self.session.cancel()
            elif job in self._waiting:
                self._waiting.remove(job)
                job._put(None)

    def _loop(self) -> None:
        while True:
            with self._lock:
                while not self._waiting and not self._stopping:
                    self._lock.wait()
                if self._stopping:
                    for job in self._waiting:
                        job._put(None)
                    return
                job = self._waiting.popleft()
                self._running = job
            self._changed()
            try:
                self._run(job)
            finally:
                with self._lock:
                    self._running = None
                job._put(None)
                self._changed()

    def _changed(self) -> None:
        if self._on_change is not None:
            self._on_change(self)

    def _run(self, job: Job) -> None:
        try:
            events = job._run(self.session)
            if job.cancelled.is_set():  # cancelled between leaving the queue and starting: the run clears the flag
                self.session.cancel()
            for event in events:
                job._put(event)
                if isinstance(event, TurnFinished) and job.from_api:
                    self._record(job, event)
        except Exception as exc:  # a bug or a failure outside the session's own handling: this request fails alone
            job._put(exc)

    def _record(self, job: Job, final: TurnFinished) -> None:
        stats = final.stats
        if stats.stop_reason == "cancelled" and job.cancel_requested_at is not None:
            job.cancel_seen_at = self.clock()
            self.last_cancel = (job.cancel_requested_at, job.cancel_seen_at)
        self.requests_served += 1
        self.last = LastRequest(
            stats.prompt_tokens, stats.cached_tokens, stats.new_tokens, stats.decode_tokens_per_s, stats.stop_reason
        )
