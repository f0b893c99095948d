"""The threads that run step attempts with a timeout (see :class:`StepRunner`).

Python cannot kill a thread. An attempt that outlives its timeout is *abandoned*: the caller
stops waiting for it (the attempt is failed, in doubt), its outcome when it finally returns is
dropped, and its thread stops counting as one of the pool's: the pool grows a replacement, up
to ``size + spare`` threads in all, so that hung attempts do not starve the steps after them. An
async attempt is cancelled instead (its coroutine gets ``CancelledError``); one that ignores the
cancellation stays abandoned like a sync one. The abandoned threads are reported until they end
(:meth:`Slots.abandoned`); when every thread the pool may have is held by one, the pool is
*saturated* (:meth:`Slots.saturated`): attempts wait for a thread, and the process says so.

An attempt's timeout starts when its body starts (:attr:`Job.started`), not while it waits
for a thread; one withdrawn before it started (the process stops) never ran.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from sagaloop import tracing
from sagaloop.runtime import aio

logger = logging.getLogger("sagaloop.step")

QUEUED, RUNNING, DONE, WITHDRAWN = "queued", "running", "done", "withdrawn"


class Job:
    """One call on the pool: ``fn(*args, **kwargs)``; a coroutine it returns runs on a new
    event loop of the pool's thread (closed after it)."""

    def __init__(
        self,
        fn: Callable[..., Any],
        args: Any,
        kwargs: Any,
        label: str,
        about: dict[str, Any] | None = None,
    ) -> None:
        self.fn, self.args, self.kwargs, self.label = fn, args, kwargs, label
        self.about = about or {}
        """What it is an attempt of (``step``, ``run_id``, ``position``, ``attempt``), as
        the process reports it once abandoned."""
        self.state = QUEUED
        self.started: float | None = None
        """When its body started (monotonic); None while it waits for a thread."""
        self.started_at: datetime | None = None
        self.abandoned = False
        self.value: Any = None
        self.error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[Any] | None = None
        self._lock = threading.Lock()
        self.run = tracing.carried(self._run)
        """Runs it in the trace context of the thread that made it."""

    def outcome(self) -> Any:
        if self.error is not None:
            raise self.error
        return self.value

    def _run(self) -> None:
        try:
            result = self.fn(*self.args, **self.kwargs)
            if asyncio.iscoroutine(result):  # on the process's step loop (see aio)
                result = aio.run(self._main(result))
            self.value = result
        except BaseException as e:  # handed to the caller, raised there (or dropped if late)
            self.error = e

    async def _main(self, coro: Any) -> Any:
        with self._lock:
            self._loop, self._task = asyncio.get_running_loop(), asyncio.current_task()
            cancelled = self.abandoned
        if cancelled:
            coro.close()
            raise asyncio.CancelledError
        return await coro

    def _cancel(self) -> None:
        """Cancel its coroutine, if it runs one (from any thread)."""
        with self._lock:
            loop, task = self._loop, self._task
        if loop is not None and task is not None:
            with contextlib.suppress(RuntimeError):  # the loop closed: it ended meanwhile
                loop.call_soon_threadsafe(task.cancel)

    def describe(self) -> str:
        since = self.started_at.isoformat(timespec="seconds") if self.started_at else "?"
        return f"{self.label}, since {since}"


class Slots:
    """A pool of daemon threads: ``size`` of them run attempts; up to ``spare`` more replace
    the threads of abandoned attempts."""

    def __init__(self, size: int, *, spare: int | None = None, name: str = "step") -> None:
        self.size = max(size, 1)
        self.cap = self.size + (self.size if spare is None else max(spare, 0))
        self.name = name
        self._cond = threading.Condition()
        self._queue: collections.deque[Job] = collections.deque()
        self._threads = 0
        self._idle = 0
        self._abandoned: list[Job] = []
        self._running: list[Job] = []
        self._closed = False
        self._count = 0

    # --- the caller's side ---------------------------------------------------------------------

    def submit(
        self,
        fn: Callable[..., Any],
        *args: Any,
        label: str = "",
        about: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> Job:
        job = Job(fn, args, kwargs, label, about)
        with self._cond:
            if self._closed:
                job.state = WITHDRAWN
                return job
            self._queue.append(job)
            self._grow()
            self._cond.notify_all()
        return job

    def wait_started(self, job: Job, until: float | None = None) -> bool:
        """Wait until ``job`` started (True); False when it was withdrawn (the pool closed) or
        ``until`` (monotonic) passed first, in which case it is withdrawn and never runs."""
        with self._cond:
            while job.state == QUEUED:
                wait = None if until is None else until - time.monotonic()
                if wait is not None and wait <= 0:
                    self._queue.remove(job)
                    job.state = WITHDRAWN
                    break
                self._cond.wait(wait)
            return job.state != WITHDRAWN

    def wait_done(self, job: Job, timeout: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: job.state == DONE, max(timeout, 0.0))

    def abandon(self, job: Job) -> bool:
        """Stop waiting for ``job``: cancel its coroutine, if any; its thread no longer counts
        as the pool's until it ends (a replacement may start). False if it ended already."""
        with self._cond:
            if job.state != RUNNING:
                return job.state != DONE
            if not job.abandoned:
                job.abandoned = True
                self._abandoned.append(job)
                self._grow()
        job._cancel()
        return True

    # --- what the process reports ------------------------------------------------------------

    def abandoned(self) -> list[Job]:
        with self._cond:
            return list(self._abandoned)

    def saturated(self) -> bool:
        """Every thread the pool may have is held by an abandoned attempt."""
        with self._cond:
            return len(self._abandoned) >= self.cap

    def waiting(self) -> int:
        with self._cond:
            return len(self._queue)

    def running(self) -> list[Job]:
        """Attempts running and waited for (not abandoned)."""
        with self._cond:
            return [j for j in self._running if not j.abandoned]

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> list[Job]:
        """Start nothing more: withdraw the queued jobs (their callers are told they never
        started) and let idle threads end. Returns the withdrawn jobs."""
        with self._cond:
            self._closed = True
            withdrawn = list(self._queue)
            self._queue.clear()
            for job in withdrawn:
                job.state = WITHDRAWN
            self._cond.notify_all()
        return withdrawn

    # --- the threads ---------------------------------------------------------------------------

    @property
    def _live(self) -> int:
        return self._threads - len(self._abandoned)

    def _grow(self) -> None:
        """Under the lock: start a thread if a job waits that no idle thread will take."""
        while len(self._queue) > self._idle and self._live < self.size and self._threads < self.cap:
            self._threads += 1
            self._count += 1
            thread = threading.Thread(
                target=self._work, name=f"{self.name}-{self._count}", daemon=True
            )
            thread.start()
            self._idle += 1  # counted idle until it takes a job

    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:  # closed
                    self._idle -= 1
                    self._threads -= 1
                    return
                job = self._queue.popleft()
                self._idle -= 1
                job.state, job.started = RUNNING, time.monotonic()
                job.started_at = datetime.now(UTC)
                self._running.append(job)
                self._cond.notify_all()
            job.run()
            if job.abandoned:
                assert job.started is not None
                logger.info(
                    "the abandoned attempt of %s ended after %.1f s; its outcome was dropped",
                    job.label,
                    time.monotonic() - job.started,
                )
            with self._cond:
                job.state = DONE
                self._running.remove(job)
                ends = False
                if job.abandoned:
                    self._abandoned.remove(job)
                    # a replacement took this thread's place: the surplus ends
                    ends = self._live > self.size or self._closed
                if ends or (self._closed and not self._queue):
                    self._threads -= 1
                    self._cond.notify_all()
                    return
                self._idle += 1
                self._cond.notify_all()
