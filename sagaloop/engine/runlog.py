"""One log line per run event that matters, on the logger ``sagaloop.run``.

The engine describes the events an activation appends (:func:`lines`) while it prepares them,
and writes the lines only once their transaction committed (``Engine.committed``). So nothing
is logged for what replay derives again from the history, for an activation rolled back and
prepared again after a conflict, or for a duplicate message. Started, waiting (for an event, a
timer), a step failed for good, compensating, needs attention, resumed, cancelled, finished are
at INFO or WARNING; the bookkeeping in between (a step scheduled, completed, retried...) is at
DEBUG. The attempts themselves are logged where they run, by the worker (``sagaloop.step``).

Every record carries ``run_id`` and ``saga`` in ``extra`` (and ``step`` and ``position`` for a
step's events), and its text names the run, for readers of plain text.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from sagaloop.engine import history as h
from sagaloop.engine import state as s
from sagaloop.engine.history import NewEvent
from sagaloop.engine.state import RunState
from sagaloop.errors import ErrorInfo

logger = logging.getLogger("sagaloop.run")

Line = tuple[int, str, tuple[Any, ...], dict[str, Any]]
"""A log call to make: level, %-style message, its arguments, ``extra``."""

_INFO = logging.INFO
_WARNING = logging.WARNING
_DEBUG = logging.DEBUG


def lines(st: RunState, events: Sequence[NewEvent], *, first: bool) -> list[Line]:
    """The log lines of ``events``, appended to run ``st`` (its state after them); ``first``:
    this is the run's first activation (a client may have stored its ``run_started``)."""
    if not logger.isEnabledFor(_INFO):
        return []
    out: list[Line] = []
    if first and st.epoch == 0:
        if st.parent is not None:
            out.append(
                _line(st, _INFO, "run %s (saga %s) started by run %s", st.parent.get("run_id"))
            )
        else:
            out.append(_line(st, _INFO, "run %s (saga %s) started"))
    for ev in events:
        line = _describe(st, ev)
        if line is not None and logger.isEnabledFor(line[0]):
            out.append(line)
    return out


def emit(pending: Sequence[Line]) -> None:
    for level, message, args, extra in pending:
        logger.log(level, message, *args, extra=extra)


def _line(st: RunState, level: int, message: str, *args: Any, ev: NewEvent | None = None) -> Line:
    """A line whose message starts ``run %s (saga %s)`` (or ``run %s``: then the saga is only
    in ``extra``)."""
    extra: dict[str, Any] = {"run_id": st.run_id, "saga": st.saga}
    if ev is not None and ev.pos is not None:
        extra["position"] = ev.pos
        if ev.name is not None and ev.kind not in (h.EVENT_WAITING, h.EVENT_ARRIVED):
            extra["step"] = ev.name
    lead = (st.run_id, st.saga) if message.startswith("run %s (saga %s)") else (st.run_id,)
    return (level, message, (*lead, *args), extra)


def _when(value: Any) -> str:
    try:
        return f"{datetime.fromisoformat(str(value)):%Y-%m-%d %H:%M:%S} UTC"
    except ValueError:
        return str(value)


def _error(data: Any) -> str:
    if not isinstance(data, dict):
        return "no error recorded"
    return ErrorInfo.from_json(data).describe()


def _with_traceback(message: str, args: tuple[Any, ...], error: Any) -> tuple[str, tuple[Any, ...]]:
    """At DEBUG, the error's stored traceback on the lines after the message."""
    trace = error.get("traceback") if isinstance(error, dict) else None
    if trace and logger.isEnabledFor(_DEBUG):
        return message + "\n%s", (*args, _indent(str(trace)))
    return message, args


def _indent(text: str) -> str:
    return "\n".join(f"    {line}" for line in text.splitlines())


def _attempts(st: RunState, pos: int | None) -> int:
    step = st.steps.get(pos) if pos is not None else None
    return step.attempt if step is not None else 1


def _describe(st: RunState, ev: NewEvent) -> Line | None:
    kind, d = ev.kind, ev.data
    if kind == h.RUN_STARTED:  # a child's, or continued as new: said by the lines of ``first``
        return None
    if kind == h.EVENT_WAITING:
        names = " or ".join(repr(n) for n in (d.get("names") or [ev.name]))
        until = f" until {_when(d['timeout_at'])}" if d.get("timeout_at") else ""
        return _line(st, _INFO, "run %s waiting for event %s%s", names, until, ev=ev)
    if kind == h.TIMER_STARTED:
        return _line(st, _INFO, "run %s sleeping until %s", _when(d.get("fire_at")), ev=ev)
    if kind == h.STEP_FAILED:
        attempts = _attempts(st, ev.pos)
        message, args = _with_traceback(
            "run %s: step %r failed for good after %d attempt(s): %s",
            (ev.name, attempts, _error(d.get("error"))),
            d.get("error"),
        )
        return _line(st, _WARNING, message, *args, ev=ev)
    if kind == h.CHILD_FAILED:
        error = _error(d.get("error"))
        return _line(st, _INFO, "run %s: its call of saga %r failed: %s", ev.name, error, ev=ev)
    if kind == h.COMPENSATION_SCHEDULED:
        again = f" (attempt {d.get('attempt')})" if d.get("attempt", 1) != 1 else ""
        return _line(st, _INFO, "run %s compensating: undoing step %r%s", ev.name, again, ev=ev)
    if kind == h.UNDO_REQUESTED:
        parent = (d.get("parent") or {}).get("run_id")
        return _line(st, _INFO, "run %s compensating: its parent run %s undoes it", parent)
    if kind == h.CANCEL_REQUESTED:
        if st.cancelling is not None:  # said by the cancel_delivered line
            return None
        return _line(st, _INFO, "run %s: cancellation requested (%s)", d.get("reason"))
    if kind == h.CANCEL_DELIVERED:
        until = _when(d.get("until"))
        message = "run %s cancelling (%s): its saga code may clean up until %s"
        return _line(st, _INFO, message, d.get("reason"), until)
    if kind == h.CANCEL_GRACE_EXPIRED:
        message = "run %s: its saga code did not end within its cancel_grace (until %s)"
        return _line(st, _WARNING, message, _when(d.get("until")))
    if kind == h.RUN_PARKED:
        return _line(st, _WARNING, "run %s needs attention: %s", d.get("reason"), ev=ev)
    if kind == h.RUN_RESUMED:
        return _line(st, _INFO, "run %s resumed (sagaloop retry)")
    if kind == h.RUN_CONTINUED:
        return _line(st, _INFO, "run %s (saga %s) continues as new (epoch %d)", st.epoch + 1)
    if kind == h.RUN_FINISHED:
        status = d.get("status")
        if status == s.COMPLETED:
            return _line(st, _INFO, "run %s finished: %s", status)
        level = _WARNING if status == s.FAILED else _INFO
        message, args = _with_traceback(
            "run %s finished: %s (%s)", (status, _error(st.saga_error)), st.saga_error
        )
        if st.saga_error is None and st.cancel_reason is not None:
            message, args = "run %s finished: %s (%s)", (status, st.cancel_reason)
        return _line(st, level, message, *args)
    if not logger.isEnabledFor(_DEBUG):
        return None
    if kind in (h.STEP_RETRYING, h.COMPENSATION_RETRYING):
        what = "step" if kind == h.STEP_RETRYING else "compensation of step"
        at, error = _when(d.get("retry_at")), _error(d.get("error"))
        return _line(st, _DEBUG, "run %s: %s %r retried at %s: %s", what, ev.name, at, error, ev=ev)
    if kind in (h.STEP_SCHEDULED, h.STEP_DISPATCHED):
        attempt = d.get("attempt", 1)
        return _line(st, _DEBUG, "run %s: step %r scheduled (attempt %s)", ev.name, attempt, ev=ev)
    name = f" {ev.name!r}" if ev.name is not None else ""
    where = f" at position {ev.pos}" if ev.pos is not None else ""
    return _line(st, _DEBUG, "run %s: %s%s%s", kind, name, where, ev=ev)
