"""The SQL store: runs, history, timers, inbox and outbox on SQLAlchemy Core.

SQLite (the embedded default) is used in WAL mode with ``BEGIN IMMEDIATE`` write transactions,
so that activations, claims and timer firings of several processes are serialized by the
database. PostgreSQL specifics (``FOR UPDATE``, ``SKIP LOCKED``) are chosen by dialect here and
nowhere else.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime, timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy import Connection, event
from sqlalchemy.engine import Engine as SAEngine
from sqlalchemy.exc import DBAPIError, IntegrityError
from sqlalchemy.pool import StaticPool

from sagaloop.engine.history import Event, NewEvent
from sagaloop.engine.ports import Outgoing, QueuedMessage, RunRecord, Timer
from sagaloop.errors import StoreError
from sagaloop.store import migrations
from sagaloop.store import tables as t


class _Tx:
    __slots__ = ("conn", "enqueued")

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.enqueued = False


def _conn(tx: Any) -> Connection:
    assert isinstance(tx, _Tx), "pass the transaction object given by store.transaction()"
    return tx.conn


def create_sa_engine(url: str) -> SAEngine:
    """An SQLAlchemy engine configured for sagaloop's access patterns."""
    u = sa.make_url(url)
    if u.get_backend_name() == "sqlite":
        memory = u.database in (None, "", ":memory:")
        engine = sa.create_engine(
            u,
            connect_args={"check_same_thread": False, "timeout": 30},
            poolclass=StaticPool if memory else None,
        )

        @event.listens_for(engine, "connect")
        def _on_connect(dbapi_conn: Any, record: Any) -> None:
            dbapi_conn.isolation_level = None  # sagaloop emits BEGIN itself
            cur = dbapi_conn.cursor()
            if not memory:
                cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA synchronous=NORMAL")  # durable across process kills in WAL
            cur.execute("PRAGMA busy_timeout=30000")
            cur.close()

        @event.listens_for(engine, "begin")
        def _on_begin(conn: Connection) -> None:
            read = conn.get_execution_options().get("sagaloop_read")
            conn.exec_driver_sql("BEGIN" if read else "BEGIN IMMEDIATE")

        return engine
    if u.drivername in ("postgresql", "postgres"):
        u = u.set(drivername="postgresql+psycopg")
    return sa.create_engine(u, pool_pre_ping=True)


class SqlStore:
    """The :class:`~sagaloop.engine.ports.Store` on SQLite or PostgreSQL."""

    def __init__(self, url: str, *, engine: SAEngine | None = None) -> None:
        self.url = url
        self.engine = engine or create_sa_engine(url)
        self.dialect = self.engine.dialect.name
        self._memory_lock = threading.RLock() if isinstance(self.engine.pool, StaticPool) else None
        self.wakeup = threading.Condition()

    def __repr__(self) -> str:
        return f"SqlStore({self.engine.url.render_as_string(hide_password=True)!r})"

    # --- schema and transactions -------------------------------------------------------------

    def upgrade(self) -> tuple[int, int]:
        return migrations.upgrade(self.engine)

    def check_schema(self) -> None:
        migrations.verify(self.engine)

    @contextmanager
    def transaction(self) -> Iterator[_Tx]:
        lock = self._memory_lock
        if lock is not None:
            lock.acquire()
        try:
            with self.engine.begin() as conn:
                tx = _Tx(conn)
                yield tx
            if tx.enqueued:
                with self.wakeup:
                    self.wakeup.notify_all()
        except DBAPIError as e:
            raise StoreError(f"database error: {e.orig!r}") from e
        finally:
            if lock is not None:
                lock.release()

    @contextmanager
    def _read(self) -> Iterator[Connection]:
        lock = self._memory_lock
        if lock is not None:
            lock.acquire()
        try:
            with self.engine.connect().execution_options(sagaloop_read=True) as conn:
                yield conn
        except DBAPIError as e:
            raise StoreError(f"database error: {e.orig!r}") from e
        finally:
            if lock is not None:
                lock.release()

    def close(self) -> None:
        self.engine.dispose()

    # --- runs --------------------------------------------------------------------------------

    def create_run(self, tx: Any, run: RunRecord) -> bool:
        conn = _conn(tx)
        exists = conn.execute(
            sa.select(t.runs.c.run_id).where(t.runs.c.run_id == run.run_id)
        ).first()
        if exists:
            return False
        conn.execute(
            t.runs.insert().values(
                run_id=run.run_id,
                saga=run.saga,
                status=run.status,
                input=run.input,
                last_seq=run.last_seq,
                processed_seq=run.processed_seq,
                created_at=run.created_at,
                updated_at=run.updated_at,
            )
        )
        return True

    def lock_run(self, tx: Any, run_id: str) -> RunRecord | None:
        q = sa.select(t.runs).where(t.runs.c.run_id == run_id)
        if self.dialect == "postgresql":
            q = q.with_for_update()
        row = _conn(tx).execute(q).mappings().first()
        return _run(row) if row else None

    def get_run(self, run_id: str) -> RunRecord | None:
        with self._read() as conn:
            row = (
                conn.execute(sa.select(t.runs).where(t.runs.c.run_id == run_id)).mappings().first()
            )
        return _run(row) if row else None

    def save_run(self, tx: Any, run: RunRecord) -> None:
        _conn(tx).execute(
            t.runs.update()
            .where(t.runs.c.run_id == run.run_id)
            .values(
                status=run.status,
                output=run.output,
                error=run.error,
                reason=run.reason,
                last_seq=run.last_seq,
                processed_seq=run.processed_seq,
                updated_at=run.updated_at,
            )
        )

    def list_runs(
        self, *, status: str | None = None, saga: str | None = None, limit: int = 100
    ) -> list[RunRecord]:
        q = sa.select(t.runs).order_by(t.runs.c.updated_at.desc()).limit(limit)
        if status:
            q = q.where(t.runs.c.status == status)
        if saga:
            q = q.where(t.runs.c.saga == saga)
        with self._read() as conn:
            return [_run(r) for r in conn.execute(q).mappings()]

    def count_runs(self, *, saga: str | None = None) -> dict[str, int]:
        q = sa.select(t.runs.c.status, sa.func.count()).group_by(t.runs.c.status)
        if saga:
            q = q.where(t.runs.c.saga == saga)
        with self._read() as conn:
            return {str(status): int(n) for status, n in conn.execute(q)}

    # --- history -----------------------------------------------------------------------------

    def load_history(self, tx: Any, run_id: str, after_seq: int = 0) -> list[Event]:
        q = (
            sa.select(t.history)
            .where(t.history.c.run_id == run_id, t.history.c.seq > after_seq)
            .order_by(t.history.c.seq)
        )
        if tx is not None:
            rows = list(_conn(tx).execute(q).mappings())
        else:
            with self._read() as conn:
                rows = list(conn.execute(q).mappings())
        return [
            Event(r["seq"], r["kind"], r["at"], r["pos"], r["name"], r["data"] or {}) for r in rows
        ]

    def append_events(
        self, tx: Any, run_id: str, after_seq: int, events: Sequence[NewEvent], at: datetime
    ) -> list[Event]:
        out = [
            Event(after_seq + i, e.kind, at, e.pos, e.name, e.data)
            for i, e in enumerate(events, start=1)
        ]
        if out:
            _conn(tx).execute(
                t.history.insert(),
                [
                    {
                        "run_id": run_id,
                        "seq": e.seq,
                        "kind": e.kind,
                        "pos": e.pos,
                        "name": e.name,
                        "data": e.data,
                        "at": e.at,
                    }
                    for e in out
                ],
            )
        return out

    # --- timers ------------------------------------------------------------------------------

    def add_timer(self, tx: Any, timer: Timer) -> None:
        conn = _conn(tx)
        key = (
            (t.timers.c.run_id == timer.run_id)
            & (t.timers.c.pos == timer.pos)
            & (t.timers.c.kind == timer.kind)
        )
        conn.execute(t.timers.delete().where(key))
        conn.execute(
            t.timers.insert().values(
                run_id=timer.run_id,
                pos=timer.pos,
                kind=timer.kind,
                fire_at=timer.fire_at,
                attempt=timer.attempt,
            )
        )

    def delete_timers(self, tx: Any, run_id: str) -> None:
        _conn(tx).execute(t.timers.delete().where(t.timers.c.run_id == run_id))

    def take_due_timers(self, tx: Any, now: datetime, limit: int) -> list[Timer]:
        conn = _conn(tx)
        q = sa.select(t.timers).where(t.timers.c.fire_at <= now).order_by(t.timers.c.fire_at)
        q = q.limit(limit)
        if self.dialect == "postgresql":
            q = q.with_for_update(skip_locked=True)
        due = [
            Timer(r["run_id"], r["pos"], r["kind"], r["fire_at"], r["attempt"])
            for r in conn.execute(q).mappings()
        ]
        for timer in due:
            conn.execute(
                t.timers.delete().where(
                    (t.timers.c.run_id == timer.run_id)
                    & (t.timers.c.pos == timer.pos)
                    & (t.timers.c.kind == timer.kind)
                )
            )
        return due

    def next_timer_at(self) -> datetime | None:
        with self._read() as conn:
            value = conn.execute(sa.select(sa.func.min(t.timers.c.fire_at))).scalar()
        if value is None:
            return None
        return t.UTCDateTime().process_result_value(value, self.engine.dialect)

    # --- inbox -------------------------------------------------------------------------------

    def inbox_get(self, tx: Any, consumer: str, message_id: str) -> tuple[bool, Any]:
        row = (
            _conn(tx)
            .execute(
                sa.select(t.inbox.c.result).where(
                    t.inbox.c.consumer == consumer, t.inbox.c.message_id == message_id
                )
            )
            .first()
        )
        return (True, row[0]) if row else (False, None)

    def inbox_put(self, tx: Any, consumer: str, message_id: str, result: Any, at: datetime) -> bool:
        conn = _conn(tx)
        values = {"consumer": consumer, "message_id": message_id, "result": result, "at": at}
        if self.dialect == "postgresql":
            from sqlalchemy.dialects.postgresql import insert as pg_insert

            stmt = pg_insert(t.inbox).values(**values).on_conflict_do_nothing()
            return bool(conn.execute(stmt).rowcount)
        if self.dialect == "sqlite":
            from sqlalchemy.dialects.sqlite import insert as sqlite_insert

            stmt2 = sqlite_insert(t.inbox).values(**values).on_conflict_do_nothing()
            return bool(conn.execute(stmt2).rowcount)
        try:
            with conn.begin_nested():
                conn.execute(t.inbox.insert().values(**values))
        except IntegrityError:
            return False
        return True

    # --- outbox / database queue -------------------------------------------------------------

    def enqueue(self, tx: Any, messages: Sequence[Outgoing], now: datetime) -> None:
        if not messages:
            return
        _conn(tx).execute(
            t.outbox.insert(),
            [
                {
                    "queue": m.queue,
                    "message_id": m.envelope.message_id,
                    "body": m.envelope.to_bytes(),
                    "available_at": m.available_at or now,
                    "deliveries": 0,
                    "created_at": now,
                }
                for m in messages
            ],
        )
        tx.enqueued = True

    def enqueue_raw(self, batch: Sequence[tuple[str, bytes]], now: datetime) -> None:
        """Put bodies on database queues as they are (the database broker's publish)."""
        if not batch:
            return
        rows = [
            {
                "queue": queue,
                "message_id": f"raw:{uuid.uuid4().hex}",
                "body": body,
                "available_at": now,
                "deliveries": 0,
                "created_at": now,
            }
            for queue, body in batch
        ]
        with self.transaction() as tx:
            _conn(tx).execute(t.outbox.insert(), rows)
            tx.enqueued = True

    def claim(
        self, queues: Sequence[str] | None, limit: int, now: datetime, lease: timedelta
    ) -> list[QueuedMessage]:
        token = uuid.uuid4().hex
        c = t.outbox.c
        q = (
            sa.select(c.id, c.queue, c.body, c.deliveries)
            .where(
                c.available_at <= now,
                sa.or_(c.claimed_until.is_(None), c.claimed_until < now),
            )
            .order_by(c.id)
            .limit(limit)
        )
        if queues is not None:
            q = q.where(c.queue.in_(list(queues)))
        if self.dialect == "postgresql":
            q = q.with_for_update(skip_locked=True)
        with self.transaction() as tx:
            conn = _conn(tx)
            rows = list(conn.execute(q))
            if not rows:
                return []
            ids = [r.id for r in rows]
            conn.execute(
                t.outbox.update()
                .where(c.id.in_(ids))
                .values(claimed_until=now + lease, claim_token=token, deliveries=c.deliveries + 1)
            )
        return [QueuedMessage(r.id, r.queue, bytes(r.body), r.deliveries + 1, token) for r in rows]

    def delete_claimed(self, tx: Any, ids: Sequence[int], claim_token: str) -> int:
        stmt = t.outbox.delete().where(
            t.outbox.c.id.in_(list(ids)), t.outbox.c.claim_token == claim_token
        )
        if tx is not None:
            return int(_conn(tx).execute(stmt).rowcount)
        with self.transaction() as own:
            return int(_conn(own).execute(stmt).rowcount)

    def release(self, id: int, claim_token: str, available_at: datetime) -> None:
        with self.transaction() as tx:
            _conn(tx).execute(
                t.outbox.update()
                .where(t.outbox.c.id == id, t.outbox.c.claim_token == claim_token)
                .values(claimed_until=None, claim_token=None, available_at=available_at)
            )
            tx.enqueued = True

    def extend_claim(self, id: int, claim_token: str, until: datetime) -> bool:
        with self.transaction() as tx:
            result = _conn(tx).execute(
                t.outbox.update()
                .where(t.outbox.c.id == id, t.outbox.c.claim_token == claim_token)
                .values(claimed_until=until)
            )
            return bool(result.rowcount)

    def dead_letter(self, id: int, claim_token: str, reason: str, now: datetime) -> None:
        c = t.outbox.c
        with self.transaction() as tx:
            conn = _conn(tx)
            row = conn.execute(
                sa.select(c.queue, c.body).where(c.id == id, c.claim_token == claim_token)
            ).first()
            if row is None:
                return  # the lease was lost: whoever holds it now decides
            conn.execute(
                t.dead_letters.insert().values(
                    queue=row.queue, body=row.body, reason=reason, at=now
                )
            )
            conn.execute(t.outbox.delete().where(c.id == id))

    def dead_letters(self) -> list[tuple[str, bytes, str]]:
        d = t.dead_letters.c
        with self._read() as conn:
            rows = conn.execute(sa.select(d.queue, d.body, d.reason).order_by(d.id))
            return [(r.queue, bytes(r.body), r.reason) for r in rows]

    def queue_depths(self) -> dict[str, int]:
        c = t.outbox.c
        with self._read() as conn:
            q = sa.select(c.queue, sa.func.count()).group_by(c.queue)
            return {str(name): int(n) for name, n in conn.execute(q)}

    def prune(self, *, before: datetime, batch: int = 1000) -> int:
        """Delete inbox rows older than ``before`` and finished runs last updated before it."""
        removed = 0
        with self.transaction() as tx:
            conn = _conn(tx)
            keys = list(
                conn.execute(
                    sa.select(t.inbox.c.consumer, t.inbox.c.message_id)
                    .where(t.inbox.c.at < before)
                    .limit(batch)
                )
            )
            for consumer, message_id in keys:
                conn.execute(
                    t.inbox.delete().where(
                        t.inbox.c.consumer == consumer, t.inbox.c.message_id == message_id
                    )
                )
            removed += len(keys)
            finished = ("completed", "failed", "compensated", "cancelled")
            ids = list(
                conn.execute(
                    sa.select(t.runs.c.run_id)
                    .where(t.runs.c.status.in_(finished), t.runs.c.updated_at < before)
                    .limit(batch)
                ).scalars()
            )
            if ids:
                conn.execute(t.history.delete().where(t.history.c.run_id.in_(ids)))
                conn.execute(t.timers.delete().where(t.timers.c.run_id.in_(ids)))
                conn.execute(t.runs.delete().where(t.runs.c.run_id.in_(ids)))
            removed += len(ids)
        return removed


def _run(row: Any) -> RunRecord:
    return RunRecord(
        run_id=row["run_id"],
        saga=row["saga"],
        status=row["status"],
        input=row["input"],
        created_at=row["created_at"],
        updated_at=row["updated_at"],
        last_seq=row["last_seq"],
        processed_seq=row["processed_seq"],
        output=row["output"],
        error=row["error"],
        reason=row["reason"],
    )
