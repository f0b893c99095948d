"""The SQL of run concurrency keys: ``sagaloop_concurrency_slots`` (a row per slot held, its
primary key (app, saga, key, slot index) the guarantee that one run holds a slot) and
``sagaloop_concurrency_waiters`` (the runs queued for a slot): the store's
``ConcurrencySlots`` role. On PostgreSQL a key's changes are serialized by a transaction-scoped
advisory lock on the key; SQLite serializes every write transaction already."""

from __future__ import annotations

from datetime import datetime
from typing import Any

import sqlalchemy as sa

from sagaloop.engine.ports import ConcurrencySlots, KeySlots
from sagaloop.store import tables as t
from sagaloop.store.core import SqlCore, conn_of

_s, _w = t.concurrency_slots.c, t.concurrency_waiters.c
_COUNTED = {"preserve_rowcount": True}


def _of_key(c: Any, app: str, saga: str, key: str) -> Any:
    return (c.app == app) & (c.saga == saga) & (c.key == key)


class SqlConcurrency(SqlCore, ConcurrencySlots):
    """Run concurrency keys on SQL."""

    def key_slots(self, tx: Any, app: str, saga: str, key: str) -> KeySlots:
        with self._in(tx) as conn:
            held = conn.execute(
                sa.select(_s.slot, _s.run_id).where(_of_key(_s, app, saga, key))
            ).all()
            waiting = conn.execute(
                sa.select(_w.run_id)
                .where(_of_key(_w, app, saga, key))
                .order_by(_w.started_at, _w.id)
            ).scalars()
            return KeySlots({int(slot): str(run) for slot, run in held}, list(waiting))

    def lock_key(self, tx: Any, app: str, saga: str, key: str) -> None:
        if self.dialect == "postgresql":
            name = f"sagaloop.concurrency\x1f{app}\x1f{saga}\x1f{key}"
            conn_of(tx).execute(
                sa.text("SELECT pg_advisory_xact_lock(hashtextextended(:name, 0))"),
                {"name": name},
            )

    def claim_slot(
        self, tx: Any, app: str, saga: str, key: str, slot: int, run_id: str, now: datetime
    ) -> bool:
        conn = conn_of(tx)
        values = {"app": app, "saga": saga, "key": key, "slot": slot, "run_id": run_id}
        if not self._insert_ignore(conn, t.concurrency_slots, {**values, "claimed_at": now}):
            return False
        conn.execute(t.concurrency_waiters.delete().where(_w.run_id == run_id))
        return True

    def move_slot(
        self, tx: Any, app: str, saga: str, key: str, slot: int, holder: str, run_id: str
    ) -> bool:
        q = (
            t.concurrency_slots.update()
            .where(_of_key(_s, app, saga, key), _s.slot == slot, _s.run_id == holder)
            .values(run_id=run_id)
        )
        return bool(conn_of(tx).execute(q.execution_options(**_COUNTED)).rowcount == 1)

    def release_slot(self, tx: Any, run_id: str) -> tuple[str, str, str] | None:
        conn = conn_of(tx)
        found: tuple[str, str, str] | None = None
        for table, c in ((t.concurrency_slots, _s), (t.concurrency_waiters, _w)):
            row = conn.execute(sa.select(c.app, c.saga, c.key).where(c.run_id == run_id)).first()
            if row is not None:
                found = (str(row[0]), str(row[1]), str(row[2]))
                self.lock_key(tx, *found)  # before the delete: the key's lock comes first
                conn.execute(table.delete().where(c.run_id == run_id))
        return found

    def note_waiting(self, tx: Any, reasons: dict[str, str]) -> None:
        conn, runs = conn_of(tx), t.runs.c
        for run_id, reason in reasons.items():
            conn.execute(
                t.runs.update()
                .where(runs.run_id == run_id, runs.status == "running")
                .values(reason=reason)
            )

    def queue_for_slot(
        self, tx: Any, app: str, saga: str, key: str, run_id: str, started_at: datetime
    ) -> None:
        values = {"run_id": run_id, "app": app, "saga": saga, "key": key}
        self._insert_ignore(
            conn_of(tx), t.concurrency_waiters, {**values, "started_at": started_at}
        )
