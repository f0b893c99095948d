"""Refuse, in saga code, the calls a newcomer reaches for first to get randomness or the time.

``random.random()``, ``time.time()``, ``uuid.uuid4()`` return a
different value when a run is replayed, so saga code that branches on them diverges from its
history. Inside saga code they raise :class:`~sagaloop.errors.SagaDeterminismViolation`, which
points to ``ctx.random()``, ``ctx.now()`` and ``ctx.uuid4()``. Steps, and any other thread of the
process, are not affected: the check is one read of the thread-local flag that
:mod:`sagaloop.engine.loop` sets while saga code runs on a thread.

What is patched (installed when the first saga runs, never at import, once):

- the module-level functions of :mod:`random` (``random.random``, ``random.randint``...), and
  the class of the generator behind them, so that ``randint``, ``choice``, ``shuffle``... imported
  with ``from random import ...`` are refused too (they draw through ``getrandbits``/``random``);
- ``time.time`` and ``time.time_ns`` (so ``datetime.today()`` and ``date.today()``, which call
  it, are refused too), ``uuid.uuid4``.

``datetime.datetime.now()`` is a method of a C type that cannot be patched; replacing the
``datetime`` class in its module would change the type every library sees, which is not worth
it: replay (the harness replays every activation) finds a saga that branches on it.

A name bound before the first saga ran keeps the original: ``from time import time``,
``from datetime import datetime``, ``from uuid import uuid4`` and ``from random import random``
at the top of a module are not caught (docs/concepts/testing.md has the table). Log records are
stamped with the time: calls made by :mod:`logging` on behalf of saga code are allowed, and so
are calls made directly by the modules of an agent framework that an adapter declared with
:func:`trust_framework` (Pydantic AI names its graph nodes with ``uuid4``: internal names that
never reach a decision or the history).
"""

from __future__ import annotations

import functools
import random as _random
import sys
import threading
import time as _time
import uuid as _uuid
from collections.abc import Callable
from types import FrameType
from typing import Any, TypeVar

from sagaloop.errors import SagaDeterminismViolation

F = TypeVar("F", bound=Callable[..., Any])

_ADVICE = {
    "random": "use ctx.random() (seeded per run, the same on every replay)",
    "time": "use ctx.now() (the time of the history event being replayed)",
    "uuid": "use ctx.uuid4() (derived from the run, the same on every replay)",
}


class _NotYet(threading.local):
    active = False


_lock = threading.Lock()
_installed = False
_trusted: tuple[str, ...] = ()
_STDLIB = ("random", "uuid", "time", "datetime", "_pydatetime")
"""Modules between a refused function and its real caller (``random.choice`` calls ``random``)."""
_in_saga: threading.local = _NotYet()
"""The loop's flag once installed: ``active`` while saga code runs on the current thread."""


def guard_saga_calls() -> None:
    """Install the guards (idempotent; cheap after the first call)."""
    global _installed, _in_saga
    if _installed:
        return
    with _lock:
        if _installed:
            return
        from sagaloop.engine.loop import _in_saga as flag  # the loop imports this module

        _in_saga = flag
        for name, value in list(vars(_random).items()):
            if getattr(value, "__self__", None) is _random._inst:
                setattr(_random, name, _guarded(value, f"random.{name}", "random"))
        _random._inst.__class__ = _GuardedRandom
        _time.time = _guarded(_time.time, "time.time", "time")
        _time.time_ns = _guarded(_time.time_ns, "time.time_ns", "time")
        _uuid.uuid4 = _guarded(_uuid.uuid4, "uuid.uuid4", "uuid")
        _installed = True


def trust_framework(*module_prefixes: str) -> None:
    """Let the modules under ``module_prefixes`` (an agent framework's own code, which runs
    inside saga code) call the refused functions directly: an adapter declares it for the
    framework it adapts, after checking that the values only name internal objects. Saga
    code, and user functions the framework calls back, stay guarded."""
    global _trusted
    with _lock:
        _trusted = tuple(dict.fromkeys((*_trusted, *module_prefixes)))


def _refused_here() -> bool:
    """Called once the flag is seen set: whether the caller is saga code (not logging on its
    behalf, nor a trusted framework's own code)."""
    frame: FrameType | None = sys._getframe(2)
    while frame is not None and frame.f_globals.get("__name__", "") in _STDLIB:
        frame = frame.f_back
    if _trusted and frame is not None:
        module = frame.f_globals.get("__name__", "")
        if module.startswith(_trusted) and any(
            module == t or module.startswith(t + ".") for t in _trusted
        ):
            return False
    return not _called_by_logging(sys._getframe(2))


def _refuse(what: str, area: str) -> SagaDeterminismViolation:
    return SagaDeterminismViolation(
        f"{what} is not allowed in saga code: it returns another value when the run is "
        f"replayed, and the saga diverges from its history; {_ADVICE[area]}, or do it in a step"
    )


def _guarded(fn: F, what: str, area: str) -> F:
    @functools.wraps(fn)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        if _in_saga.active and _refused_here():
            raise _refuse(f"{what}()", area)
        return fn(*args, **kwargs)

    return guarded  # type: ignore[return-value]


def _called_by_logging(frame: FrameType | None) -> bool:
    """Whether a logging module is between ``frame`` and the saga loop (a log record being
    stamped with the time). Walked only on a thread where saga code runs."""
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if module == "logging" or module.startswith("logging."):
            return True
        if module == "sagaloop.engine.loop":
            return False
        frame = frame.f_back
    return False


class _GuardedRandom(_random.Random):
    """The class of ``random``'s module-level generator once guarded: whatever draws from it
    (``randint``, ``choice``, ``shuffle``... bound at import) goes through these two."""

    def random(self) -> float:
        if _in_saga.active and _refused_here():
            raise _refuse("the random module's functions (random.random()...)", "random")
        return super().random()

    def getrandbits(self, k: int, /) -> int:
        if _in_saga.active and _refused_here():
            raise _refuse(
                "random module functions (random.randint(), choice, shuffle...)", "random"
            )
        return super().getrandbits(k)
