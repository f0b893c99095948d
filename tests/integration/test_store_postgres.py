"""The store contract on PostgreSQL, plus what only PostgreSQL shows: row locks that block
(``lock_run``), claims that skip locked rows instead of waiting, driver errors classified by
SQLSTATE, and the schema upgrade."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import sqlalchemy as sa

from sagaloop.engine.history import NewEvent
from sagaloop.engine.ports import Checkpoint, RunRecord, Timer, Written
from sagaloop.errors import SchemaOutdatedError, StoreError, TransientStoreError
from sagaloop.store import migrations
from sagaloop.store import tables as t
from sagaloop.store.processes import Identity
from sagaloop.store.sql import SqlStore
from sagaloop.testing import services
from sagaloop.testing.store_contract import StoreContract

pytestmark = pytest.mark.integration

T0 = datetime(2030, 1, 2, tzinfo=UTC)
LEASE = timedelta(seconds=30)
TABLES = ", ".join(tb.name for tb in t.metadata.sorted_tables if tb.name != t.schema_version.name)


@pytest.fixture
def store(database: str) -> Iterator[SqlStore]:
    """A fresh (empty) store: the tables are truncated before each test."""
    store = SqlStore(database, pool_size=10, max_overflow=10)
    with store.transaction() as tx:
        tx.conn.exec_driver_sql(f"TRUNCATE {TABLES} RESTART IDENTITY")
    yield store
    store.close()


class TestPostgresStore(StoreContract):
    pass


# --- helpers -----------------------------------------------------------------------------------


def _new_run(store: SqlStore, run_id: str) -> None:
    with store.transaction() as tx:
        assert store.create_run(tx, RunRecord(run_id, "app", "pg", "running", None, T0, T0))


def _assert_eventually(check: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


def _waiting_on_a_lock(store: SqlStore) -> int:
    """How many other sessions of this database wait for a lock right now."""
    with store.engine.connect() as conn:
        return int(
            conn.execute(
                sa.text(
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                    "AND wait_event_type = 'Lock' AND pid <> pg_backend_pid()"
                )
            ).scalar_one()
        )


# --- locks -------------------------------------------------------------------------------------


def test_lock_run_blocks_a_second_transaction_on_the_row_lock(store: SqlStore) -> None:
    _new_run(store, "r")
    got: list[RunRecord | None] = []
    with store.transaction() as tx:
        assert store.lock_run(tx, "r") is not None

        def second() -> None:
            with store.transaction() as tx2:
                got.append(store.lock_run(tx2, "r"))

        thread = threading.Thread(target=second)
        thread.start()
        _assert_eventually(lambda: _waiting_on_a_lock(store) == 1)
        assert got == [], "the second lock_run returned while the first transaction held it"
    thread.join(5)
    assert not thread.is_alive() and len(got) == 1 and got[0] is not None


def test_lock_run_on_another_run_does_not_wait(store: SqlStore) -> None:
    _new_run(store, "a")
    _new_run(store, "b")
    with store.transaction() as tx:
        assert store.lock_run(tx, "a") is not None
        started = time.monotonic()
        with store.transaction() as tx2:
            assert store.lock_run(tx2, "b") is not None
        assert time.monotonic() - started < 1.0


def _hold_rows(store: SqlStore, table: sa.Table, where: sa.ColumnElement[bool]) -> sa.Connection:
    conn = store.engine.connect()
    conn.execute(sa.select(table).where(where).with_for_update())
    return conn


def _in_thread(fn: Callable[[], object], timeout: float = 3.0) -> tuple[bool, object]:
    """Run ``fn`` in a thread; (finished within timeout, result)."""
    out: list[object] = []
    thread = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    thread.start()
    thread.join(timeout)
    return (not thread.is_alive(), out[0] if out else None)


def test_claim_skips_rows_another_transaction_holds(store: SqlStore) -> None:
    store.enqueue_raw([("q", b"%d" % i) for i in range(4)], T0)
    ids = sorted(_outbox_ids(store))
    holder = _hold_rows(store, t.outbox, t.outbox.c.id.in_(ids[:2]))
    try:
        done, claimed = _in_thread(lambda: store.claim(["q"], 10, T0, LEASE))
        assert done, "claim waited for rows another transaction locked (no SKIP LOCKED)"
        assert isinstance(claimed, list)
        assert [m.id for m in claimed] == ids[2:]
    finally:
        holder.close()
    assert [m.id for m in store.claim(["q"], 10, T0, LEASE)] == ids[:2]


def test_a_claim_is_one_statement_its_own_commit(store: SqlStore) -> None:
    """Rows locked and skipped, claimed and counted in one ``UPDATE ... RETURNING`` on an
    autocommitting connection (a database queue's receive, a relay's sweep): 1 round trip,
    not ``BEGIN``, a locking ``SELECT``, an ``UPDATE`` and ``COMMIT``. In id order, whatever
    order ``RETURNING`` gives; a due row that is claimed already is not claimed again."""
    store.enqueue_raw([("q", b"%d" % i) for i in range(5)], T0)
    ids = sorted(_outbox_ids(store))
    sent: list[str] = []

    def begin(conn: sa.Connection) -> None:  # psycopg sends BEGIN unless it autocommits
        if conn.get_execution_options().get("isolation_level") != "AUTOCOMMIT":
            sent.append("BEGIN")

    sa.event.listen(store.engine, "before_cursor_execute", lambda *a: sent.append(a[2].split()[0]))
    sa.event.listen(store.engine, "begin", begin)
    claimed = store.claim(["q"], 3, T0, LEASE, probe=True)
    assert sent == ["UPDATE"], sent
    assert [m.id for m in claimed] == ids[:3] and {m.deliveries for m in claimed} == {1}
    assert len({m.claim_token for m in claimed}) == 1
    again = store.claim(["q"], 10, T0, LEASE)
    assert [m.id for m in again] == ids[3:], "the claimed rows are held"
    assert store.claim(["q"], 10, T0 + LEASE + timedelta(seconds=1), LEASE)[0].deliveries == 2


def test_a_steps_inbox_read_is_below_sqlalchemys_statement_layer(store: SqlStore) -> None:
    """The read before a step runs (``inbox_get`` outside a transaction) is psycopg's cursor on
    a pooled connection, in autocommit: no SQLAlchemy statement, no ``BEGIN``. Its values are
    as stored; a large one is resolved from the payload table, an escaped one unwrapped."""
    stored = {"m-1": {"ok": [1, "é"]}, "m-2": None, "m-3": "x" * 100_000, "m-4": {"$sagaloop": 1}}
    with store.transaction() as tx:
        for key, value in stored.items():
            store.inbox_put(tx, "worker", key, value, T0)
    sent: list[str] = []
    sa.event.listen(store.engine, "before_cursor_execute", lambda *a: sent.append(a[2]))
    sa.event.listen(store.engine, "begin", lambda *a: sent.append("BEGIN"))
    assert store.inbox_get(None, "worker", "m-1") == (True, {"ok": [1, "é"]})
    assert store.inbox_get(None, "worker", "m-2") == (True, None)
    assert store.inbox_get(None, "worker", "m-0") == (False, None)
    assert sent == [], sent
    assert store.inbox_get(None, "worker", "m-3") == (True, "x" * 100_000)
    assert store.inbox_get(None, "worker", "m-4") == (True, {"$sagaloop": 1})
    with store.transaction() as tx:  # the pooled connections left autocommit
        store.inbox_put(tx, "worker", "m-5", 5, T0)
        assert store.inbox_get(tx, "worker", "m-5") == (True, 5)
        tx.conn.exec_driver_sql("ROLLBACK")
    assert store.inbox_get(None, "worker", "m-5") == (False, None), "it was one transaction"


def test_a_read_interrupted_returns_no_connection_to_the_pool_in_autocommit(
    store: SqlStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The read sets its pooled connection to autocommit; whatever interrupts it (not only a
    driver error), that connection must not go back to the pool so: a transaction given it
    later would commit each statement by itself."""
    import psycopg

    execute = psycopg.Connection.execute

    def interrupted(self: psycopg.Connection[Any], *args: Any, **kwargs: Any) -> Any:
        if self.autocommit:
            raise KeyboardInterrupt
        return execute(self, *args, **kwargs)

    monkeypatch.setattr(psycopg.Connection, "execute", interrupted)
    with pytest.raises(KeyboardInterrupt):
        store.inbox_get(None, "worker", "m-1")
    monkeypatch.undo()
    pool = store.engine.pool
    held = [store.engine.raw_connection() for _ in range(pool.checkedin())]
    try:
        assert [c.driver_connection.autocommit for c in held] == [False] * len(held)
    finally:
        for c in held:
            c.close()
    assert store.inbox_get(None, "worker", "m-1") == (False, None)


def test_a_runs_read_is_below_sqlalchemys_statement_layer_as_its_columns_read_it(
    store: SqlStore,
) -> None:
    """``get_run`` outside a transaction (a start's read) on PostgreSQL is psycopg's cursor
    too; its record is the one the table's column types give (``lock_run``'s, through
    SQLAlchemy): JSON decoded, times in UTC, a large input from the payload table."""
    later = T0 + timedelta(seconds=1)
    runs = [
        RunRecord(
            "r-1", "app", "pg", "failed", {"a": [1, "é"]}, T0, later, 3, 3, [1], {"m": 1}, "y"
        ),
        RunRecord("r-2", "app", "pg", "running", None, T0, T0),
        RunRecord("r-3", "app", "pg", "running", "x" * 100_000, T0, T0, output={"$sagaloop": 1}),
    ]
    with store.transaction() as tx:
        for run in runs:
            assert store.create_run(tx, run)
    sent: list[str] = []
    sa.event.listen(store.engine, "before_cursor_execute", lambda *a: sent.append(a[2]))
    assert store.get_run("r-1") == runs[0] and store.get_run("r-2") == runs[1]
    assert store.get_run("r-0") is None
    assert sent == [], sent
    for run in runs:
        assert store.get_run(run.run_id) == run
        with store.transaction() as tx:
            assert store.lock_run(tx, run.run_id) == run


def test_an_inbox_read_the_server_cuts_off_is_transient_its_connection_replaced(
    store: SqlStore,
) -> None:
    with store.transaction() as tx:
        store.inbox_put(tx, "worker", "m-1", 7, T0)
    outcome: list[object] = []
    admin_options = {"isolation_level": "AUTOCOMMIT"}  # pg_stat_activity read afresh each time
    with store.engine.connect() as locker, store.engine.connect() as admin:
        admin = admin.execution_options(**admin_options)
        locker.exec_driver_sql("LOCK TABLE sagaloop_inbox IN ACCESS EXCLUSIVE MODE")

        def read() -> None:
            try:
                outcome.append(store.inbox_get(None, "worker", "m-1"))
            except Exception as e:
                outcome.append(e)

        reader = threading.Thread(target=read)
        reader.start()
        waiting = sa.text(
            "SELECT pid FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
            " AND query LIKE 'SELECT result FROM sagaloop_inbox%'"
        )
        pids: list[int] = []
        _assert_eventually(lambda: bool(pids.extend(admin.execute(waiting).scalars()) or pids), 60)
        admin.execute(sa.text("SELECT pg_terminate_backend(:pid)"), {"pid": pids[0]})
        reader.join(60)
        locker.rollback()
    assert len(outcome) == 1 and isinstance(outcome[0], TransientStoreError), outcome
    assert "a read failed" in str(outcome[0])
    assert store.inbox_get(None, "worker", "m-1") == (True, 7), "a fresh connection"
    assert store.engine.pool.checkedout() == 0


def _outbox_ids(store: SqlStore) -> list[int]:
    with store.engine.connect() as conn:
        return [int(i) for i in conn.execute(sa.select(t.outbox.c.id)).scalars()]


def test_take_due_timers_skips_timers_another_transaction_holds(store: SqlStore) -> None:
    _new_run(store, "r")
    with store.transaction() as tx:
        for pos in range(4):
            store.add_timer(tx, Timer("r", pos, "sleep", T0 - timedelta(seconds=10 - pos)))
    holder = _hold_rows(store, t.timers, t.timers.c.pos < 2)
    try:

        def take() -> list[int]:
            with store.transaction() as tx:
                return [x.pos for x in store.take_due_timers(tx, T0, 10)]

        done, taken = _in_thread(take)
        assert done, "take_due_timers waited for timers another transaction locked"
        assert taken == [2, 3]
    finally:
        holder.close()


def test_timestamps_are_utc_whatever_the_session_time_zone(database: str) -> None:
    url = sa.make_url(database).update_query_dict({"options": "-c timezone=Asia/Kathmandu"})
    store = SqlStore(url.render_as_string(hide_password=False))
    try:
        with store.engine.connect() as conn:
            assert conn.exec_driver_sql("SHOW timezone").scalar() == "Asia/Kathmandu"
        at = datetime(2031, 3, 4, 5, 6, 7, 890123, tzinfo=UTC)
        with store.transaction() as tx:
            store.create_run(tx, RunRecord("tz", "app", "pg", "running", None, at, at))
            store.append_events(tx, "tz", 0, [NewEvent("x")], at)
        got = store.get_run("tz")
        assert got is not None and got.created_at == at and got.created_at.tzinfo is UTC
        (event,) = store.load_history(None, "tz")
        assert event.at == at and event.at.tzinfo is UTC
        later = at + timedelta(hours=1)  # and through the one statement of write_checkpoint
        saved = RunRecord("tz2", "app", "pg", "running", None, at, later, last_seq=1)
        cp = Checkpoint(later, ("engine", "tz-1", None), saved, 0, [NewEvent("y")], later)
        with store.transaction() as tx:
            store.create_run(tx, RunRecord("tz2", "app", "pg", "running", None, at, at))
            assert store.write_checkpoint(tx, cp) is Written.WRITTEN
        got = store.get_run("tz2")
        assert got is not None and got.updated_at == later and got.updated_at.tzinfo is UTC
        (event,) = store.load_history(None, "tz2")
        assert event.at == later and event.at.tzinfo is UTC
    finally:
        with store.transaction() as tx:
            tx.conn.exec_driver_sql(f"TRUNCATE {TABLES}")
        store.close()


# --- errors ------------------------------------------------------------------------------------


def _raise(store: SqlStore, sqlstate: str) -> None:
    with store.transaction() as tx:
        tx.conn.exec_driver_sql(
            f"DO $$ BEGIN RAISE EXCEPTION 'injected' USING ERRCODE = '{sqlstate}'; END $$"
        )


@pytest.mark.parametrize(
    "sqlstate", ["40001", "40P01", "55P03", "57P01", "57P02", "57P03", "53300", "08006"]
)
def test_retryable_sqlstates_are_transient(store: SqlStore, sqlstate: str) -> None:
    with pytest.raises(TransientStoreError) as info:
        _raise(store, sqlstate)
    assert info.value.code == sqlstate and "injected" in str(info.value)
    assert isinstance(info.value.__cause__, sa.exc.DBAPIError)


@pytest.mark.parametrize("sqlstate", ["23505", "42P01", "22P02", "P0001", "53100"])
def test_other_sqlstates_are_store_errors(store: SqlStore, sqlstate: str) -> None:
    with pytest.raises(StoreError) as info:
        _raise(store, sqlstate)
    assert not isinstance(info.value, TransientStoreError)
    assert info.value.code == sqlstate


def test_a_lock_timeout_is_transient(store: SqlStore) -> None:
    _new_run(store, "r")
    with store.transaction() as tx:
        store.lock_run(tx, "r")
        with pytest.raises(TransientStoreError) as info, store.transaction() as tx2:
            tx2.conn.exec_driver_sql("SET LOCAL lock_timeout = '100ms'")
            store.lock_run(tx2, "r")
    assert info.value.code == "55P03"


def test_a_real_deadlock_is_transient(store: SqlStore) -> None:
    _new_run(store, "a")
    _new_run(store, "b")
    barrier = threading.Barrier(2)
    errors: list[BaseException] = []

    def cross(first: str, second: str) -> None:
        try:
            with store.transaction() as tx:
                tx.conn.exec_driver_sql("SET LOCAL deadlock_timeout = '50ms'")
                store.lock_run(tx, first)
                barrier.wait(5)
                store.lock_run(tx, second)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=cross, args=p) for p in (("a", "b"), ("b", "a"))]
    for th in threads:
        th.start()
    for th in threads:
        th.join(10)
    assert len(errors) == 1, f"expected one deadlock victim, got {errors!r}"
    assert isinstance(errors[0], TransientStoreError) and errors[0].code == "40P01"


def _kill_pooled_connections(store: SqlStore) -> int:
    """Terminate the server side of every connection to the store's database (its pool's)."""
    admin = sa.create_engine(store.engine.url, poolclass=sa.pool.NullPool)
    with admin.connect() as conn:
        killed = conn.exec_driver_sql(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
            " WHERE datname = current_database() AND pid <> pg_backend_pid()"
        ).scalar()
    admin.dispose()
    time.sleep(0.1)  # the backends exit
    return int(killed or 0)


def test_a_connection_the_server_closed_is_replaced_without_a_ping(
    store: SqlStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Right after use (no ping due): its socket is readable, so it is replaced unseen."""
    from sagaloop.store import connect

    monkeypatch.setattr(connect, "IDLE_BEFORE_PING", 60.0)
    pings = _count_pings(store, monkeypatch)
    store.get_run("warm-up")
    assert _kill_pooled_connections(store) >= 1
    assert store.get_run("x") is None, "a dead connection is replaced, not an error"
    with store.transaction() as tx:
        assert store.lock_run(tx, "x") is None
    assert pings == [], "no round trip spent on checking"


def test_only_a_connection_idle_for_a_while_is_pinged(
    store: SqlStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    from sagaloop.store import connect

    monkeypatch.setattr(connect, "IDLE_BEFORE_PING", 0.2)
    pings = _count_pings(store, monkeypatch)
    store.get_run("warm-up")
    for _ in range(5):
        store.get_run("x")  # back to back: no ping
    assert pings == []
    time.sleep(0.3)
    store.get_run("x")
    assert len(pings) == 1, "idle past IDLE_BEFORE_PING: pinged once"


def _count_pings(store: SqlStore, monkeypatch: pytest.MonkeyPatch) -> list[object]:
    pings: list[object] = []
    ping = store.engine.dialect.do_ping

    def counting(dbapi_conn: object) -> bool:
        pings.append(dbapi_conn)
        return ping(dbapi_conn)

    monkeypatch.setattr(store.engine.dialect, "do_ping", counting)
    return pings


def test_connection_refused_is_transient_and_hides_the_password() -> None:
    from private_postgres import free_port

    url = f"postgresql://sagaloop:s3cr3t-pw@127.0.0.1:{free_port()}/nowhere"
    store = SqlStore(url, connect_timeout=2)
    try:
        for attempt in (lambda: store.get_run("x"), lambda: _new_run(store, "x")):
            with pytest.raises(TransientStoreError) as info:
                attempt()
            assert "s3cr3t-pw" not in str(info.value) and "***" in str(info.value)
            assert "s3cr3t-pw" not in str(info.value.__cause__)
        assert "s3cr3t-pw" not in repr(store)
    finally:
        store.close()


# --- schema ------------------------------------------------------------------------------------


def test_upgrade_on_postgres_and_concurrent_upgrades(postgres_url: str) -> None:
    url, drop = services.fresh_database(postgres_url)
    stores = [SqlStore(url) for _ in range(4)]
    try:
        with pytest.raises(SchemaOutdatedError, match="sagaloop db upgrade"):
            stores[0].check_schema()
        results: list[tuple[int, int]] = []
        errors: list[BaseException] = []

        def up(s: SqlStore) -> None:
            try:
                results.append(s.upgrade())
            except BaseException as e:
                errors.append(e)

        threads = [threading.Thread(target=up, args=(s,)) for s in stores]
        for th in threads:
            th.start()
        for th in threads:
            th.join(30)
        assert errors == [], "concurrent upgrades must serialize, not fail"
        assert (
            sorted(results)
            == [(0, migrations.LATEST)] + [(migrations.LATEST, migrations.LATEST)] * 3
        )
        stores[0].check_schema()
    finally:
        for s in stores:
            s.close()
        drop()


def test_the_db_upgrade_command_on_postgres(postgres_url: str) -> None:
    url, drop = services.fresh_database(postgres_url)
    try:
        command = [sys.executable, "-m", "sagaloop", "--database-url", url, "db", "upgrade"]
        first = subprocess.run(command, capture_output=True, text=True, timeout=60)
        assert first.returncode == 0, first.stderr
        assert f"from version 0 to {migrations.LATEST}" in first.stdout
        again = subprocess.run(command, capture_output=True, text=True, timeout=60)
        assert again.returncode == 0 and "up to date" in again.stdout, again.stderr
        store = SqlStore(url)
        store.check_schema()
        with store.transaction() as tx:
            assert store.create_run(tx, RunRecord("r", "app", "s", "running", None, T0, T0))
            store.append_events(tx, "r", 0, [NewEvent("run_started")], T0)
        assert [e.seq for e in store.load_history(None, "r")] == [1]
        store.close()
    finally:
        drop()


def test_rows_a_takeover_releases_are_announced_to_the_listening_relays(store: SqlStore) -> None:
    """A takeover releases the rows a dead process claimed: rows nobody holds, as a client's
    start is. The engines' relays hear of them (``NOTIFY``) and sweep at once, not at their
    next quiet sweep (once a second on PostgreSQL)."""
    store.enqueue_raw([("q", b"{}")], T0)
    store.process_started("w@h:dead", "shop", "worker", T0, Identity(["q"], [], "d", {}))
    store.claim_owner = "d"
    [row] = store.claim(["q"], 1, T0, LEASE)
    heard = threading.Event()
    stopping = threading.Event()
    listening = threading.Event()
    listener = threading.Thread(
        target=store.listen_for_writes, args=(heard.set, stopping, listening), daemon=True
    )
    listener.start()
    try:
        assert listening.wait(60) and heard.wait(60)  # its first wake: rows written before
        heard.clear()
        assert [r.id for r in store.take_over("w@h:dead", "d")] == [row.id]
        assert heard.wait(60), "the released row was not announced"
    finally:
        stopping.set()
        listener.join(10)


def test_a_checkpoint_is_below_sqlalchemys_statement_layer_unless_something_listens(
    store: SqlStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The checkpoint's one statement runs on its transaction's own psycopg connection: no
    SQLAlchemy statement. With a listener on SQLAlchemy's events (a test counting statements,
    OpenTelemetry's instrumentation) it goes through SQLAlchemy, which they see. Both write
    the same thing."""
    through: list[str] = []
    exec_driver_sql = sa.engine.Connection.exec_driver_sql

    def seen(self: sa.engine.Connection, sql: str, *args: Any, **kwargs: Any) -> Any:
        through.append(sql.split(None, 1)[0])
        return exec_driver_sql(self, sql, *args, **kwargs)

    monkeypatch.setattr(sa.engine.Connection, "exec_driver_sql", seen)

    def write(run_id: str) -> Written:
        saved = RunRecord(run_id, "app", "pg", "running", None, T0, T0, last_seq=1)
        cp = Checkpoint(T0, ("engine", f"{run_id}-1", {"n": 1}), saved, 0, [NewEvent("y")], T0)
        with store.transaction() as tx:
            store.create_run(tx, RunRecord(run_id, "app", "pg", "running", None, T0, T0))
            return store.write_checkpoint(tx, cp)

    assert write("below") is Written.WRITTEN
    assert "WITH" not in through, through
    sent: list[str] = []
    sa.event.listen(store.engine, "before_cursor_execute", lambda *a: sent.append(a[2]))
    assert write("through") is Written.WRITTEN
    assert "WITH" in through and any(s.startswith("WITH") for s in sent), (through, sent)
    for run_id in ("below", "through"):
        run = store.get_run(run_id)
        assert run is not None and run.last_seq == 1
        assert [e.kind for e in store.load_history(None, run_id)] == ["y"]
        assert store.inbox_get(None, "engine", f"{run_id}-1") == (True, {"n": 1})


def test_a_checkpoint_the_server_cuts_off_is_transient_its_connection_replaced(
    store: SqlStore,
) -> None:
    """Below SQLAlchemy, a checkpoint whose connection is lost fails as through it: a
    ``TransientStoreError`` (the caller retries), nothing written, the connection invalidated
    and the next transaction on a fresh one."""
    saved = RunRecord("cut", "app", "pg", "running", None, T0, T0, last_seq=1)
    cp = Checkpoint(T0, ("engine", "cut-1", None), saved, 0, [NewEvent("y")], T0)
    _new_run(store, "cut")
    with store.engine.connect() as admin:
        admin = admin.execution_options(isolation_level="AUTOCOMMIT")
        with pytest.raises(TransientStoreError), store.transaction() as tx:
            pid = tx.conn.exec_driver_sql("SELECT pg_backend_pid()").scalar()
            admin.execute(sa.text("SELECT pg_terminate_backend(:pid)"), {"pid": pid})
            store.write_checkpoint(tx, cp)
    assert store.inbox_get(None, "engine", "cut-1") == (False, None)
    with store.transaction() as tx:
        assert store.write_checkpoint(tx, cp) is Written.WRITTEN
    assert store.engine.pool.checkedout() == 0
