"""Timers (the store's ``TimerStore`` role): a timer per (run, position, kind), with the app
of its run, taken when due by that app's engines (``FOR UPDATE SKIP LOCKED`` on PostgreSQL)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

import sqlalchemy as sa

from sagaloop.engine.ports import Timer, TimerStore
from sagaloop.store import tables as t
from sagaloop.store.core import SqlCore, conn_of, record


class SqlTimers(SqlCore, TimerStore):
    def add_timer(self, tx: Any, timer: Timer) -> None:
        """Delete, then insert with the run's app read in the same statement."""
        conn = conn_of(tx)
        conn.execute(t.timers.delete().where(_timer_key(timer)))
        run_app = sa.select(t.runs.c.app).where(t.runs.c.run_id == timer.run_id)
        conn.execute(
            t.timers.insert().values(
                app=sa.func.coalesce(run_app.scalar_subquery(), ""),
                run_id=timer.run_id,
                pos=timer.pos,
                kind=timer.kind,
                fire_at=timer.fire_at,
                attempt=timer.attempt,
            )
        )

    def delete_timers(self, tx: Any, run_id: str, *, pos: int | None = None) -> None:
        which = t.timers.c.run_id == run_id
        if pos is not None:
            which = which & (t.timers.c.pos == pos)
        conn_of(tx).execute(t.timers.delete().where(which))

    def take_due_timers(
        self, tx: Any, now: datetime, limit: int, *, app: str | None = None
    ) -> list[Timer]:
        """On PostgreSQL ``SKIP LOCKED`` passes over the rows another transaction holds; on
        SQLite the write lock makes this one wait for it."""
        conn = conn_of(tx)
        q = sa.select(t.timers).where(t.timers.c.fire_at <= now).order_by(t.timers.c.fire_at)
        if app is not None:
            q = q.where(t.timers.c.app == app)
        q = q.limit(limit)
        if self.dialect == "postgresql":
            q = q.with_for_update(skip_locked=True)
        due = [record(Timer, r) for r in conn.execute(q).mappings()]
        for timer in due:
            conn.execute(t.timers.delete().where(_timer_key(timer)))
        return due

    def next_timer_at(self, *, app: str | None = None) -> datetime | None:
        q = sa.select(sa.func.min(t.timers.c.fire_at))
        if app is not None:
            q = q.where(t.timers.c.app == app)
        with self._read() as conn:
            value = conn.execute(q).scalar()
        if value is None:
            return None
        return t.UTCDateTime().process_result_value(value, self.engine.dialect)


def _timer_key(timer: Timer) -> Any:
    c = t.timers.c
    return (c.run_id == timer.run_id) & (c.pos == timer.pos) & (c.kind == timer.kind)
