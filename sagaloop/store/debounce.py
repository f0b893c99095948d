"""Debounced starts (the store's ``DebounceStore`` role): ``sagaloop_debounced`` holds the open
window of each debounced saga's key. A start updates it under the row's lock (PostgreSQL's
``FOR UPDATE``; SQLite serializes every write transaction already); the engine that starts
the window's run deletes it by compare-and-set on ``starts``, in the run's own transaction."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

import sqlalchemy as sa

from sagaloop.engine.ports import Debounced, DebounceStore
from sagaloop.store import tables as t
from sagaloop.store.core import SqlCore, conn_of, record

_c = t.debounced.c
_COUNTED = {"preserve_rowcount": True}
ATTEMPTS = 10
"""How often a start tries again when a window it read was closed under it (each retry means
another engine started a run meanwhile: a few at most)."""


def _key(app: str, saga: str, key: str) -> Any:
    return (_c.app == app) & (_c.saga == saga) & (_c.key == key)


def _due(
    now: datetime, first_at: datetime, period: timedelta, max_wait: timedelta | None
) -> datetime:
    due = now + period
    return due if max_wait is None else min(due, first_at + max_wait)


class SqlDebounce(SqlCore, DebounceStore):
    def debounce(
        self,
        app: str,
        saga: str,
        key: str,
        input: Any,
        now: datetime,
        period: timedelta,
        max_wait: timedelta | None,
        run_id: str,
    ) -> Debounced:
        where = _key(app, saga, key)
        for _ in range(ATTEMPTS):
            with self.transaction() as tx:
                conn = tx.conn
                q = sa.select(t.debounced).where(where).with_for_update()
                row = conn.execute(q).mappings().first()
                if row is None:
                    window = Debounced(
                        app, saga, key, run_id, input, now, now, _due(now, now, period, max_wait)
                    )
                    values = {f: getattr(window, f) for f in Debounced.__slots__}
                    if self._insert_ignore(conn, t.debounced, values):
                        return window
                    continue  # another start opened the window meanwhile: join it
                old = record(Debounced, row)
                due = _due(now, old.first_at, period, max_wait)
                values = {"input": input, "last_at": now, "due_at": due, "starts": old.starts + 1}
                same = where & (_c.run_id == old.run_id) & (_c.starts == old.starts)
                q2 = t.debounced.update().where(same).values(**values)
                if conn.execute(q2.execution_options(**_COUNTED)).rowcount == 1:
                    return Debounced(
                        app, saga, key, old.run_id, input, old.first_at, now, due, old.starts + 1
                    )
        raise RuntimeError(f"the debounce window of {saga!r} key {key!r} kept changing")

    def pending_debounced(self, app: str | None = None, saga: str | None = None) -> list[Debounced]:
        q = sa.select(t.debounced).order_by(_c.due_at, _c.app, _c.saga, _c.key)
        if app is not None:
            q = q.where(_c.app == app)
        if saga is not None:
            q = q.where(_c.saga == saga)
        with self._read() as conn:
            return [record(Debounced, r) for r in conn.execute(q).mappings()]

    def due_debounced(self, app: str, now: datetime, limit: int = 100) -> list[Debounced]:
        q = (
            sa.select(t.debounced)
            .where((_c.app == app) & (_c.due_at <= now))
            .order_by(_c.due_at)
            .limit(limit)
        )
        with self._read() as conn:
            return [record(Debounced, r) for r in conn.execute(q).mappings()]

    def find_debounced(self, run_id: str) -> Debounced | None:
        with self._read() as conn:
            row = conn.execute(sa.select(t.debounced).where(_c.run_id == run_id)).mappings()
            found = row.first()
        return None if found is None else record(Debounced, found)

    def take_debounced(self, tx: Any, window: Debounced) -> bool:
        where = _key(window.app, window.saga, window.key)
        where = where & (_c.run_id == window.run_id) & (_c.starts == window.starts)
        q = t.debounced.delete().where(where).execution_options(**_COUNTED)
        return bool(conn_of(tx).execute(q).rowcount == 1)
