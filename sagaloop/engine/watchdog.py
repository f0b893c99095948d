"""The activation deadline: saga code that runs too long without yielding is interrupted.

Saga code only decides what to do next; it must reach its next ``await`` quickly. A saga that
loops without awaiting would hold its engine thread (and, on SQLite, everything behind it) for
ever. :meth:`Watchdog.guard` wraps each stretch of saga code: past the deadline (2 s by default,
as Temporal's Python SDK uses) a monitor thread records the stack of the saga code and raises
:class:`SagaDeadlineExceeded` inside it (``PyThreadState_SetAsyncExc``); the guard turns that
into :class:`~sagaloop.errors.ActivationDeadlineError`, which the engine records by parking the
run in ``needs_attention`` with the stack.

The deadline counts the CPU time of the thread running the saga code (where the platform has
per-thread CPU clocks, as Linux does), not the wall clock: a process stopped or starved of the
CPU (SIGSTOP, a paused VM, a loaded machine) must not park healthy runs. The saga code's thread
never reads its CPU clock: that read is a system call that updates the scheduler's account of
the thread, and where the thread's time slice is used up the kernel switches it out right
there, holding the GIL, so that the engine's other threads wait for it (at 64 sagas on a busy
2-core machine, one read in a hundred took 1.8 ms). The monitor reads the clock of code it
finds still running at a tick and counts from there: the deadline is reached up to one tick
(``TICK``) of CPU late. Code stuck inside one C
call (a ``time.sleep`` in saga code, say) uses no CPU and cannot be interrupted before the call
returns: past ``STALL_FACTOR`` times the deadline in wall time (30 s for the default 2 s), the
watchdog reports it as stalled (see
:meth:`Watchdog.stalled`), which ``sagaloop health`` shows.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import os
import sys
import threading
import time
import traceback
from collections.abc import Iterator

from sagaloop.errors import ActivationDeadlineError

DEADLINE = 2.0
"""Seconds saga code may run without yielding."""
TICK = 0.05
STALL_FACTOR = 15
"""Guarded code that has not finished after this many deadlines of wall time is stalled."""


class SagaDeadlineExceeded(BaseException):
    """Raised inside saga code that ran past the deadline. A BaseException, so that saga code's
    ``except Exception`` does not swallow it."""


@dataclasses.dataclass(eq=False)
class _Guarded:
    thread_id: int
    what: str
    started: float
    """Wall clock (``time.monotonic``)."""
    cpu_clock: int | None
    """The thread's CPU-time clock, or None (the wall clock counts, then)."""
    cpu_seen: float | None = None
    """The CPU clock when the monitor first saw the code running (None until then)."""
    fired_at: float | None = None
    stack: str = ""
    exited: bool = False


class Watchdog:
    """Interrupts guarded code that runs past ``deadline`` seconds. Thread-safe; one monitor
    thread runs while something is guarded (and a little after)."""

    def __init__(self, deadline: float = DEADLINE) -> None:
        self.deadline = deadline
        self.stall_after = deadline * STALL_FACTOR
        self._lock = threading.Lock()
        self._active: dict[int, _Guarded] = {}
        self._fired: list[_Guarded] = []
        self._monitor: threading.Thread | None = None

    @contextlib.contextmanager
    def guard(self, what: str) -> Iterator[None]:
        """Run the block under the deadline; raise ActivationDeadlineError if it was
        interrupted (whatever the block raised then)."""
        tid = threading.get_ident()
        guarded = _Guarded(tid, what, time.monotonic(), _cpu_clock(tid))
        with self._lock:
            self._active[tid] = guarded
            if self._monitor is None:
                self._monitor = threading.Thread(
                    target=self._watch, name="saga-watchdog", daemon=True
                )
                self._monitor.start()
        try:
            try:
                yield
            finally:
                with self._lock:
                    self._active.pop(tid, None)
                    guarded.exited = True
                    fired = guarded.fired_at is not None
                if fired:  # the exception may not have been raised yet: never let it out
                    _set_async_exc(tid, None)
        except SagaDeadlineExceeded:
            fired = True
        except BaseException:
            if guarded.fired_at is None:
                raise
            fired = True
        if fired:
            raise ActivationDeadlineError(
                f"{what} ran for more than {self.deadline:g} s without yielding (a loop "
                "without await?): saga code must reach its next await quickly; do long work "
                "in a step",
                stack=guarded.stack,
            )

    def stalled(self) -> list[str]:
        """Guarded code that has run for more than ``stall_after`` seconds (stuck inside a C call,
        or not stopping when interrupted): what it is, for how long, and where."""
        now = time.monotonic()
        with self._lock:
            self._fired = [g for g in self._fired if not g.exited]
            late = [
                g
                for g in [*self._active.values(), *self._fired]
                if now - g.started > self.stall_after
            ]
        return [
            f"{g.what} has run for {now - g.started:.0f} s without yielding; it is at:\n"
            f"{g.stack or _stack_of(g.thread_id)}"
            for g in late
        ]

    def _spent(self, g: _Guarded, now: float) -> float:
        """Seconds the guarded code has run: CPU time of its thread since the monitor first
        saw it, where measurable. Called on the monitor's thread only (see the module)."""
        if g.cpu_clock is None:
            return now - g.started
        try:
            cpu = time.clock_gettime(g.cpu_clock)
        except OSError:  # the thread is gone
            return 0.0
        if g.cpu_seen is None:
            g.cpu_seen = cpu
        return cpu - g.cpu_seen

    def _watch(self) -> None:
        idle_since: float | None = None
        while True:
            time.sleep(TICK)
            now = time.monotonic()
            with self._lock:
                due = [g for g in self._active.values() if self._spent(g, now) >= self.deadline]
                for g in due:
                    del self._active[g.thread_id]
                    g.fired_at = now
                    g.stack = _stack_of(g.thread_id)
                    self._fired.append(g)
                    _set_async_exc(g.thread_id, SagaDeadlineExceeded)
                if self._active or any(not g.exited for g in self._fired):
                    idle_since = None
                elif idle_since is None:
                    idle_since = now
                elif now - idle_since > 1.0:
                    self._monitor = None
                    return


def _cpu_clock(thread_id: int) -> int | None:
    try:
        return time.pthread_getcpuclockid(thread_id)
    except (AttributeError, OSError):  # not on this platform
        return None


def _stack_of(thread_id: int) -> str:
    frame = sys._current_frames().get(thread_id)
    if frame is None:
        return "(no stack)"
    frames = traceback.extract_stack(frame)
    machinery = [i for i, f in enumerate(frames) if any(p in f.filename for p in _MACHINERY)]
    own = frames[machinery[-1] + 1 :] if machinery else frames  # what the saga code called
    return "".join(traceback.format_list((own or frames)[-12:]))[-4000:]


_MACHINERY = (f"{os.sep}sagaloop{os.sep}", f"{os.sep}asyncio{os.sep}", f"{os.sep}threading.py")
"""Frames of the engine and the event loop: the stack shown for saga code starts after them."""


def _set_async_exc(thread_id: int, exc: type[BaseException] | None) -> None:
    ctypes.pythonapi.PyThreadState_SetAsyncExc(
        ctypes.c_ulong(thread_id), ctypes.py_object(exc) if exc is not None else None
    )
