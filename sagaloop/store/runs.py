"""Runs and their histories (the store's ``RunStore`` and ``RunQueries`` roles), and retention.

On PostgreSQL, ``lock_run`` takes the run's row lock (``FOR UPDATE``); on SQLite the write
transaction holds the database's write lock. Large values go to the payload table
(``payloads.py``) and come back resolved.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy import Connection

from sagaloop.engine.history import Event, NewEvent, number
from sagaloop.engine.listing import RunOrder, RunWaits, run_order
from sagaloop.engine.ports import Maintenance, RunQueries, RunRecord, RunStore
from sagaloop.store import approvals, limits, listing, payloads
from sagaloop.store import tables as t
from sagaloop.store.core import SqlCore, conn_of, record

FINISHED = ("completed", "failed", "compensated", "cancelled")


_RUN_COLUMNS = tuple(t.runs.c[f.name] for f in dataclasses.fields(RunRecord))
_GET_RUN = f"SELECT {', '.join(c.name for c in _RUN_COLUMNS)} FROM sagaloop_runs WHERE run_id = %s"
"""A run's row outside a transaction on PostgreSQL (``SqlCore._fetch_one``)."""


class SqlRuns(SqlCore, RunStore, RunQueries, Maintenance):
    """Runs and histories on SQL; ``prune`` deletes what retention no longer keeps."""

    # --- runs --------------------------------------------------------------------------------

    def create_run(self, tx: Any, run: RunRecord) -> bool:
        """An insert that ignores a conflict (waiting for a concurrent insert of the same id to
        commit or roll back first)."""
        offload = payloads.Offloader()
        values = {
            "run_id": run.run_id,
            "app": run.app,
            "saga": run.saga,
            "status": run.status,
            "input": offload.value(run.run_id, run.input),
            "output": offload.value(run.run_id, run.output),
            "error": run.error,
            "reason": run.reason,
            "last_seq": run.last_seq,
            "processed_seq": run.processed_seq,
            "created_at": run.created_at,
            "updated_at": run.updated_at,
        }
        offload.flush(conn_of(tx), run.created_at)
        return self._insert_ignore(conn_of(tx), t.runs, values)

    def lock_run(self, tx: Any, run_id: str) -> RunRecord | None:
        """``FOR UPDATE`` on PostgreSQL; on SQLite the transaction holds the write lock."""
        row = conn_of(tx).execute(self._sql.lock_run, {"key": run_id}).mappings().first()
        return payloads.resolve_runs(conn_of(tx), [record(RunRecord, row)])[0] if row else None

    def get_run(self, run_id: str) -> RunRecord | None:
        if self.dialect == "postgresql":  # a start's read: below SQLAlchemy's statement layer
            row = self._fetch_one(_GET_RUN, (run_id,), _RUN_COLUMNS)
            if row is None:
                return None
            run = record(RunRecord, row)
            if not (payloads.marked(run.input) or payloads.marked(run.output)):
                return run
        with self._read() as conn:
            found = conn.execute(self._sql.get_run, {"key": run_id}).mappings().first()
            return payloads.resolve_runs(conn, [record(RunRecord, found)])[0] if found else None

    def save_run(self, tx: Any, run: RunRecord, *, if_last_seq: int | None = None) -> bool:
        """With ``if_last_seq``, a conditional update: the row lock it takes serializes two
        engines activating the run."""
        offload = payloads.Offloader()
        values = {
            "key": run.run_id,
            "status": run.status,
            "output": offload.value(run.run_id, run.output),
            "error": run.error,
            "reason": run.reason,
            "last_seq": run.last_seq,
            "processed_seq": run.processed_seq,
            "updated_at": run.updated_at,
        }
        offload.flush(conn_of(tx), run.updated_at)
        if if_last_seq is None:
            return conn_of(tx).execute(self._sql.save_run, values).rowcount == 1
        values["expected_seq"] = if_last_seq
        return conn_of(tx).execute(self._sql.save_run_if, values).rowcount == 1

    def list_runs(
        self,
        *,
        status: str | None = None,
        saga: str | None = None,
        app: str | None = None,
        limit: int = 100,
        id_prefix: str | None = None,
        input_text: str | None = None,
        updated_since: datetime | None = None,
        order: RunOrder = RunOrder.UPDATED_DESC,
        after: str | None = None,
    ) -> list[RunRecord]:
        """One SELECT on the order's index (``listing.py`` says which filter uses which)."""
        q = listing.page_query(
            dialect=self.dialect,
            status=status,
            saga=saga,
            app=app,
            limit=limit,
            id_prefix=id_prefix,
            input_text=input_text,
            updated_since=updated_since,
            order=run_order(order),
            after=after,
        )
        with self._read() as conn:
            return payloads.resolve_runs(
                conn, [record(RunRecord, r) for r in conn.execute(q).mappings()]
            )

    def last_run_update(self, *, app: str | None = None) -> datetime | None:
        with self._read() as conn:
            return listing.last_update(conn, app)

    def run_waits(self, runs: Sequence[RunRecord]) -> dict[str, RunWaits]:
        with self._read() as conn:
            return listing.waits(conn, runs)

    def count_running(self, app: str, *, started: bool, at_most: int) -> int:
        """Counted in the (app, status, processed_seq) index, a limited subquery."""
        r = t.runs.c
        runs = sa.select(r.app).where(r.app == app, r.status == "running")  # index only
        runs = runs.where(r.processed_seq > 0 if started else r.processed_seq == 0)
        counted = sa.select(sa.func.count()).select_from(runs.limit(at_most).subquery())
        with self._read() as conn:
            return int(conn.execute(counted).scalar_one())

    def count_runs(self, *, saga: str | None = None, app: str | None = None) -> dict[str, int]:
        q = sa.select(t.runs.c.status, sa.func.count()).group_by(t.runs.c.status)
        q = _of(q, app=app, saga=saga)
        with self._read() as conn:
            return {str(status): int(n) for status, n in conn.execute(q)}

    # --- history -----------------------------------------------------------------------------

    def load_history(self, tx: Any, run_id: str, after_seq: int = 0) -> list[Event]:
        q, params = self._sql.load_history, {"key": run_id, "after_seq": after_seq}
        with self._in(tx) as conn:
            return _events(conn, run_id, conn.execute(q, params).mappings())

    def delete_history(self, tx: Any, run_id: str) -> None:
        conn_of(tx).execute(t.history.delete().where(t.history.c.run_id == run_id))

    def append_events(
        self, tx: Any, run_id: str, after_seq: int, events: Sequence[NewEvent], at: datetime
    ) -> list[Event]:
        """A seq already used violates the primary key, which fails the transaction."""
        out = number(after_seq, events, at)
        if out:
            offload = payloads.Offloader()
            rows = [
                {
                    "run_id": run_id,
                    "seq": e.seq,
                    "kind": e.kind,
                    "pos": e.pos,
                    "name": e.name,
                    "data": offload.data(run_id, e.data),
                    "at": e.at,
                }
                for e in out
            ]
            offload.flush(conn_of(tx), at)
            conn_of(tx).execute(t.history.insert(), rows)
        return out

    # --- retention ---------------------------------------------------------------------------

    def prune(self, *, before: datetime, batch: int = 1000) -> int:
        """One transaction: the runs go with their history, timers, approvals and payloads; the
        rate-limit holds written before ``before`` go too (counted)."""
        with self.transaction() as tx:
            conn = tx.conn
            keys = [
                tuple(k)
                for k in conn.execute(
                    sa.select(t.inbox.c.consumer, t.inbox.c.message_id)
                    .where(t.inbox.c.at < before)
                    .limit(batch)
                )
            ]
            if keys:
                key = sa.tuple_(t.inbox.c.consumer, t.inbox.c.message_id)
                conn.execute(t.inbox.delete().where(key.in_(keys)))
                payloads.delete(conn, [payloads.inbox_owner(*k) for k in keys])
            ids = list(
                conn.execute(
                    sa.select(t.runs.c.run_id)
                    .where(t.runs.c.status.in_(FINISHED), t.runs.c.updated_at < before)
                    .limit(batch)
                ).scalars()
            )
            if ids:
                conn.execute(t.history.delete().where(t.history.c.run_id.in_(ids)))
                conn.execute(t.timers.delete().where(t.timers.c.run_id.in_(ids)))
                conn.execute(t.runs.delete().where(t.runs.c.run_id.in_(ids)))
                approvals.end(conn, ids)
                payloads.delete(conn, ids)
            holds = limits.prune(conn, before)
        return len(keys) + len(ids) + holds


def _of(
    q: sa.Select[Any], *, app: str | None, saga: str | None, status: str | None = None
) -> sa.Select[Any]:
    """``q`` narrowed to the runs of ``app`` (None: of every app), of ``saga`` and in
    ``status`` (None or empty: any)."""
    r = t.runs.c
    if app is not None:
        q = q.where(r.app == app)
    if status:
        q = q.where(r.status == status)
    return q.where(r.saga == saga) if saga else q


def _events(conn: Connection, run_id: str, rows: Iterable[Any]) -> list[Event]:
    rows = list(rows)
    datas = payloads.resolve_datas(conn, run_id, [r["data"] or {} for r in rows])
    return [
        Event(r["seq"], r["kind"], r["at"], r["pos"], r["name"], data)
        for r, data in zip(rows, datas, strict=True)
    ]
