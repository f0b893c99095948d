"""Schedules (the store's ``ScheduleStore`` role): one row per (app, schedule) with its next
tick, moved on by compare-and-set so that engines firing the same tick agree on one move."""

from __future__ import annotations

from datetime import datetime
from typing import Any

import sqlalchemy as sa

from sagaloop.engine.ports import Schedule, ScheduleStore
from sagaloop.store import tables as t
from sagaloop.store.core import SqlCore, record

_c = t.schedules.c


def _key(app: str, name: str) -> Any:
    return (_c.app == app) & (_c.name == name)


class SqlSchedules(SqlCore, ScheduleStore):
    def put_schedule(self, schedule: Schedule, *, replace: bool) -> bool:
        values = {
            "app": schedule.app,
            "name": schedule.name,
            "saga": schedule.saga,
            "spec": schedule.spec,
            "input": schedule.input,
            "catch_up": schedule.catch_up,
            "paused": schedule.paused,
            "origin": schedule.origin,
            "next_tick": schedule.next_tick,
            "last_tick": schedule.last_tick,
            "last_run_id": schedule.last_run_id,
            "updated_at": schedule.updated_at or schedule.next_tick,
            "note": schedule.note,
        }
        with self.transaction() as tx:
            if self._insert_ignore(tx.conn, t.schedules, values):
                return True
            if not replace:
                return False
            key = _key(schedule.app, schedule.name)
            row = tx.conn.execute(sa.select(t.schedules).where(key)).mappings().first()
            if row is None:
                return False
            changed = {k: values[k] for k in ("saga", "spec", "input", "catch_up", "origin")}
            if all(row[k] == v for k, v in changed.items()):
                return False
            if row["spec"] == schedule.spec:
                changed.pop("spec")
            else:
                changed["next_tick"] = schedule.next_tick
            changed["updated_at"] = values["updated_at"]
            tx.conn.execute(t.schedules.update().where(key).values(**changed))
            return True

    def get_schedule(self, app: str, name: str) -> Schedule | None:
        with self._read() as conn:
            row = conn.execute(sa.select(t.schedules).where(_key(app, name))).mappings().first()
        return record(Schedule, row) if row is not None else None

    def list_schedules(self, app: str | None = None) -> list[Schedule]:
        q = sa.select(t.schedules).order_by(_c.app, _c.name)
        if app is not None:
            q = q.where(_c.app == app)
        with self._read() as conn:
            return [record(Schedule, r) for r in conn.execute(q).mappings()]

    def due_schedules(self, app: str, now: datetime) -> list[Schedule]:
        q = sa.select(t.schedules).where(
            (_c.app == app) & (_c.paused == sa.false()) & (_c.next_tick <= now)
        )
        with self._read() as conn:
            return [record(Schedule, r) for r in conn.execute(q.order_by(_c.next_tick)).mappings()]

    def advance_schedule(
        self,
        schedule: Schedule,
        next_tick: datetime,
        last_tick: datetime | None,
        last_run_id: str | None,
        now: datetime,
    ) -> bool:
        values: dict[str, Any] = {"next_tick": next_tick, "updated_at": now}
        if last_tick is not None:
            values.update(last_tick=last_tick, last_run_id=last_run_id)
        where = _key(schedule.app, schedule.name) & (_c.next_tick == schedule.next_tick)
        with self.transaction() as tx:
            return tx.conn.execute(t.schedules.update().where(where).values(**values)).rowcount == 1

    def pause_schedule(
        self,
        app: str,
        name: str,
        *,
        paused: bool,
        now: datetime,
        next_tick: datetime | None,
        note: str | None = None,
    ) -> bool:
        values: dict[str, Any] = {"paused": paused, "updated_at": now, "note": note}
        if next_tick is not None:
            values["next_tick"] = next_tick
        with self.transaction() as tx:
            result = tx.conn.execute(t.schedules.update().where(_key(app, name)).values(**values))
            return result.rowcount == 1

    def delete_schedule(self, app: str, name: str) -> bool:
        with self.transaction() as tx:
            return tx.conn.execute(t.schedules.delete().where(_key(app, name))).rowcount == 1
