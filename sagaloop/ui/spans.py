"""The spans of a run for its timeline: each step attempt, wait (for an event or an
approval), timer, compensation attempt and child run, with when it began and ended and how it
ended, read from the run's events; and where they sit on one time axis (percentages, for inline
SVG). Pure functions of the events and of "now" (an open span ends now)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from sagaloop.engine import history as h
from sagaloop.engine.history import Event
from sagaloop.sagas.approvals import KEY_PREFIX


@dataclasses.dataclass
class Bar:
    """One span of the run on the timeline: a step attempt, a wait, a timer, a compensation
    or a child run, with where it sits on its page's axis (percent)."""

    kind: str
    """``attempt``, ``wait``, ``timer``, ``compensation`` or ``child``."""
    label: str
    position: int | None
    start: datetime
    end: datetime | None
    """None: still open (drawn to the axis' end)."""
    outcome: str
    """``ok``, ``failed`` or ``open``: its colour."""
    detail: str = ""
    attempt: int = 0
    """A step attempt's number (1 for the first)."""
    child: str | None = None
    """A child run's id."""
    x: float = 0.0
    width: float = 0.0

    @property
    def took(self) -> str:
        if self.end is None:
            return "open"
        return duration_words((self.end - self.start).total_seconds())


def call_words(action: str, args: Any, limit: int = 120) -> str:
    """A call in words: ``refund(order="B-2", amount=700)``, cut with ``…`` past ``limit``."""
    if isinstance(args, Mapping):
        inner = ", ".join(
            f"{k}={json.dumps(v, ensure_ascii=False, default=str)}" for k, v in args.items()
        )
    elif args is None:
        inner = ""
    else:
        inner = json.dumps(args, ensure_ascii=False, default=str)
    text = f"{action}({inner})"
    return text if len(text) <= limit else text[: limit - 2] + "…)"


def bars_of(events: list[Event]) -> list[Bar]:
    """The spans of ``events``, in the order they began."""
    bars: list[Bar] = []
    open_attempt: dict[int, Bar] = {}
    open_comp: dict[int, Bar] = {}
    open_span: dict[int, Bar] = {}  # timers, waits, children by position
    waits: dict[int, tuple[str, ...]] = {}  # the open waits' names, by position
    names_of: dict[int, tuple[str, ...]] = {}  # every wait's
    names: dict[int, str] = {}

    def close(bar: Bar | None, at: datetime, outcome: str, detail: str = "") -> None:
        if bar is not None and bar.end is None:
            bar.end, bar.outcome = at, outcome
            bar.detail = detail or bar.detail

    def attempt(pos: int, n: int, at: datetime) -> None:
        bar = Bar("attempt", f"#{pos} {names.get(pos, '?')} · attempt {n}", pos, at, None, "open")
        bar.attempt = n
        open_attempt[pos] = bar
        bars.append(bar)

    def outcome(pos: int, at: datetime, result: str, detail: str = "") -> None:
        bar = open_attempt.get(pos)
        if bar is None or bar.end is not None:  # no dispatch recorded since its retry
            previous = bar.attempt if bar is not None else 0
            attempt(pos, previous + 1, bar.end if bar is not None and bar.end else at)
        close(open_attempt[pos], at, result, detail)

    for ev in events:
        pos = ev.pos
        if ev.kind == h.STEP_SCHEDULED and pos is not None:
            names[pos] = str(ev.name)
            attempt(pos, 1, ev.at)
        elif ev.kind == h.STEP_DISPATCHED and pos is not None:
            n = int(ev.data.get("attempt") or 1)
            current = open_attempt.get(pos)
            if current is not None and current.end is None and current.attempt == n:
                continue  # the attempt scheduled is the one dispatched
            close(current, ev.at, "failed")
            attempt(pos, n, ev.at)
        elif ev.kind == h.STEP_RETRYING and pos is not None:
            close(open_attempt.get(pos), ev.at, "failed", error_words(ev.data.get("error")))
        elif ev.kind == h.STEP_COMPLETED and pos is not None:
            outcome(pos, ev.at, "ok")
        elif ev.kind in (h.STEP_FAILED, h.STEP_HALTED) and pos is not None:
            outcome(pos, ev.at, "failed", error_words(ev.data.get("error")))
        elif ev.kind == h.TIMER_STARTED and pos is not None:
            named = f" {ev.name}" if ev.name and ev.name != "sleep" else ""
            bar = Bar("timer", f"#{pos} sleep{named}", pos, ev.at, None, "open")
            open_span[pos] = bar
            bars.append(bar)
        elif ev.kind == h.EVENT_WAITING and pos is not None:
            waits[pos] = names_of[pos] = tuple(ev.data.get("names") or [ev.name])
            prompt = ev.data.get("prompt")
            if str(ev.name).startswith(KEY_PREFIX) and isinstance(prompt, Mapping):
                asked = call_words(str(prompt.get("approve")), prompt.get("args"), 60)
                label = f"#{pos} approval of {asked}"
            else:
                label = f"#{pos} wait {' or '.join(waits[pos])}"
            bar = Bar("wait", label, pos, ev.at, None, "open")
            open_span[pos] = bar
            bars.append(bar)
        elif ev.kind == h.EVENT_ARRIVED:  # the open wait issued first that takes its name
            taker = next((p for p in sorted(waits) if ev.name in waits[p]), None)
            if taker is not None:
                del waits[taker]
                close(open_span[taker], ev.at, "ok", f"received {ev.name}")
        elif ev.kind == h.EVENT_REJECTED and pos is not None and pos in open_span:
            refused = open_span[pos]  # its data did not fit: the wait goes on
            if refused.kind == "wait" and pos in names_of and refused.outcome != "failed":
                refused.end, refused.outcome, waits[pos] = None, "open", names_of[pos]
            refused.detail = f"refused: {str(ev.data.get('reason', ''))[:120]}"
        elif ev.kind == h.TIMER_CANCELLED and pos is not None:  # what it raced came first
            close(open_span.get(pos), ev.at, "ok", "cancelled: not needed")
        elif ev.kind == h.TIMER_FIRED and pos is not None:
            if waits.pop(pos, None) is not None:  # a wait's timeout
                close(open_span.get(pos), ev.at, "failed", "timed out")
            else:
                close(open_span.get(pos), ev.at, "ok")
        elif ev.kind == h.CHILD_STARTED and pos is not None:
            child = str(ev.data.get("run_id"))
            bar = Bar("child", f"#{pos} child {ev.name}", pos, ev.at, None, "open", child=child)
            open_span[pos] = bar
            bars.append(bar)
        elif ev.kind == h.CHILD_COMPLETED and pos is not None:
            close(open_span.get(pos), ev.at, "ok")
        elif ev.kind == h.CHILD_FAILED and pos is not None:
            close(open_span.get(pos), ev.at, "failed", error_words(ev.data.get("error")))
        elif ev.kind == h.COMPENSATION_SCHEDULED and pos is not None:
            n = int(ev.data.get("attempt") or 1)
            label = f"#{pos} undo {names.get(pos, ev.name)}" + (f" · attempt {n}" if n > 1 else "")
            close(open_comp.get(pos), ev.at, "failed")
            bar = Bar("compensation", label, pos, ev.at, None, "open", attempt=n)
            open_comp[pos] = bar
            bars.append(bar)
        elif ev.kind == h.COMPENSATION_RETRYING and pos is not None:
            close(open_comp.get(pos), ev.at, "failed", error_words(ev.data.get("error")))
        elif ev.kind == h.COMPENSATION_COMPLETED and pos is not None:
            close(open_comp.get(pos), ev.at, "ok")
        elif ev.kind == h.COMPENSATION_FAILED and pos is not None:
            close(open_comp.get(pos), ev.at, "failed", error_words(ev.data.get("error")))
        elif ev.kind == h.RUN_FINISHED:  # what was still open ends with the run
            for bar in bars:
                close(bar, ev.at, "failed" if bar.outcome == "open" else bar.outcome, "run ended")
    return bars


def error_words(error: Any) -> str:
    if isinstance(error, Mapping):
        return f"{error.get('type')}: {str(error.get('message', ''))[:160]}"
    return str(error or "")[:160]


def duration_words(seconds: float) -> str:
    """A duration as a person reads it: ``850 ms``, ``12.5 s``, ``3.2 min``, ``5.0 h``,
    ``3.1 d`` (hours up to two days)."""
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    if seconds < 172800:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} d"


def offset_words(seconds: float) -> str:
    return "+" + duration_words(seconds)


def lay_out(rows: list[Bar], now: datetime) -> tuple[datetime, datetime, list[tuple[float, str]]]:
    """Place ``rows`` on one axis, from the first start to the last end among them (an open
    bar ends ``now``): set each bar's ``x`` and ``width`` (percent, a sliver at least), and
    return the axis' start, end and five labels (percent, offset from the start)."""
    if rows:
        start = min(b.start for b in rows)
        end = max(b.end or now for b in rows)
    else:
        start = end = now
    span = max((end - start).total_seconds(), 1e-3)
    for bar in rows:
        x = (bar.start - start).total_seconds() / span * 100
        w = ((bar.end or now) - bar.start).total_seconds() / span * 100
        bar.x = round(min(max(x, 0.0), 99.5), 2)
        bar.width = round(min(max(w, 0.5), 100 - bar.x), 2)
    return start, end, [(i * 25.0, offset_words(span * i / 4)) for i in range(5)]
