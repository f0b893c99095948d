"""Named crash points: places where a process killed at the worst moment must lose nothing.

They are armed only by the services' start-up (``SAGALOOP_CRASH_AT``, read by the CLI) and cost
one set look-up otherwise. ``name`` kills the process with SIGKILL the first time it passes
there; ``name:N`` the N-th time. ``name:raise`` (or ``name:N:raise``) instead raises
:class:`CrashPointRaised`, a ``BaseException``, in the thread that passes there, once: what a
consumer thread meets when something no handler absorbs escapes it. The names are listed in
``POINTS`` and in the docs.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterable

POINTS = {
    "engine.before_commit": "the engine decided the run's history and outbox rows, none of "
    "them committed",
    "engine.after_commit": "the engine committed, the message that caused it is not yet acked",
    "worker.before_commit": "the step ran (its effect happened), its result is not committed",
    "worker.after_commit": "the step's result is committed, the message is not yet acked",
    "worker.undo_before_commit": "a compensation ran, its completion is not committed",
    "local.before_commit": "an in-process step ran, its result and the run's next decisions "
    "are not committed",
    "local.undo_before_commit": "an in-process compensation ran, its completion is not committed",
    "local.after_commit": "an in-process step's result and the run's next decisions committed",
    "relay.before_publish": "the relay claimed outbox rows and has not published them",
    "relay.after_publish": "the broker confirmed the rows, the relay has not deleted them",
    "timers.before_commit": "due timers were taken and turned into messages, not committed",
    "engine.fanout_before_commit": "the engine wrote a published event's deliveries and "
    "starts to the outbox, not yet committed",
    "debounce.before_commit": "a due debounce window was taken and its run created, not committed",
}

_armed: dict[str, int] = {}
_raising: set[str] = set()
_lock = threading.Lock()


class CrashPointRaised(BaseException):
    """Raised by a crash point armed with ``:raise``; no handler of sagaloop absorbs it."""


def arm(spec: str | Iterable[str]) -> None:
    """Arm crash points from ``"a,b:3,c:2:raise"`` or a list of such names."""
    items = spec.split(",") if isinstance(spec, str) else list(spec)
    for item in (i.strip() for i in items):
        if not item:
            continue
        name, *options = item.split(":")
        if name not in POINTS:
            raise ValueError(f"unknown crash point {name!r}; known: {', '.join(sorted(POINTS))}")
        raising = options[-1:] == ["raise"]
        nth = options[:-1] if raising else options
        if len(nth) > 1 or (nth and not nth[0].isdigit()):
            raise ValueError(f"crash point {item!r}: use NAME, NAME:N, NAME:raise or NAME:N:raise")
        _armed[name] = int(nth[0]) if nth else 1
        if raising:
            _raising.add(name)


def disarm() -> None:
    _armed.clear()
    _raising.clear()


def crash_point(name: str) -> None:
    if not _armed or name not in _armed:
        return
    with _lock:
        _armed[name] -= 1
        if _armed[name] > 0:
            return
        if name in _raising:  # once: the threads that finish their work must not die too
            del _armed[name]
            raise CrashPointRaised(f"crash point {name} (armed with :raise)")
    os.kill(os.getpid(), signal.SIGKILL)
