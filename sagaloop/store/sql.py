"""The SQL store: runs, history, timers, inbox and outbox on SQLAlchemy Core.

SQLite (the embedded default) is used in WAL mode with ``BEGIN IMMEDIATE`` write transactions,
so that activations, claims and timer firings of several processes are serialized by the
database. On PostgreSQL, ``lock_run`` takes the run's row lock (``FOR UPDATE``) and claims skip
rows other transactions hold (``FOR UPDATE SKIP LOCKED``). Dialect specifics are chosen in
``store/`` and nowhere else; driver errors leave the store as :class:`~sagaloop.errors.StoreError`
or, when worth retrying, :class:`~sagaloop.errors.TransientStoreError` (see ``connect.py``).
"""

from __future__ import annotations

import dataclasses
import secrets
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from typing import Any, NoReturn

import sqlalchemy as sa
from sqlalchemy import Connection, Table
from sqlalchemy import exc as sa_exc
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.engine import Engine as SAEngine
from sqlalchemy.pool import StaticPool

from sagaloop.engine import history as h
from sagaloop.engine.history import Event, NewEvent, number
from sagaloop.engine.messages import Envelope
from sagaloop.engine.ports import (
    ApprovalRow,
    Handoff,
    HeldSlot,
    Outgoing,
    QueuedMessage,
    RunRecord,
    Timer,
    batched,
)
from sagaloop.engine.state import ALL_STATUSES, FINAL_STATUSES, NEEDS_ATTENTION
from sagaloop.store import approvals, limits, migrations, payloads, queue
from sagaloop.store import processes as registry
from sagaloop.store import tables as t
from sagaloop.store.connect import create_sa_engine, mask_url, translate

__all__ = ["SqlStore", "create_sa_engine"]

FINISHED = ("completed", "failed", "compensated", "cancelled")
DELETE_CHUNK = 1000
"""The most published rows one statement deletes."""
SIGNING_KEY = "message-signing-key"
"""The name of the signing key in ``sagaloop_secrets``."""
_DB_ERRORS = (sa_exc.DBAPIError, sa_exc.TimeoutError)


class _Tx:
    __slots__ = ("conn", "enqueued", "handed", "own", "published")

    def __init__(self, conn: Connection, *, own: bool) -> None:
        self.conn = conn
        self.enqueued = False
        self.own = own
        """Committed by the store (not an attached transaction): its rows can be handed over."""
        self.handed: list[QueuedMessage] = []
        self.published: list[tuple[list[int], str]] = []
        """Deletions of published rows this transaction carries (see SqlStore.delete_later)."""


class _Statements:
    """The statements of the hot path, built once with bound parameters: building an
    SQLAlchemy statement costs more Python than executing its cached compilation."""

    def __init__(self, dialect: str) -> None:
        b = sa.bindparam
        runs, history, inbox = t.runs.c, t.history.c, t.inbox.c
        self.get_run = sa.select(t.runs).where(runs.run_id == b("key"))
        self.lock_run = self.get_run.with_for_update() if dialect == "postgresql" else self.get_run
        self.save_run = t.runs.update().where(runs.run_id == b("key"))  # SET: the values given
        self.save_run_if = self.save_run.where(
            runs.last_seq == b("expected_seq")
        ).execution_options(preserve_rowcount=True)
        self.load_history = (
            sa.select(t.history)
            .where(history.run_id == b("key"), history.seq > b("after_seq"))
            .order_by(history.seq)
        )
        self.inbox_get = sa.select(inbox.result).where(
            inbox.consumer == b("key_consumer"), inbox.message_id == b("key_message_id")
        )
        insert: Any = {"postgresql": pg_insert, "sqlite": sqlite_insert}.get(dialect)
        self.insert_ignore = {
            table: insert(table)
            .on_conflict_do_nothing()
            # without preserve_rowcount, SQLAlchemy reports -1 for an INSERT through psycopg
            .execution_options(preserve_rowcount=True)
            for table in (t.runs, t.inbox, t.secrets)
            if insert is not None
        }


def _conn(tx: Any) -> Connection:
    assert isinstance(tx, _Tx), "pass the transaction object given by store.transaction()"
    return tx.conn


class SqlStore:
    """The :class:`~sagaloop.engine.ports.Store` on SQLite or PostgreSQL.

    The keyword options size and bound the connection pool (see :func:`create_sa_engine`);
    they are ignored when an ``engine`` is given.
    """

    def __init__(
        self,
        url: str,
        *,
        engine: SAEngine | None = None,
        pool_size: int = 5,
        max_overflow: int = 10,
        pool_timeout: float = 30.0,
        connect_timeout: float = 10.0,
        busy_timeout: float = 30.0,
    ) -> None:
        self.url = mask_url(url)
        """The URL without its password, for messages."""
        self.engine = engine or create_sa_engine(
            url,
            pool_size=pool_size,
            max_overflow=max_overflow,
            pool_timeout=pool_timeout,
            connect_timeout=connect_timeout,
            busy_timeout=busy_timeout,
        )
        self.dialect = self.engine.dialect.name
        self._sql = _Statements(self.dialect)
        self._memory_lock = threading.RLock() if isinstance(self.engine.pool, StaticPool) else None
        self.wakeup = threading.Condition()
        self.writes = 0
        """Counts committed transactions of this process that queued messages; a consumer
        reads it before looking for work and waits only if it has not moved since, so a
        commit between the look and the wait is never missed."""
        self.handoff: Handoff | None = None
        self.claim_owner: str | None = None
        """The registry token of the service process using this store: its claims' tokens
        start with it, so that they are released once it is proven dead (``runtime.takeover``)."""
        self._published: list[tuple[list[int], str]] = []
        self._published_lock = threading.Lock()
        self._read_options: dict[str, Any] = {"sagaloop_read": True}
        if self.dialect == "postgresql":  # one statement each: no BEGIN and ROLLBACK around it
            self._read_options["isolation_level"] = "AUTOCOMMIT"

    def __repr__(self) -> str:
        return f"SqlStore({self.url!r})"

    # --- schema and transactions -------------------------------------------------------------

    def _fail(self, e: BaseException, what: str) -> NoReturn:
        raise translate(e, self.engine.url, what) from e

    def upgrade(self) -> tuple[int, int]:
        try:
            return migrations.upgrade(self.engine)
        except _DB_ERRORS as e:
            self._fail(e, "the schema upgrade")

    def check_schema(self) -> None:
        try:
            migrations.verify(self.engine)
        except _DB_ERRORS as e:
            self._fail(e, "the schema check")

    def attach(self, conn: Connection) -> _Tx:
        """Use the caller's open transaction (a SQLAlchemy Connection) as a sagaloop one, so
        that sagaloop's rows commit or roll back with the caller's own writes."""
        return _Tx(conn, own=False)

    def hand_over_to(self, handoff: Handoff | None) -> None:
        self.handoff = handoff

    def nudge(self) -> None:
        """Wake whoever waits in :meth:`wait_for_writes`."""
        with self.wakeup:
            self.writes += 1
            self.wakeup.notify_all()

    def wait_for_writes(self, seen: int, timeout: float) -> None:
        """Wait until a transaction queued messages after ``writes`` was ``seen``, at most
        ``timeout`` seconds (other processes' writes are only seen by looking again)."""
        with self.wakeup:
            self.wakeup.wait_for(lambda: self.writes != seen, timeout)

    @contextmanager
    def transaction(self) -> Iterator[_Tx]:
        """A write transaction, committed when the block ends without an exception.

        Driver errors (raised by the store's methods inside the block, or by the commit) come
        out as StoreError, or TransientStoreError when running the block again may succeed.
        """
        lock = self._memory_lock
        if lock is not None:
            lock.acquire()
        tx: _Tx | None = None
        try:
            with self.engine.begin() as conn:
                tx = _Tx(conn, own=True)
                yield tx
            tx.published = []
            if tx.handed and self.handoff is not None:
                self.handoff.take(tx.handed)
            if tx.enqueued:
                self.nudge()
        except _DB_ERRORS as e:
            self._fail(e, "a transaction")
        finally:
            if tx is not None and tx.published:  # not committed: still pending
                with self._published_lock:
                    self._published.extend(tx.published)
            if lock is not None:
                lock.release()

    def delete_later(self, ids: Sequence[int], claim_token: str) -> None:
        """Delete these rows, if still claimed with ``claim_token``, with the next
        :meth:`claim` (the relay's sweep) or :meth:`delete_published`: published rows need no
        transaction of their own, on anyone's critical path. Until then a crash leaves them to
        be published again, which consumers deduplicate."""
        with self._published_lock:
            self._published.append((list(ids), claim_token))

    def delete_published(self) -> None:
        """Commit the deletions :meth:`delete_later` left pending, now."""
        with self._published_lock:
            if not self._published:
                return
        with self.transaction() as tx:
            self._delete_published(tx)

    def _delete_published(self, tx: _Tx) -> None:
        """Delete the pending rows in ``tx``; if it does not commit, they stay pending."""
        with self._published_lock:
            published, self._published = self._published, []
        tx.published = published
        by_token: dict[str, list[int]] = {}
        for ids, token in published:  # a relay publishes under one token: one statement
            by_token.setdefault(token, []).extend(ids)
        for token, ids in by_token.items():
            for chunk in batched(ids, DELETE_CHUNK):
                queue.delete_claimed(tx.conn, chunk, token)

    @contextmanager
    def _read(self) -> Iterator[Connection]:
        lock = self._memory_lock
        if lock is not None:
            lock.acquire()
        try:
            with self.engine.connect().execution_options(**self._read_options) as conn:
                yield conn
        except _DB_ERRORS as e:
            self._fail(e, "a read")
        finally:
            if lock is not None:
                lock.release()

    def close(self) -> None:
        self.engine.dispose()

    def _insert_ignore(self, conn: Connection, table: Table, values: dict[str, Any]) -> bool:
        """INSERT ... ON CONFLICT DO NOTHING; True when the row was inserted."""
        stmt = self._sql.insert_ignore.get(table)
        if stmt is None:
            try:
                with conn.begin_nested():
                    conn.execute(table.insert(), values)
            except sa_exc.IntegrityError:
                return False
            return True
        return conn.execute(stmt, values).rowcount == 1

    # --- runs --------------------------------------------------------------------------------

    def create_run(self, tx: Any, run: RunRecord) -> bool:
        """Insert the run; False when a run with that id exists (even one not yet committed
        by a concurrent transaction: this one then waits for it)."""
        offload = payloads.Offloader()
        values = {
            "run_id": run.run_id,
            "app": run.app,
            "saga": run.saga,
            "status": run.status,
            "input": offload.value(run.run_id, run.input),
            "last_seq": run.last_seq,
            "processed_seq": run.processed_seq,
            "created_at": run.created_at,
            "updated_at": run.updated_at,
        }
        offload.flush(_conn(tx), run.created_at)
        return self._insert_ignore(_conn(tx), t.runs, values)

    def lock_run(self, tx: Any, run_id: str) -> RunRecord | None:
        """The run, locked until ``tx`` ends (SQLite: the transaction holds the write lock)."""
        row = _conn(tx).execute(self._sql.lock_run, {"key": run_id}).mappings().first()
        return payloads.resolve_runs(_conn(tx), [_run(row)])[0] if row else None

    def get_run(self, run_id: str) -> RunRecord | None:
        with self._read() as conn:
            row = conn.execute(self._sql.get_run, {"key": run_id}).mappings().first()
            return payloads.resolve_runs(conn, [_run(row)])[0] if row else None

    def save_run(self, tx: Any, run: RunRecord, *, if_last_seq: int | None = None) -> bool:
        """Update the run; with ``if_last_seq``, only if its ``last_seq`` is still that (the
        row lock it takes serializes two engines activating the run). False: not updated."""
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
        offload.flush(_conn(tx), run.updated_at)
        if if_last_seq is None:
            return _conn(tx).execute(self._sql.save_run, values).rowcount == 1
        values["expected_seq"] = if_last_seq
        return _conn(tx).execute(self._sql.save_run_if, values).rowcount == 1

    def list_runs(
        self,
        *,
        status: str | None = None,
        saga: str | None = None,
        app: str | None = None,
        limit: int = 100,
    ) -> list[RunRecord]:
        q = sa.select(t.runs).order_by(t.runs.c.updated_at.desc()).limit(limit)
        if app is not None:
            q = q.where(t.runs.c.app == app)
        if status:
            q = q.where(t.runs.c.status == status)
        if saga:
            q = q.where(t.runs.c.saga == saga)
        with self._read() as conn:
            return payloads.resolve_runs(conn, [_run(r) for r in conn.execute(q).mappings()])

    def count_running(self, app: str, *, started: bool, at_most: int) -> int:
        """How many runs of ``app`` are ``running``, counted up to ``at_most``: those an engine
        took up (``started``), or those whose start waits for one (the start backlog)."""
        r = t.runs.c
        runs = sa.select(r.app).where(r.app == app, r.status == "running")  # index only
        runs = runs.where(r.processed_seq > 0 if started else r.processed_seq == 0)
        counted = sa.select(sa.func.count()).select_from(runs.limit(at_most).subquery())
        with self._read() as conn:
            return int(conn.execute(counted).scalar_one())

    def count_runs(self, *, saga: str | None = None, app: str | None = None) -> dict[str, int]:
        q = sa.select(t.runs.c.status, sa.func.count()).group_by(t.runs.c.status)
        if app is not None:
            q = q.where(t.runs.c.app == app)
        if saga:
            q = q.where(t.runs.c.saga == saga)
        with self._read() as conn:
            return {str(status): int(n) for status, n in conn.execute(q)}

    # --- history -----------------------------------------------------------------------------

    def load_history(self, tx: Any, run_id: str, after_seq: int = 0) -> list[Event]:
        q, params = self._sql.load_history, {"key": run_id, "after_seq": after_seq}
        if tx is not None:
            return _events(_conn(tx), run_id, _conn(tx).execute(q, params).mappings())
        with self._read() as conn:
            return _events(conn, run_id, conn.execute(q, params).mappings())

    def delete_history(self, tx: Any, run_id: str) -> None:
        """Delete the run's history (it continued as new: a fresh one starts at seq 1)."""
        _conn(tx).execute(t.history.delete().where(t.history.c.run_id == run_id))

    def append_events(
        self, tx: Any, run_id: str, after_seq: int, events: Sequence[NewEvent], at: datetime
    ) -> list[Event]:
        """Insert the events as ``after_seq + 1, ...``; a seq already used violates the primary
        key, which fails the whole transaction (two activations raced)."""
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
            offload.flush(_conn(tx), at)
            _conn(tx).execute(t.history.insert(), rows)
        return out

    # --- timers ------------------------------------------------------------------------------

    def add_timer(self, tx: Any, timer: Timer) -> None:
        """Set the timer, replacing one with the same (run, pos, kind). Its app is its run's
        (read in the same statement): an engine takes only its own app's timers."""
        conn = _conn(tx)
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

    def delete_timers(self, tx: Any, run_id: str) -> None:
        _conn(tx).execute(t.timers.delete().where(t.timers.c.run_id == run_id))

    def take_due_timers(
        self, tx: Any, now: datetime, limit: int, *, app: str | None = None
    ) -> list[Timer]:
        """Remove and return up to ``limit`` timers of ``app``'s runs (None: of every app)
        due at ``now``, earliest first. Timers that a concurrent transaction is taking are
        skipped (PostgreSQL) or waited for (SQLite)."""
        conn = _conn(tx)
        q = sa.select(t.timers).where(t.timers.c.fire_at <= now).order_by(t.timers.c.fire_at)
        if app is not None:
            q = q.where(t.timers.c.app == app)
        q = q.limit(limit)
        if self.dialect == "postgresql":
            q = q.with_for_update(skip_locked=True)
        due = [
            Timer(r["run_id"], r["pos"], r["kind"], r["fire_at"], r["attempt"], r["app"])
            for r in conn.execute(q).mappings()
        ]
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

    # --- secrets -----------------------------------------------------------------------------

    def signing_key(self) -> bytes:
        """The key that signs sagaloop's internal messages on a broker outside the database:
        32 random bytes, created by the first process that asks (race-free: insert if absent,
        then read what won), the same for every process of this database."""
        now = datetime.now(UTC)
        with self.transaction() as tx:
            values = {"name": SIGNING_KEY, "value": secrets.token_bytes(32), "created_at": now}
            self._insert_ignore(tx.conn, t.secrets, values)
            q = sa.select(t.secrets.c.value).where(t.secrets.c.name == SIGNING_KEY)
            return bytes(tx.conn.execute(q).scalar_one())

    # --- inbox -------------------------------------------------------------------------------

    def inbox_get(self, tx: Any, consumer: str, message_id: str) -> tuple[bool, Any]:
        q = self._sql.inbox_get
        params = {"key_consumer": consumer, "key_message_id": message_id}
        owner = payloads.inbox_owner(consumer, message_id)
        if tx is not None:
            conn = _conn(tx)
            row = conn.execute(q, params).first()
            return (True, payloads.resolve_value(conn, owner, row[0])) if row else (False, None)
        with self._read() as conn:
            row = conn.execute(q, params).first()
            return (True, payloads.resolve_value(conn, owner, row[0])) if row else (False, None)

    def inbox_put(self, tx: Any, consumer: str, message_id: str, result: Any, at: datetime) -> bool:
        offload = payloads.Offloader()
        result = offload.value(payloads.inbox_owner(consumer, message_id), result)
        offload.flush(_conn(tx), at)
        values = {"consumer": consumer, "message_id": message_id, "result": result, "at": at}
        return self._insert_ignore(_conn(tx), t.inbox, values)

    # --- outbox / database queue (SQL in queue.py) -------------------------------------------

    def enqueue(self, tx: Any, messages: Sequence[Outgoing], now: datetime) -> None:
        if not messages:
            return
        handoff = self.handoff if tx.own else None
        claim = None if handoff is None else (handoff.token, _deadlines(handoff, now))
        tx.handed.extend(queue.enqueue(_conn(tx), messages, now, claim))
        tx.enqueued = True

    def resolve(self, tx: Any, env: Envelope) -> Envelope:
        """``env`` with the values that :meth:`enqueue` moved to the payload table back in
        place (``env`` itself, without a query, when it holds none). MessageError if one is
        missing or a reference is malformed."""
        if not payloads.marked_fields(env.payload):
            return env
        if tx is not None:
            return payloads.resolve_message(_conn(tx), env)
        with self._read() as conn:
            return payloads.resolve_message(conn, env)

    def enqueue_raw(
        self, batch: Sequence[tuple[str, bytes]], now: datetime, *, trusted: bool = False
    ) -> None:
        """Put bodies on database queues as they are (the database broker's publish): not
        trusted as internal messages unless ``trusted``."""
        if not batch:
            return
        with self.transaction() as tx:
            queue.enqueue_raw(tx.conn, batch, now, trusted=trusted)
            tx.enqueued = True

    def claim(
        self,
        queues: Sequence[str] | None,
        limit: int,
        now: datetime,
        lease: timedelta,
        *,
        probe: bool = False,
    ) -> list[QueuedMessage]:
        """Claim up to ``limit`` available rows (oldest first) until ``now + lease``; first,
        delete the published rows :meth:`delete_later` left pending. ``probe`` (a poll): with
        nothing to delete and nothing to claim, one read and no transaction."""
        with self._published_lock:
            pending = bool(self._published)
        if probe and not pending:
            with self._read() as conn:
                if not queue.any_claimable(conn, queues, now):
                    return []
        with self.transaction() as tx:
            self._delete_published(tx)
            return queue.claim(tx.conn, self.dialect, queues, limit, now, lease, self.claim_owner)

    def delete_claimed(self, tx: Any, ids: Sequence[int], claim_token: str) -> int:
        """Delete the rows still claimed with ``claim_token`` (without ``tx``: in a transaction
        of its own); return how many."""
        if tx is not None:
            return queue.delete_claimed(_conn(tx), ids, claim_token)
        with self.transaction() as own:
            return queue.delete_claimed(own.conn, ids, claim_token)

    def release(self, ids: Sequence[int], claim_token: str, available_at: datetime) -> None:
        with self.transaction() as tx:
            tx.enqueued = queue.release(tx.conn, ids, claim_token, available_at)

    def extend_claim(self, id: int, claim_token: str, until: datetime) -> bool:
        with self.transaction() as tx:
            return queue.extend_claim(tx.conn, id, claim_token, until)

    def dead_letter(self, id: int, claim_token: str, reason: str, now: datetime) -> None:
        with self.transaction() as tx:
            queue.dead_letter(tx.conn, id, claim_token, reason, now)

    def dead_letters(self) -> list[tuple[str, bytes, str]]:
        with self._read() as conn:
            return queue.dead_letters(conn)

    def dead_letter_rows(
        self, *, ids: Sequence[int] | None = None, limit: int | None = None
    ) -> list[queue.DeadLetterRow]:
        """Dead letters, oldest first: those of ``ids`` (None: all), at most ``limit``."""
        with self._read() as conn:
            return queue.dead_letter_rows(conn, ids, limit)

    def count_dead_letters(self) -> int:
        with self._read() as conn:
            return queue.count_dead_letters(conn)

    def requeue_dead_letters(
        self,
        ids: Sequence[int] | None,
        now: datetime,
        *,
        trusted: Callable[[str, bytes, str], bool],
    ) -> list[queue.DeadLetterRow]:
        """Move dead letters (all when ``ids`` is None) back to their queues in one
        transaction; return them (see ``queue.requeue_dead_letters``)."""
        with self.transaction() as tx:
            rows = queue.requeue_dead_letters(tx.conn, ids, now, trusted)
            tx.enqueued = bool(rows)
            return rows

    def delete_dead_letters(self, ids: Sequence[int] | None) -> int:
        """Delete dead letters for good (all when ``ids`` is None); return how many."""
        with self.transaction() as tx:
            return len(queue.delete_dead_letters(tx.conn, ids))

    def queue_depths(self) -> dict[str, int]:
        with self._read() as conn:
            return queue.depths(conn)

    def oldest_outbox_message(self) -> datetime | None:
        """Since when the longest-waiting outbox row has been available (None when empty)."""
        with self._read() as conn:
            return queue.oldest_available(conn)

    # --- rate limits (SQL in limits.py) -------------------------------------------------------

    @contextmanager
    def _one_write(self) -> Iterator[Connection]:
        """A connection for one statement that writes: autocommit on PostgreSQL (one round
        trip; the statement is atomic by itself), a write transaction on SQLite."""
        if self.dialect != "postgresql":
            with self.transaction() as tx:
                yield tx.conn
            return
        with self._read() as conn:  # autocommit
            yield conn

    def reserve_slot(self, key: str, interval: float, now: datetime) -> datetime:
        with self._one_write() as conn:
            return limits.reserve(conn, self.dialect, key, interval, now)

    def hold_slot(
        self,
        message_id: str,
        key: str,
        slot: datetime,
        *,
        in_doubt: bool,
        give_backs: int,
        now: datetime,
    ) -> None:
        with self._one_write() as conn:
            limits.hold(
                conn,
                self.dialect,
                message_id,
                key,
                slot,
                in_doubt=in_doubt,
                give_backs=give_backs,
                now=now,
            )

    def take_held_slot(self, message_id: str) -> HeldSlot | None:
        with self._one_write() as conn:
            return limits.take(conn, self.dialect, message_id)

    # --- approvals (SQL in approvals.py) -------------------------------------------------------

    def publish_approval(
        self,
        tx: Any,
        run: RunRecord,
        call_id: str,
        request: dict[str, Any],
        *,
        now: datetime,
        release: str | None = None,
    ) -> None:
        approvals.publish(_conn(tx), run, call_id, request, now=now, release=release)

    def end_approvals(self, tx: Any, run_id: str) -> None:
        approvals.end(_conn(tx), [run_id])

    def approval(self, tx: Any, run_id: str, call_id: str) -> ApprovalRow | None:
        if tx is not None:
            return approvals.get(_conn(tx), run_id, call_id)
        with self._read() as conn:
            return approvals.get(conn, run_id, call_id)

    def claim_approval(
        self,
        tx: Any,
        run_id: str,
        call_id: str,
        *,
        request_id: str,
        message_id: str,
        answer: dict[str, Any],
    ) -> bool:
        return approvals.claim(
            _conn(tx),
            run_id,
            call_id,
            request_id=request_id,
            message_id=message_id,
            answer=answer,
        )

    def open_approvals(
        self,
        *,
        app: str | None,
        run_id: str | None = None,
        after: tuple[datetime, str, str] | None = None,
        limit: int = 50,
    ) -> list[ApprovalRow]:
        with self._read() as conn:
            return approvals.open_page(conn, app=app, run_id=run_id, after=after, limit=limit)

    # --- retention ---------------------------------------------------------------------------

    def prune(self, *, before: datetime, batch: int = 1000) -> int:
        """Delete up to ``batch`` inbox rows older than ``before`` and up to ``batch`` finished
        runs last updated before it (with their history and timers); return how many."""
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

    # --- process registry (read by `sagaloop health`; SQL in processes.py) --------------------

    def process_started(
        self,
        name: str,
        app: str,
        role: str,
        now: datetime,
        identity: registry.Identity | None = None,
    ) -> None:
        """Register process ``name`` (``role@host:pid``) as running since ``now``, with what
        it consumes and what proves it dead (``identity``)."""
        with self.transaction() as tx:
            registry.started(tx.conn, name, app, role, now, identity)

    def take_over(self, name: str, token: str) -> list[queue.Released]:
        """Release every outbox row that process ``name``, proven dead, claimed (tokens
        prefixed ``token``), and forget its token; return the rows released."""
        with self.transaction() as tx:
            rows = queue.release_owned(tx.conn, token)
            registry.forget_token(tx.conn, name, token)
            tx.enqueued = bool(rows)
            return rows

    def runs_in_flight(self) -> dict[str, int]:
        """How many unfinished runs each app has."""
        runs = t.runs.c
        q = sa.select(runs.app, sa.func.count()).where(runs.status.not_in(FINAL_STATUSES))
        with self._read() as conn:
            return {str(app): int(n) for app, n in conn.execute(q.group_by(runs.app))}

    def process_seen(
        self,
        name: str,
        now: datetime,
        problem: str | None,
        abandoned: Sequence[dict[str, Any]] = (),
    ) -> bool:
        """Refresh the process's row with its current problem (None: healthy) and the
        attempts it abandoned whose threads still run; False when it has no row."""
        with self.transaction() as tx:
            return registry.seen(tx.conn, name, now, problem, abandoned)

    def abandoned_attempts(self, run_id: str, *, seen_after: datetime) -> list[dict[str, Any]]:
        with self._read() as conn:
            return registry.abandoned(conn, run_id, seen_after)

    def live_queues(self, *, seen_after: datetime) -> list[tuple[str, list[str], list[str]]]:
        """Of each process seen after ``seen_after`` and not stopped: its app, the queues it
        consumes and the step queues its app declares."""
        with self._read() as conn:
            return registry.live_queues(conn, seen_after)

    def process_stopped(self, name: str, now: datetime, problem: str | None) -> None:
        """Mark the process as exited, with the problem it exits because of (None: cleanly)."""
        with self.transaction() as tx:
            registry.stopped(tx.conn, name, now, problem)

    def prune_processes(self, before: datetime) -> int:
        """Delete the rows of processes last seen before ``before``; return how many."""
        with self.transaction() as tx:
            return registry.prune(tx.conn, before)

    def processes(self) -> list[registry.ProcessRecord]:
        """Every registered process, oldest first."""
        with self._read() as conn:
            return registry.rows(conn)

    # --- metrics (read at scrape time by sagaloop.observability; each read bounded) ----------

    def run_counts(self) -> dict[tuple[str, str], int]:
        """How many runs each (saga, status) has: one pass over the (saga, status) index."""
        c = t.runs.c
        q = sa.select(c.saga, c.status, sa.func.count()).group_by(c.saga, c.status)
        with self._read() as conn:
            return {(str(saga), str(status)): int(n) for saga, status, n in conn.execute(q)}

    def start_backlogs(self) -> dict[str, int]:
        """Per app with any, the runs whose start no engine took up yet."""
        c = t.runs.c
        q = sa.select(c.app, sa.func.count()).where(c.processed_seq == 0, c.status == "running")
        with self._read() as conn:
            return {str(app): int(n) for app, n in conn.execute(q.group_by(c.app))}

    def outbox_summary(self, now: datetime) -> dict[str, tuple[int, datetime | None]]:
        """Per queue, the rows of the outbox and since when the longest-waiting row that nobody
        holds (unclaimed, or its claim expired) is available (None when there is none)."""
        c = t.outbox.c
        free = sa.or_(c.claimed_until.is_(None), c.claimed_until < now)
        oldest = sa.func.min(sa.case((free, c.available_at)))
        q = sa.select(c.queue, sa.func.count(), oldest).group_by(c.queue)
        with self._read() as conn:
            rows = conn.execute(q).all()
        process = t.UTCDateTime().process_result_value
        return {str(q): (int(n), process(at, self.engine.dialect)) for q, n, at in rows}

    def dead_letters_per_queue(self) -> dict[str, int]:
        """The dead letters of the database queues, per queue they came from."""
        d = t.dead_letters.c
        q = sa.select(d.queue, sa.func.count()).group_by(d.queue)
        with self._read() as conn:
            return {str(queue): int(n) for queue, n in conn.execute(q)}

    def latest_published(
        self, prefix: str, statuses: Sequence[str], *, limit: int = 100_000
    ) -> list[tuple[str, str, str, Any]]:
        """``(saga, run_id, key, value)``: the latest value that each run in one of ``statuses``
        published under each key starting with ``prefix``, of at most ``limit`` runs. Reads
        only the history of those runs, through its primary key."""
        e, later = t.history.alias("e"), t.history.alias("later")
        newer = (
            sa.select(sa.literal(1))
            .where(
                later.c.run_id == e.c.run_id,
                later.c.kind == h.PUBLISHED,
                later.c.name == e.c.name,
                later.c.seq > e.c.seq,
            )
            .exists()
        )
        q = sa.select(e.c.run_id, e.c.name, e.c.data).where(
            e.c.run_id.in_(sa.bindparam("runs", expanding=True)),
            e.c.kind == h.PUBLISHED,
            e.c.name.startswith(prefix, autoescape=True),
            ~newer,
        )
        out = []
        with self._read() as conn:
            runs = _saga_of_runs(conn, t.runs.c.status.in_(list(statuses)), limit)
            for run_id, key, data in _in_batches(conn, q, runs):
                if not str(key).startswith(prefix):  # SQLite's LIKE ignores ASCII case
                    continue
                data = payloads.resolve_datas(conn, run_id, [data or {}])[0]
                out.append((runs[run_id], str(run_id), str(key), data.get("value")))
        return out

    def halted_steps(self, *, limit: int = 100_000) -> list[tuple[str, str, str]]:
        """``(saga, run_id, step)`` of each step halted in doubt (not dispatched again since) in
        a run that needs attention, of at most ``limit`` runs: what waits for an operator to
        check an effect."""
        e, later = t.history.alias("e"), t.history.alias("later")
        again = (
            sa.select(sa.literal(1))
            .where(
                later.c.run_id == e.c.run_id,
                later.c.pos == e.c.pos,
                later.c.kind == h.STEP_DISPATCHED,
                later.c.seq > e.c.seq,
            )
            .exists()
        )
        q = sa.select(e.c.run_id, e.c.name).where(
            e.c.run_id.in_(sa.bindparam("runs", expanding=True)),
            e.c.kind == h.STEP_HALTED,
            ~again,
        )
        with self._read() as conn:
            runs = _saga_of_runs(conn, t.runs.c.status == NEEDS_ATTENTION, limit)
            return [(runs[run], str(run), str(step)) for run, step in _in_batches(conn, q, runs)]

    def step_outcomes(
        self, since: datetime, *, limit: int = 100_000
    ) -> tuple[list[StepOutcome], bool]:
        """The outcomes of step and compensation attempts recorded at ``since`` or later, each
        with when its attempt was dispatched, and whether more were left out (``limit``: runs,
        and outcomes). The history has no global order: the runs updated since then are found
        with the (status, updated_at) index, and their events through the history's key."""
        e, start = t.history.alias("e"), t.history.alias("start")
        do = e.c.kind.in_(_DO_OUTCOMES)
        started = (
            sa.select(start.c.at)
            .where(
                start.c.run_id == e.c.run_id,
                start.c.pos == e.c.pos,
                start.c.seq < e.c.seq,
                sa.or_(
                    sa.and_(do, start.c.kind.in_((h.STEP_SCHEDULED, h.STEP_DISPATCHED))),
                    sa.and_(~do, start.c.kind == h.COMPENSATION_SCHEDULED),
                ),
            )
            .order_by(start.c.seq.desc())
            .limit(1)
            .scalar_subquery()
        )
        # only failures carry what the metrics need from ``data`` (in_doubt): not results
        data = sa.case((e.c.kind.in_(_DOUBT_OUTCOMES), e.c.data))
        q = sa.select(
            e.c.run_id,
            e.c.seq,
            e.c.name,
            e.c.kind,
            e.c.at,
            started.label("started_at"),
            data.label("data"),
        ).where(
            e.c.run_id.in_(sa.bindparam("runs", expanding=True)),
            e.c.at >= since,
            e.c.kind.in_(_DO_OUTCOMES + _UNDO_OUTCOMES),
        )
        c = t.runs.c
        # every status listed, so that the (status, updated_at) index serves
        recent = sa.and_(c.status.in_(ALL_STATUSES), c.updated_at >= since)
        out: list[StepOutcome] = []
        with self._read() as conn:
            runs = _saga_of_runs(conn, recent, limit)
            for run_id, seq, step, kind, at, started_at, data in _in_batches(conn, q, runs):
                doubt = kind == h.STEP_HALTED or bool((data or {}).get("in_doubt"))
                out.append(
                    StepOutcome(
                        str(run_id), seq, runs[run_id], str(step), kind, at, started_at, doubt
                    )
                )
                if len(out) >= limit:
                    return out, True
        return out, len(runs) >= limit


_DO_OUTCOMES = (h.STEP_COMPLETED, h.STEP_RETRYING, h.STEP_FAILED, h.STEP_HALTED)
_UNDO_OUTCOMES = (h.COMPENSATION_COMPLETED, h.COMPENSATION_RETRYING, h.COMPENSATION_FAILED)
_DOUBT_OUTCOMES = (h.STEP_RETRYING, h.STEP_FAILED, h.COMPENSATION_RETRYING, h.COMPENSATION_FAILED)
_BATCH = 500
"""Runs per query of their history (an ``IN`` list)."""


def _saga_of_runs(conn: Connection, where: Any, limit: int) -> dict[str, str]:
    """run_id -> saga of at most ``limit`` runs matching ``where``."""
    q = sa.select(t.runs.c.run_id, t.runs.c.saga).where(where).limit(limit)
    return {str(run_id): str(saga) for run_id, saga in conn.execute(q)}


def _in_batches(conn: Connection, q: Any, runs: dict[str, str]) -> Iterator[Any]:
    """The rows of ``q`` (with an expanding ``runs`` parameter) for these runs, a batch of
    them at a time: the history is read through its primary key, never scanned whole."""
    ids = sorted(runs)
    for i in range(0, len(ids), _BATCH):
        yield from conn.execute(q, {"runs": ids[i : i + _BATCH]})


@dataclasses.dataclass(frozen=True, slots=True)
class StepOutcome:
    """How an attempt of a step (or of its compensation) ended, as its run's history says."""

    run_id: str
    seq: int
    saga: str
    step: str
    kind: str
    """The history event: ``step_completed``, ``step_retrying``, ``compensation_failed``..."""
    at: datetime
    started_at: datetime | None
    """When the attempt was dispatched (its ``step_scheduled``, ``step_dispatched`` or
    ``compensation_scheduled``)."""
    in_doubt: bool
    """The attempt failed without proof that it took no effect."""


def _events(conn: Connection, run_id: str, rows: Iterable[Any]) -> list[Event]:
    rows = list(rows)
    datas = payloads.resolve_datas(conn, run_id, [r["data"] or {} for r in rows])
    return [
        Event(r["seq"], r["kind"], r["at"], r["pos"], r["name"], data)
        for r, data in zip(rows, datas, strict=True)
    ]


def _timer_key(timer: Timer) -> Any:
    c = t.timers.c
    return (c.run_id == timer.run_id) & (c.pos == timer.pos) & (c.kind == timer.kind)


def _run(row: Any) -> RunRecord:
    return RunRecord(
        run_id=row["run_id"],
        app=row["app"],
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


def _deadlines(handoff: Handoff, now: datetime) -> Callable[[str], datetime | None]:
    """The claim deadline of a row handed over to ``handoff``, by its queue (None: not taken)."""

    def until(queue: str) -> datetime | None:
        lease = handoff.lease_for(queue)
        return None if lease is None else now + lease

    return until
