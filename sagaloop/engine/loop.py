"""A deterministic asyncio event loop for saga code.

It implements only what coroutines need (futures, tasks, ``call_soon``) and runs ready callbacks
in FIFO order until none is left, then returns. ``asyncio.gather``, ``asyncio.wait``,
``asyncio.Event`` and ``asyncio.Lock`` work. Its timers (``call_later``, ``call_at``: what
``asyncio.sleep``, ``asyncio.wait_for``, ``asyncio.timeout`` and ``asyncio.wait(timeout=)`` use)
are durable timers, started through :attr:`DeterministicLoop.timers` (the replayer's ``sleep``
command): they fire when the history says so, on every replay. Threads, executors and I/O raise
:class:`~sagaloop.errors.SagaDeterminismViolation`, which points to steps.
"""

from __future__ import annotations

import asyncio
import collections
import contextvars
import threading
from asyncio import events
from collections.abc import Callable, Coroutine, Generator
from typing import Any, NoReturn, TypeVar

from sagaloop.engine.sandbox import guard_saga_calls
from sagaloop.errors import SagaDeterminismViolation

T = TypeVar("T")

_ADVICE = (
    "saga code must be deterministic: do I/O in a step (ctx.call), wait with ctx.sleep, "
    "asyncio.sleep or ctx.wait_for_event"
)


class DeterministicLoop(asyncio.AbstractEventLoop):
    def __init__(self) -> None:
        self._ready: collections.deque[asyncio.Handle] = collections.deque()
        self._time = 0.0
        self._running = False
        self._closed = False
        self._errors: list[BaseException] = []
        self._task_factory: Any = None
        self._tasks: list[tuple[asyncio.Task[Any], contextvars.Context]] = []
        """The tasks of saga code and the context each runs in (Task.get_context is 3.12+)."""
        self.timers: Callable[[float], asyncio.Future[Any]] | None = None
        """Starts a durable timer due in the given seconds and returns the future its firing
        resolves (the replayer's ``sleep`` command); None: timers are refused."""

    # --- what coroutines, futures and tasks use -----------------------------------------------

    def time(self) -> float:
        return self._time

    def set_time(self, value: float) -> None:
        self._time = value

    def create_future(self) -> asyncio.Future[Any]:
        return asyncio.Future(loop=self)

    def create_task(
        self,
        coro: Coroutine[Any, Any, T] | Generator[Any, None, T],
        *,
        name: str | None = None,
        context: contextvars.Context | None = None,
    ) -> asyncio.Task[T]:
        context = context if context is not None else contextvars.copy_context()
        if self._task_factory is not None:
            task: asyncio.Task[T] = self._task_factory(self, coro, context=context)
            if name is not None:
                task.set_name(name)
        else:
            task = asyncio.Task(coro, loop=self, name=name, context=context)
        if len(self._tasks) >= 64:
            self._tasks = [(t, c) for t, c in self._tasks if not t.done()]
        self._tasks.append((task, context))
        return task

    def suspended_tasks(self) -> list[tuple[asyncio.Task[Any], contextvars.Context]]:
        """The tasks not done, each with its context."""
        return [(t, c) for t, c in self._tasks if not t.done()]

    def get_task_factory(self) -> Any:
        """What anyio's task groups (which frameworks such as Pydantic AI use) ask for."""
        return self._task_factory

    def set_task_factory(self, factory: Any) -> None:
        self._task_factory = factory

    def call_soon(  # type: ignore[override]
        self,
        callback: Callable[..., object],
        *args: Any,
        context: contextvars.Context | None = None,
    ) -> asyncio.Handle:
        handle = asyncio.Handle(callback, args, self, context)
        self._ready.append(handle)
        return handle

    def get_debug(self) -> bool:
        return False

    def is_running(self) -> bool:
        return self._running

    def is_closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        self._ready.clear()
        self._closed = True

    def call_exception_handler(self, context: dict[str, Any]) -> None:
        exc = context.get("exception")
        # A callback that raised is a bug in sagaloop or saga code: surface it to the engine.
        # An unretrieved task exception reported at garbage collection is harmless here.
        if exc is not None and "handle" in context:
            self._errors.append(exc)

    def default_exception_handler(self, context: dict[str, Any]) -> None:
        self.call_exception_handler(context)

    def _timer_handle_cancelled(self, handle: asyncio.TimerHandle) -> None:
        pass

    def _forbidden(self, what: str) -> NoReturn:
        raise SagaDeterminismViolation(f"{what} is not allowed in saga code: {_ADVICE}")

    # --- timers: durable ------------------------------------------------------------------------

    def call_later(  # type: ignore[override]
        self,
        delay: float,
        callback: Callable[..., object],
        *args: Any,
        context: contextvars.Context | None = None,
    ) -> asyncio.TimerHandle:
        """Run ``callback`` once a durable timer of ``delay`` seconds fired (at once, without
        a timer, for a delay of zero or less). Cancelling the handle abandons the timer: the
        code stops waiting for it, and its firing, if recorded later, changes nothing."""
        if self.timers is None:
            self._forbidden("asyncio timers (asyncio.sleep, timeouts) outside a saga's run")
        handle = _DurableTimer(self._time + delay, callback, args, self, context)
        if delay <= 0:
            self._ready.append(handle)
            return handle
        handle.fired = self.timers(delay)
        handle.fired.add_done_callback(handle.due)
        return handle

    def call_at(  # type: ignore[override]
        self,
        when: float,
        callback: Callable[..., object],
        *args: Any,
        context: contextvars.Context | None = None,
    ) -> asyncio.TimerHandle:
        return self.call_later(when - self._time, callback, *args, context=context)

    # --- what saga code must not use ----------------------------------------------------------

    def call_soon_threadsafe(self, *args: Any, **kwargs: Any) -> NoReturn:  # type: ignore[override]
        self._forbidden("threads")

    def run_in_executor(self, *args: Any, **kwargs: Any) -> NoReturn:  # type: ignore[override]
        self._forbidden("run_in_executor")

    # --- driving -----------------------------------------------------------------------------

    def run_until_blocked(self) -> None:
        """Run ready callbacks until every task waits on a future that nothing here resolves.

        KeyboardInterrupt and SystemExit raised by saga code are failures of its task like any
        other exception (asyncio sets them on the task, then re-raises them: they are absorbed
        here). A real signal never lands here: services handle signals on the main thread."""
        previous = events._get_running_loop()
        events._set_running_loop(self)
        self._running = True
        guard_saga_calls()  # random, time.time, datetime.now, uuid4 refused in saga code
        _in_saga.active = True
        try:
            while self._ready:
                handle = self._ready.popleft()
                if not handle.cancelled():
                    try:  # noqa: SIM105 (suppress() costs three calls per callback, on the hot path)
                        handle._run()
                    except (KeyboardInterrupt, SystemExit):
                        pass  # set on the task that raised it, which is now done
                if self._errors:
                    raise self._errors.pop(0)
        finally:
            _in_saga.active = False
            self._running = False
            events._set_running_loop(previous)


class _DurableTimer(asyncio.TimerHandle):
    """A ``call_later`` handle whose callback runs when its durable timer fires."""

    fired: asyncio.Future[Any] | None = None

    def due(self, fired: asyncio.Future[Any]) -> None:
        if not fired.cancelled() and not self.cancelled():
            self._loop._ready.append(self)  # type: ignore[attr-defined]

    def cancel(self) -> None:
        if not self.cancelled():
            super().cancel()
            if self.fired is not None and not self.fired.done():
                self.fired.cancel()  # the code no longer waits for it (see Replayer._on_done)


class _InSaga(threading.local):
    active = False


_in_saga = _InSaga()
_thread_start = threading.Thread.start


def _guarded_start(self: threading.Thread) -> None:
    if _in_saga.active:
        raise SagaDeterminismViolation(f"starting a thread is not allowed in saga code: {_ADVICE}")
    _thread_start(self)


def refuse_threads_in_saga_code() -> None:
    """Make ``threading.Thread.start`` refuse to run from saga code (idempotent). Installed
    when the first saga runs, never at import; other threads are not affected."""
    threading.Thread.start = _guarded_start  # type: ignore[method-assign]
