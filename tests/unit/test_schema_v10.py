"""Schema version 10 (issue 26): a version-9 database gets the runs listing's indexes in
place, and the listing's queries use them (SQLite's plan here; PostgreSQL's in
tests/integration/test_schema_v10_postgres.py)."""

from __future__ import annotations

from pathlib import Path

import sqlalchemy as sa

from sagaloop.store import migrations
from sagaloop.store.sql import SqlStore

V10 = {"sagaloop_runs_updated", "sagaloop_runs_created"}
PG_ONLY = "sagaloop_runs_id_pattern"


def indexes(store: SqlStore) -> set[str]:
    return {str(i["name"]) for i in sa.inspect(store.engine).get_indexes("sagaloop_runs")}


def check_upgrade_from_v9(url: str) -> None:
    store = SqlStore(url)
    try:
        store.upgrade()
        expected = V10 | ({PG_ONLY} if store.dialect == "postgresql" else set())
        assert expected <= indexes(store)
        with store.engine.begin() as conn:
            for name in expected:
                conn.execute(sa.text(f"DROP INDEX {name}"))
            conn.execute(sa.text("UPDATE sagaloop_schema SET version = 9"))
        assert not expected & indexes(store)
        assert store.upgrade() == (9, migrations.LATEST)
        assert expected <= indexes(store), "version 10 adds the listing's indexes"
        assert store.upgrade() == (migrations.LATEST, migrations.LATEST)
    finally:
        store.close()


def test_a_v9_sqlite_database_gets_the_listing_indexes(tmp_path: Path) -> None:
    check_upgrade_from_v9("sqlite:///" + str(tmp_path / "v9.db"))


def test_sqlite_pages_and_id_prefixes_use_an_index(tmp_path: Path) -> None:
    store = SqlStore("sqlite:///" + str(tmp_path / "plan.db"))
    store.upgrade()
    try:
        with store.engine.connect() as conn:

            def plan(sql: str) -> str:
                return " ".join(
                    str(r[-1]) for r in conn.execute(sa.text("EXPLAIN QUERY PLAN " + sql))
                )

            page = plan(
                "SELECT * FROM sagaloop_runs WHERE (updated_at, run_id) < ('2030', 'x') "
                "ORDER BY updated_at DESC, run_id DESC LIMIT 51"
            )
            assert "sagaloop_runs_updated" in page and "TEMP B-TREE" not in page, page
            prefix = plan("SELECT * FROM sagaloop_runs WHERE run_id >= 'ab' AND run_id < 'ac'")
            assert "sqlite_autoindex_sagaloop_runs_1" in prefix, prefix
    finally:
        store.close()
