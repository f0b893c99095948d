"""The runs listing on SQL (``RunQueries.list_runs``, ``last_run_update``, ``run_waits``): how
each filter and order meets an index.

- Orders walk ``sagaloop_runs_updated`` / ``sagaloop_runs_created`` (time, run id); the cursor
  is a row-value comparison ``(time, run_id) < (:t, :id)``, so a deep page is a range scan
  from the cursor, never an offset.
- ``id_prefix``: on PostgreSQL ``run_id LIKE 'prefix%'`` served by
  ``sagaloop_runs_id_pattern`` (``varchar_pattern_ops``, whatever the database's collation);
  on SQLite the range ``prefix <= run_id < prefix'`` of the primary key (SQLite compares
  text as UTF-8 bytes, which is code point order).
- ``input_text``: ``ILIKE '%text%'`` on the stored input's JSON text (``lower() LIKE`` on
  SQLite), case-insensitive for ASCII letters; a character beyond ASCII is matched as the
  stored JSON escapes it. No index serves it: the database walks the order's index and tests
  each run's input until the page is full, so its cost grows with the runs it must pass over
  (all of them, when fewer than a page match).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy import Connection

from sagaloop.engine import history as h
from sagaloop.engine.history import Event
from sagaloop.engine.listing import RunOrder, RunWaits, read_run_cursor
from sagaloop.engine.records import ApprovalRow, RunRecord, Timer
from sagaloop.sagas.approvals import OPEN_STATUSES
from sagaloop.store import tables as t
from sagaloop.store.core import record

TAIL = 8
"""How many of a run's newest history events ``run_waits`` reads for its open waits."""
_ENDS = frozenset({h.TIMER_FIRED, h.EVENT_TAKEN})


def page_query(
    *,
    dialect: str,
    status: str | None,
    saga: str | None,
    app: str | None,
    limit: int,
    id_prefix: str | None,
    input_text: str | None,
    updated_since: datetime | None,
    order: RunOrder,
    after: str | None,
) -> sa.Select[Any]:
    """The SELECT of a page of runs (see the module's docstring for the indexes)."""
    r = t.runs.c
    q = sa.select(t.runs)
    if app is not None:
        q = q.where(r.app == app)
    if status:
        q = q.where(r.status == status)
    if saga:
        q = q.where(r.saga == saga)
    if id_prefix:
        q = q.where(_prefix(dialect, id_prefix))
    if input_text:
        pattern = "%" + _escape(_as_stored(input_text)) + "%"
        q = q.where(r.input.cast(sa.Text).ilike(pattern, escape="\\"))
    if updated_since is not None:
        q = q.where(r.updated_at >= updated_since)
    at = r[order.column]
    if after is not None:
        when, run_id = read_run_cursor(after, order)
        key = sa.tuple_(at, r.run_id)
        bound = sa.tuple_(sa.literal(when, t.UTCDateTime()), sa.literal(run_id, t.ID))
        q = q.where(key < bound if order.descending else key > bound)
    if order.descending:
        return q.order_by(at.desc(), r.run_id.desc()).limit(limit)
    return q.order_by(at.asc(), r.run_id.asc()).limit(limit)


def _as_stored(text: str) -> str:
    """``text`` as the stored JSON spells it: a character beyond ASCII as its ``\\uXXXX``
    escape (``JSONText`` writes ASCII-only JSON); quotes stay, so that ``"order":"B-2"``
    finds a member."""
    return "".join(c if ord(c) < 128 else json.dumps(c)[1:-1] for c in text)


def _escape(text: str) -> str:
    """``text`` as a literal part of a LIKE pattern (escape character: backslash)."""
    return text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")


def _prefix(dialect: str, prefix: str) -> sa.ColumnElement[bool]:
    r = t.runs.c
    if dialect == "postgresql":
        return r.run_id.like(_escape(prefix) + "%", escape="\\")
    following = prefix[:-1] + chr(min(ord(prefix[-1]) + 1, 0x10FFFF))
    return sa.and_(r.run_id >= prefix, r.run_id < following)


def last_update(conn: Connection, app: str | None) -> datetime | None:
    """``max(updated_at)``: the end of ``sagaloop_runs_updated`` (walked from its end to the
    first run of ``app``)."""
    q = sa.select(sa.func.max(t.runs.c.updated_at))
    if app is not None:
        q = q.where(t.runs.c.app == app)
    last: datetime | None = conn.execute(q).scalar()  # max() keeps the column's UTC type
    return last


def waits(conn: Connection, runs: Sequence[RunRecord]) -> dict[str, RunWaits]:
    """Three reads by primary key or run index: the open approvals, the timers and the
    ``TAIL`` newest history events of ``runs``."""
    ids = [r.run_id for r in runs]
    if not ids:
        return {}
    a, tm, hs = t.approvals.c, t.timers.c, t.history.c
    found: dict[str, RunWaits] = {run_id: RunWaits() for run_id in ids}
    q = sa.select(t.approvals).where(a.run_id.in_(ids), a.status.in_(OPEN_STATUSES))
    for row in conn.execute(q.order_by(a.requested_at)).mappings():
        found[row["run_id"]].approvals.append(record(ApprovalRow, row))
    q = sa.select(t.timers).where(tm.run_id.in_(ids)).order_by(tm.fire_at)
    for row in conn.execute(q).mappings():
        found[row["run_id"]].timers.append(record(Timer, row))
    tails = [sa.and_(hs.run_id == r.run_id, hs.seq > r.last_seq - TAIL) for r in runs]
    q = sa.select(hs.run_id, hs.seq, hs.kind, hs.pos, hs.name, hs.data, hs.at)
    events: dict[str, list[Event]] = {run_id: [] for run_id in ids}
    for row in conn.execute(q.where(sa.or_(*tails)).order_by(hs.run_id, hs.seq)).mappings():
        ev = Event(row["seq"], row["kind"], row["at"], row["pos"], row["name"], row["data"] or {})
        events[row["run_id"]].append(ev)
    for run_id, tail in events.items():
        found[run_id].waits.extend(open_waits(tail))
        found[run_id].steps.extend(open_steps(tail))
    return found


_STEP_OPENS = {h.STEP_SCHEDULED: "step", h.COMPENSATION_SCHEDULED: "compensation"}
_STEP_ENDS = {
    h.STEP_COMPLETED: "step",
    h.STEP_FAILED: "step",
    h.STEP_HALTED: "step",
    h.STEP_RETRYING: "step",
    h.COMPENSATION_COMPLETED: "compensation",
    h.COMPENSATION_FAILED: "compensation",
    h.COMPENSATION_RETRYING: "compensation",
}


def open_steps(tail: Sequence[Event]) -> list[Event]:
    """The steps and compensations scheduled in ``tail`` that no later event of it ended (a
    retry waits on its timer, which ``run_waits`` reads)."""
    scheduled: dict[tuple[str, int | None], Event] = {}
    for ev in tail:
        if ev.kind in _STEP_OPENS:
            scheduled[(_STEP_OPENS[ev.kind], ev.pos)] = ev
        elif ev.kind in _STEP_ENDS:
            scheduled.pop((_STEP_ENDS[ev.kind], ev.pos), None)
    return list(scheduled.values())


def open_waits(tail: Sequence[Event]) -> list[Event]:
    """The ``event_waiting`` events of ``tail`` that no later event of it ended, as the run's
    state ends them: a timer that fired or an event taken at the wait's position, an event
    that arrived under one of its names (the earliest such wait)."""
    waiting: dict[int | None, Event] = {}
    for ev in tail:
        if ev.kind == h.EVENT_WAITING:
            waiting[ev.pos] = ev
        elif ev.kind in _ENDS and ev.pos is not None:
            waiting.pop(ev.pos, None)
        elif ev.kind == h.EVENT_ARRIVED:
            for pos, wait in sorted(waiting.items(), key=lambda item: item[0] or 0):
                if ev.name in (wait.data.get("names") or [wait.name]):
                    del waiting[pos]
                    break
    return list(waiting.values())
