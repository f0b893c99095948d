"""Schema version 2 (issue 10): an existing version-1 database upgrades in place, its timers
take the app of their run; the signing key is created once, whoever asks first."""

from __future__ import annotations

import threading
from datetime import UTC, datetime
from pathlib import Path

import sqlalchemy as sa

from sagaloop.engine.ports import RunRecord, Timer
from sagaloop.store import migrations
from sagaloop.store.sql import SqlStore

T0 = datetime(2030, 1, 2, tzinfo=UTC)
V2_TABLES = ("sagaloop_payloads", "sagaloop_secrets", "sagaloop_processes")


def make_v1(store: SqlStore) -> None:
    """Turn a fresh latest-schema database into what version 1 created: timers without an app
    (indexed by due time alone), none of the tables version 2 added, version 1 stamped."""
    with store.engine.begin() as conn:
        for name in V2_TABLES:
            conn.execute(sa.text(f"DROP TABLE {name}"))
        conn.execute(sa.text("DROP INDEX sagaloop_timers_due"))
        conn.execute(sa.text("ALTER TABLE sagaloop_timers DROP COLUMN app"))
        conn.execute(sa.text("CREATE INDEX sagaloop_timers_due ON sagaloop_timers (fire_at)"))
        for index in ("sagaloop_runs_app",):  # version 5's
            conn.execute(sa.text(f"DROP INDEX {index}"))
        conn.execute(sa.text("UPDATE sagaloop_schema SET version = 1"))


def check_upgrade_from_v1(url: str) -> None:
    store = SqlStore(url)
    try:
        assert store.upgrade() == (0, migrations.LATEST)
        make_v1(store)
        run = RunRecord("r-1", "billing", "pay", "running", None, T0, T0)
        with store.transaction() as tx:
            assert store.create_run(tx, run)
            tx.conn.execute(
                sa.text(
                    "INSERT INTO sagaloop_timers (run_id, pos, kind, fire_at, attempt) "
                    "VALUES ('r-1', 3, 'sleep', :at, 0), ('gone', 1, 'sleep', :at, 0)"
                ),
                {"at": T0},
            )
        assert store.upgrade() == (1, migrations.LATEST)
        store.check_schema()
        assert set(V2_TABLES) <= set(sa.inspect(store.engine).get_table_names())
        with store.transaction() as tx:
            due = store.take_due_timers(tx, T0, 10, app="billing")
        assert due == [Timer("r-1", 3, "sleep", T0, 0, "billing")], "app backfilled from its run"
        with store.transaction() as tx:
            orphans = store.take_due_timers(tx, T0, 10, app="")
        assert [t.run_id for t in orphans] == ["gone"], "a timer without a run keeps app ''"
    finally:
        store.close()


def check_signing_key_is_created_once(url: str) -> None:
    stores = [SqlStore(url) for _ in range(4)]
    try:
        stores[0].upgrade()
        keys: list[bytes] = []
        barrier = threading.Barrier(len(stores))

        def ask(store: SqlStore) -> None:
            barrier.wait(10)
            keys.append(store.signing_key())

        threads = [threading.Thread(target=ask, args=(s,)) for s in stores]
        for th in threads:
            th.start()
        for th in threads:
            th.join(30)
        assert len(keys) == len(stores) and len(set(keys)) == 1, "one key for every process"
        assert len(keys[0]) == 32
        assert stores[1].signing_key() == keys[0], "and the same later"
    finally:
        for s in stores:
            s.close()


def test_a_v1_sqlite_database_upgrades_and_its_timers_get_their_app(tmp_path: Path) -> None:
    check_upgrade_from_v1("sqlite:///" + str(tmp_path / "v1.db"))


def test_the_signing_key_is_created_once_on_sqlite(tmp_path: Path) -> None:
    check_signing_key_is_created_once("sqlite:///" + str(tmp_path / "keys.db"))
