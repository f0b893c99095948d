"""A page of open approvals reads its page from an index, in order (row 12 of ``make bench``:
the console's poll with 10,000 approvals open). The index of schema version 11,
``(app, status, requested_at)``, cannot give the order of ``status IN ('escalated',
'pending') ORDER BY requested_at, run_id, call_id``: PostgreSQL read all 10,000 open rows and
sorted them for every page and every poll (6.5 ms, growing with the approvals open). The
query's plan is asked for its exact statement here (SQLite) and in
tests/integration/test_approvals_page_postgres.py."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from sagaloop.store import migrations
from sagaloop.store.sql import SqlStore

INDEX = "sagaloop_approvals_page"
T0 = datetime(2030, 1, 1, tzinfo=UTC)


@contextmanager
def captured(store: SqlStore) -> Iterator[list[tuple[str, Any]]]:
    """The statements (and their parameters) the store sends while inside."""
    seen: list[tuple[str, Any]] = []

    def hook(conn: Any, cursor: Any, statement: str, params: Any, *_: Any) -> None:
        seen.append((statement, params))

    sa.event.listen(store.engine, "before_cursor_execute", hook)
    try:
        yield seen
    finally:
        sa.event.remove(store.engine, "before_cursor_execute", hook)


def page_plans(store: SqlStore, explain: str) -> list[str]:
    """The plans of the statement of a first page and of a page after a cursor."""
    plans = []
    for after in (None, (T0, "run-1", "call-1")):
        with captured(store) as seen:
            store.open_approvals(app="a", after=after, limit=50)
        [(statement, params)] = [s for s in seen if "sagaloop_approvals" in s[0]]
        with store.engine.connect() as conn:
            if store.dialect == "postgresql":  # whatever the table's size: a sort shows
                conn.execute(sa.text("SET enable_sort = off"))
            rows = conn.exec_driver_sql(explain + statement, params).all()
            plans.append("\n".join(str(r[-1]) for r in rows))
    return plans


def test_sqlite_reads_a_page_of_approvals_in_index_order(tmp_path: Path) -> None:
    store = SqlStore("sqlite:///" + str(tmp_path / "plan.db"))
    store.upgrade()
    try:
        for plan in page_plans(store, "EXPLAIN QUERY PLAN "):
            assert INDEX in plan and "TEMP B-TREE" not in plan, plan
    finally:
        store.close()


def check_upgrade_from_v11(url: str) -> None:
    """A version-11 database (the old index, not the new one) gets the new index in place
    of the old one."""
    store = SqlStore(url)
    try:
        store.upgrade()
        with store.engine.begin() as conn:
            conn.execute(sa.text(f"DROP INDEX {INDEX}"))
            conn.execute(
                sa.text(
                    "CREATE INDEX sagaloop_approvals_open "
                    "ON sagaloop_approvals (app, status, requested_at)"
                )
            )
            conn.execute(sa.text("UPDATE sagaloop_schema SET version = 11"))
        assert store.upgrade() == (11, migrations.LATEST)
        names = {i["name"] for i in sa.inspect(store.engine).get_indexes("sagaloop_approvals")}
        assert INDEX in names and "sagaloop_approvals_open" not in names, names
        assert store.upgrade() == (migrations.LATEST, migrations.LATEST)
    finally:
        store.close()


def test_a_v11_sqlite_database_gets_the_page_index(tmp_path: Path) -> None:
    check_upgrade_from_v11("sqlite:///" + str(tmp_path / "v11.db"))


def test_the_index_predicate_names_the_open_statuses() -> None:
    from sagaloop.sagas.approvals import OPEN_STATUSES
    from sagaloop.store.tables import APPROVALS_OPEN

    listed = ", ".join(f"'{s}'" for s in sorted(OPEN_STATUSES))
    assert f"status IN ({listed})" == APPROVALS_OPEN
