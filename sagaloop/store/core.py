"""The connection and transaction core of the SQL store: its engine and statement cache, write
transactions, reads outside a transaction and the translation of driver errors.

Each role of the store port (``runs.py``, ``timers.py``, ``inbox.py``, ``queue.py``,
``limits.py``, ``approvals.py``, ``processes.py``, ``read.py``) is a mixin over
:class:`SqlCore`; ``sql.py`` composes them into ``SqlStore``.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, NamedTuple, NoReturn, TypeVar

import sqlalchemy as sa
from sqlalchemy import Connection, RowMapping, Table
from sqlalchemy import exc as sa_exc
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.engine import Engine as SAEngine
from sqlalchemy.pool import StaticPool

from sagaloop.engine.ports import Handoff, QueuedMessage, Transactions
from sagaloop.store import migrations
from sagaloop.store import tables as t
from sagaloop.store.connect import create_sa_engine, mask_url, translate

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

DB_ERRORS = (sa_exc.DBAPIError, sa_exc.TimeoutError)
OUTBOX_CHANNEL = "sagaloop_outbox"
"""The PostgreSQL channel a transaction that wrote outbox rows nobody holds notifies."""
_NOTIFY = sa.text(f"NOTIFY {OUTBOX_CHANNEL}")
logger = logging.getLogger(__name__)
MAX_WAKES = 1000
"""The most rows of one queue that wake a consumer each (see ``SqlCore.nudge``): a process
that queues to a queue it does not consume (a client's starts) keeps no more."""
R = TypeVar("R", bound="DataclassInstance")
_FIELDS: dict[type[Any], tuple[str, ...]] = {}


def record(cls: type[R], row: RowMapping | Mapping[str, Any]) -> R:
    """The port's record ``cls`` (a dataclass: ``RunRecord``, ``Timer``, ``ApprovalRow``...)
    from a row that has a column of each of its fields' names (and maybe more)."""
    names = _FIELDS.get(cls)
    if names is None:
        names = _FIELDS[cls] = tuple(f.name for f in dataclasses.fields(cls))
    return cls(**{name: row[name] for name in names})


FIRST, BEGUN, DONE = "first", "begun", "done"  # the states of a lone transaction (SqlTx.lone)


class SqlTx:
    """A transaction of the store: the connection, and what to do once it committed."""

    __slots__ = (
        "conn",
        "enqueued",
        "handed",
        "lone",
        "own",
        "published",
        "queues",
        "settles",
    )

    def __init__(self, conn: Connection, *, own: bool, lone: bool = False) -> None:
        self.conn = conn
        self.lone = FIRST if lone else ""
        """Of a lone transaction (``transaction(lone=True)`` on PostgreSQL), on an
        autocommitting connection: ``FIRST`` until its first write, which is either the
        checkpoint's one statement (``DONE``: it committed) or ``BEGIN`` (``BEGUN``)."""
        self.enqueued = False
        """Rows of queues it does not name became claimable (released, taken over): after the
        commit, wake every waiting consumer."""
        self.queues: list[str] = []
        """The queue of each claimable row it inserted: after the commit, wake one consumer per
        row."""
        self.own = own
        """Committed by the store (not an attached transaction): its rows can be handed over."""
        self.handed: list[QueuedMessage] = []
        self.published: list[tuple[list[int], str]] = []
        """Deletions of published rows this transaction carries (see SqlStore.delete_later)."""
        self.settles: list[Settle] = []
        """Claimed rows it must delete before it commits (see SqlStore.settle_claimed), not
        deleted yet: its next checkpoint statement carries them, else the commit does."""


class Settle(NamedTuple):
    """Rows a transaction deletes, all of them still claimed with ``claim_token``, or raises
    ``lost`` (and does not commit)."""

    ids: list[int]
    claim_token: str
    lost: Exception


class Statements:
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


def conn_of(tx: Any) -> Connection:
    """The connection of a transaction the store gave (``transaction()`` or ``attach()``), to
    write in it: a lone transaction's first write begins it."""
    own = open_tx(tx)
    if own.lone == FIRST:
        own.conn.exec_driver_sql("BEGIN")
        own.lone = BEGUN
    return own.conn


def open_tx(tx: Any) -> SqlTx:
    """``tx``, a transaction the store gave, still open to writes (for a write it keeps for
    later, as a settle that the checkpoint's statement carries: it begins nothing)."""
    assert isinstance(tx, SqlTx), "pass the transaction object given by store.transaction()"
    if tx.lone == DONE:
        raise RuntimeError("a lone transaction committed with its checkpoint: no write after it")
    return tx


def driver_row(conn: Connection, sql: str, params: Mapping[str, Any]) -> Sequence[Any]:
    """The one row of ``sql`` (a fixed text with ``%(name)s`` parameters) run on ``conn``, in
    whatever transaction it is in, below SQLAlchemy's statement layer: psycopg's cursor on the
    connection's own driver connection. For the hot statement (the checkpoint's), SQLAlchemy's
    execution context and result objects cost as much CPU as psycopg's part (60 to 80 us of
    110 to 200 here). Whatever the statement raises is handled as SQLAlchemy handles it: a
    driver error wrapped in ``DBAPIError``, a lost connection (or an interruption) invalidated.
    While anything listens to SQLAlchemy's events (a test or a benchmark counting statements,
    OpenTelemetry's instrumentation), the statement goes through ``exec_driver_sql``, where
    they see it."""
    if conn._has_events or conn.engine._has_events:
        return conn.exec_driver_sql(sql, params).one()
    cursor = None
    driver: Any = conn.connection.driver_connection
    try:
        cursor = driver.cursor()
        cursor.execute(sql, params)
        row = cursor.fetchone()
        cursor.close()
    except BaseException as e:
        conn._handle_dbapi_exception(e, sql, params, cursor, None)  # SQLAlchemy's own handling
    if row is None:
        raise sa_exc.NoResultFound("the statement returned no row")
    return row  # type: ignore[no-any-return]


def lone_statement(tx: SqlTx) -> Connection | None:
    """The connection on which the checkpoint's one statement commits by itself, if it is a
    lone transaction's first write (else None). The transaction is over once it ran."""
    if tx.lone != FIRST or tx.conn.in_nested_transaction():
        return None
    tx.lone = DONE
    return tx.conn


def reopen(tx: SqlTx) -> None:
    """The lone statement wrote nothing of the block's (a duplicate, a conflict): the
    transaction is not over, its next write begins it."""
    tx.lone = FIRST


class SqlCore(Transactions):
    """The engine, the transactions and the reads that every role of ``SqlStore`` uses.

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
        self._sql = Statements(self.dialect)
        self._memory_lock = threading.RLock() if isinstance(self.engine.pool, StaticPool) else None
        self._wake_lock = threading.RLock()
        self.wakeup = threading.Condition(self._wake_lock)
        """The lock of the wakes; waiters wait on a condition of theirs over it (``_waits``)."""
        self._waits: dict[frozenset[str] | None, threading.Condition] = {}
        """Per set of queues waited for (None: any queue), the condition its waiters wait on:
        a commit wakes one waiter per row among those of the row's queue, not every consumer
        of the process (the in-process lane's threads are not woken by the broker's rows, nor
        the engine's consumer by a worker's). A woken waiter whose ticket another took waits
        again; one whose wait timed out as it was woken still looks for its ticket."""
        self.writes = 0
        """Counts committed transactions of this process that queued messages (to any queue)."""
        self._any_writes = 0
        self._tickets: collections.Counter[str] = collections.Counter()
        """Per queue, the rows committed by this process that no waiting consumer was woken
        for yet (see :meth:`wait_for_writes`)."""
        self.handoff: Handoff | None = None
        self.claim_owner: str | None = None
        """The registry token of the service process using this store: its claims' tokens
        start with it, so that they are released once it is proven dead (``runtime.takeover``)."""
        self._published: list[tuple[list[int], str]] = []
        self._published_lock = threading.Lock()
        self._processors: dict[tuple[sa.Column[Any], ...], list[Callable[[Any], Any] | None]] = {}
        """Per column list of ``_fetch_one``, its types' result processors."""
        self._read_options: dict[str, Any] = {"sagaloop_read": True}
        if self.dialect == "postgresql":  # one statement each: no BEGIN and ROLLBACK around it
            self._read_options["isolation_level"] = "AUTOCOMMIT"

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"

    def _fail(self, e: BaseException, what: str) -> NoReturn:
        raise translate(e, self.engine.url, what) from e

    def upgrade(self) -> tuple[int, int]:
        try:
            return migrations.upgrade(self.engine)
        except DB_ERRORS as e:
            self._fail(e, "the schema upgrade")

    def check_schema(self) -> None:
        try:
            migrations.verify(self.engine)
        except DB_ERRORS as e:
            self._fail(e, "the schema check")

    def attach(self, conn: Connection) -> SqlTx:
        """``conn``: a SQLAlchemy Connection in a transaction."""
        return SqlTx(conn, own=False)

    def hand_over_to(self, handoff: Handoff | None) -> None:
        self.handoff = handoff

    def listen_for_writes(
        self,
        woken: Callable[[], None],
        stopping: threading.Event,
        listening: threading.Event | None = None,
    ) -> None:
        """Until ``stopping`` is set, call ``woken`` each time a transaction of any process
        committed outbox rows nobody holds (PostgreSQL ``LISTEN``; see :meth:`transaction`),
        on a connection of its own, reconnecting after a failure; ``listening`` is set while it
        listens. On SQLite it only waits for ``stopping``: there, other processes' rows are
        found by the relay's sweep."""
        listening = listening or threading.Event()
        if self.dialect != "postgresql":
            stopping.wait()
            return
        import psycopg  # the driver of the postgresql+psycopg URLs sagaloop accepts

        conninfo = self.engine.url.set(drivername="postgresql").render_as_string(
            hide_password=False
        )
        backoff = 0.5
        while not stopping.is_set():
            try:
                with psycopg.connect(conninfo, autocommit=True) as conn:
                    conn.execute(f"LISTEN {OUTBOX_CHANNEL}")
                    backoff = 0.5
                    listening.set()
                    woken()  # rows written while it was not listening
                    while not stopping.is_set():
                        for _ in conn.notifies(timeout=1.0, stop_after=1):
                            woken()
            except Exception as e:  # the database is down or restarting: listen again later
                listening.clear()
                logger.debug("outbox listener: %s; listening again in %.1f s", e, backoff)
                stopping.wait(backoff)
                backoff = min(backoff * 2, 10.0)

    def nudge(self, queues: Iterable[str] | None = None) -> None:
        """Wake the consumers that wait in :meth:`wait_for_writes`: one per name in ``queues``
        (a row queued there), or, with None (rows of unnamed queues), all of them."""
        names = None if queues is None else list(queues)  # a name per row: repeats count
        with self.wakeup:
            self.writes += 1
            if names is None:
                self._any_writes += 1
            else:
                for queue in names:  # no more than MAX_WAKES: the rest are found by looking
                    self._tickets[queue] = min(self._tickets[queue] + 1, MAX_WAKES)
            for key, waiting in self._waits.items():  # one waiter per row, as it has a ticket
                if names is None:
                    waiting.notify_all()
                elif wakes := sum(1 for q in names if key is None or q in key):
                    waiting.notify(wakes)

    def wait_for_writes(self, timeout: float, queues: Sequence[str] | None = None) -> bool:
        """Wait, at most ``timeout`` seconds, until a transaction of this process committed a
        row to one of ``queues`` (None: to any) that no other waiter was woken for; return
        whether one did (else the caller polls: other processes' rows are only seen by
        looking). A row committed while its consumer was not waiting leaves a ticket that the
        next wait takes at once, so no commit is missed between a look and the wait."""
        key = None if queues is None else frozenset(queues)
        with self.wakeup:
            seen = self._any_writes
            waiting = self._waits.get(key)
            if waiting is None:
                waiting = self._waits[key] = threading.Condition(self._wake_lock)

            def woken() -> bool:
                return self._any_writes != seen or self._take_ticket(queues)

            return waiting.wait_for(woken, timeout)

    def drop_wakes(self, queues: Iterable[str]) -> None:
        """A consumer claimed a row of each of ``queues`` without a wake: the next waiting
        consumer of each is not woken for it (a ticket is dropped, if there is one)."""
        with self.wakeup:
            for queue in queues:
                if self._tickets[queue] > 0:
                    self._tickets[queue] -= 1

    def _take_ticket(self, queues: Sequence[str] | None) -> bool:
        """Under ``wakeup``: take one ticket of ``queues`` (None: of any queue), if there is."""
        for queue in self._tickets if queues is None else queues:
            if self._tickets[queue] > 0:
                self._tickets[queue] -= 1
                return True
        return False

    @contextmanager
    def transaction(self, *, lone: bool = False) -> Iterator[SqlTx]:
        """``engine.begin()``; on SQLite in memory, one at a time (with the reads) under a lock.
        After the commit, hand over the rows it enqueued and wake waiting consumers.

        ``lone`` on PostgreSQL: an autocommitting connection, on which the transaction begins
        with its first write (``conn_of``), unless that write is the checkpoint's one statement
        (``lone_statement``): then the statement is the whole transaction, 2 round trips fewer
        (a worker's reply, an engine's or an in-process step's checkpoint-only activation)."""
        lock = self._memory_lock
        if lock is not None:
            lock.acquire()
        tx: SqlTx | None = None
        try:
            lone = lone and self.dialect == "postgresql"
            with self._begin(lone) as conn:
                tx = SqlTx(conn, own=True, lone=lone)
                try:
                    yield tx
                    if tx.settles:  # no checkpoint statement carried them
                        flush_settles(tx)
                    if tx.queues and self.dialect == "postgresql":  # rows nobody holds: wake
                        conn.execute(_NOTIFY)  # the relays of other processes at the commit
                except BaseException:
                    if tx.lone == BEGUN:
                        conn.exec_driver_sql("ROLLBACK")
                    raise
                if tx.lone == BEGUN:
                    conn.exec_driver_sql("COMMIT")
            tx.published = []
            if tx.handed and self.handoff is not None:
                self.handoff.take(tx.handed)
            if tx.enqueued or tx.queues:
                self.nudge(None if tx.enqueued else tx.queues)
        except DB_ERRORS as e:
            self._fail(e, "a transaction")
        finally:
            if tx is not None and tx.published:  # not committed: still pending
                with self._published_lock:
                    self._published.extend(tx.published)
            if lock is not None:
                lock.release()

    @contextmanager
    def _begin(self, lone: bool) -> Iterator[Connection]:
        """``engine.begin()``; ``lone``: a connection that autocommits (``transaction`` sends
        ``BEGIN`` and ``COMMIT`` itself if a write began a transaction on it)."""
        if lone:
            with self.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
                yield conn
        else:
            with self.engine.begin() as conn:
                yield conn

    @contextmanager
    def _read(self) -> Iterator[Connection]:
        lock = self._memory_lock
        if lock is not None:
            lock.acquire()
        try:
            with self.engine.connect().execution_options(**self._read_options) as conn:
                yield conn
        except DB_ERRORS as e:
            self._fail(e, "a read")
        finally:
            if lock is not None:
                lock.release()

    def _fetch_one(
        self, sql: str, params: Sequence[Any], columns: tuple[sa.Column[Any], ...]
    ) -> dict[str, Any] | None:
        """The first row of ``sql``, one statement that reads committed state, on PostgreSQL
        only (``%s`` parameters), below SQLAlchemy's statement layer: psycopg's cursor on a
        pooled connection set to autocommit for it. A hot read (a step's inbox row, read before
        its body runs) costs about half the CPU it costs through ``_read``, whose connection,
        options and result objects are most of it. The row's values are read as its
        ``columns`` (in order) read them through SQLAlchemy: their types' result processors
        apply. A driver error is translated as any other. Whatever interrupts the read, its
        connection is invalidated (a fresh one is checked out next time), never returned to
        the pool in autocommit, where a transaction would commit each statement alone."""
        dbapi_error = self.engine.dialect.loaded_dbapi.Error
        try:
            pooled = self.engine.raw_connection()
        except DB_ERRORS as e:
            self._fail(e, "a read")
        except dbapi_error as e:  # a new connection refused: the driver's error, unwrapped
            self._fail(sa_exc.DBAPIError.instance(None, None, e, dbapi_error), "a read")
        conn: Any = pooled.driver_connection
        done = False
        try:
            conn.autocommit = True
            row = conn.execute(sql, params).fetchone()
            conn.autocommit = False
            done = True
        except dbapi_error as e:
            lost = bool(getattr(conn, "broken", False) or getattr(conn, "closed", False))
            error = sa_exc.DBAPIError.instance(
                sql, params, e, dbapi_error, connection_invalidated=lost
            )
            self._fail(error, "a read")
        finally:
            if not done:
                pooled.invalidate()
            pooled.close()
        if row is None:
            return None
        processors = self._processors.get(columns)
        if processors is None:
            dialect = self.engine.dialect
            processors = [c.type.result_processor(dialect, None) for c in columns]
            self._processors[columns] = processors
        values = zip(columns, processors, row, strict=True)
        return {c.name: value if read is None else read(value) for c, read, value in values}

    @contextmanager
    def _in(self, tx: Any) -> Iterator[Connection]:
        """The connection of ``tx``; when it is None (a port method's ``tx: Tx | None``), a read
        of committed state outside any transaction."""
        if tx is None:
            with self._read() as conn:
                yield conn
        else:
            yield conn_of(tx)

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


def flush_settles(tx: SqlTx) -> None:
    """Delete the rows of ``tx.settles`` now, one statement each; raise the ``lost`` of the
    first whose rows were not all still claimed with its token."""
    settles, tx.settles = tx.settles, []
    for s in settles:
        if delete_claimed(conn_of(tx), s.ids, s.claim_token) != len(s.ids):
            raise s.lost


def delete_claimed(conn: Connection, ids: Sequence[int], claim_token: str) -> int:
    return int(conn.execute(_DELETE_CLAIMED, {"ids": list(ids), "token": claim_token}).rowcount)


_DELETE_CLAIMED = t.outbox.delete().where(
    t.outbox.c.id.in_(sa.bindparam("ids", expanding=True)),
    t.outbox.c.claim_token == sa.bindparam("token"),
)
