"""Schema version 10 on PostgreSQL, on a fresh database of its own: the upgrade of
tests/unit/test_schema_v10.py, and the listing's plans use the indexes it adds."""

from __future__ import annotations

import dataclasses
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import sqlalchemy as sa

from sagaloop.engine.listing import RunOrder, run_cursor
from sagaloop.store import listing
from sagaloop.store import tables as t
from sagaloop.store.sql import SqlStore
from sagaloop.testing import services

sys.path.insert(0, str(Path(__file__).parents[1] / "unit"))

from test_schema_v10 import check_upgrade_from_v9

pytestmark = pytest.mark.integration
T0 = datetime(2030, 1, 1, tzinfo=UTC)


def test_a_v9_postgres_database_gets_the_listing_indexes(postgres_url: str) -> None:
    url, drop = services.fresh_database(postgres_url)
    try:
        check_upgrade_from_v9(url)
    finally:
        drop()


def test_postgres_plans_use_the_listing_indexes(postgres_url: str) -> None:
    url, drop = services.fresh_database(postgres_url)
    store = SqlStore(url)
    try:
        store.upgrade()
        rows = [
            {
                "run_id": f"run-{i:06}",
                "app": "a",
                "saga": "s",
                "status": "completed",
                "created_at": T0 + timedelta(seconds=i),
                "updated_at": T0 + timedelta(seconds=i),
            }
            for i in range(20_000)
        ]
        with store.engine.begin() as conn:
            conn.execute(t.runs.insert(), rows)
            conn.execute(sa.text("ANALYZE sagaloop_runs"))

        def plan(**asked: object) -> str:
            terms: dict[str, object] = {
                "dialect": "postgresql",
                "status": None,
                "saga": None,
                "app": "a",
                "limit": 51,
                "id_prefix": None,
                "input_text": None,
                "updated_since": None,
                "order": RunOrder.UPDATED_DESC,
                "after": None,
            }
            q = listing.page_query(**{**terms, **asked})  # type: ignore[arg-type]
            sql = q.compile(store.engine, compile_kwargs={"literal_binds": True})
            with store.engine.connect() as conn:
                return "\n".join(r[0] for r in conn.execute(sa.text(f"EXPLAIN {sql}")))

        assert "sagaloop_runs_updated" in plan(), plan()
        deep = store.list_runs(app="a", limit=1, after=None, order=RunOrder.UPDATED_DESC)
        after = run_cursor(dataclasses.replace(deep[0], updated_at=T0 + timedelta(seconds=99)))
        paged = plan(after=after)
        assert "Index Cond" in paged and "sagaloop_runs_updated" in paged, paged
        assert "sagaloop_runs_created" in plan(order=RunOrder.CREATED_ASC)
        found = plan(id_prefix="run-012345")  # a pasted id: PostgreSQL looks it up
        assert "sagaloop_runs_id_pattern" in found, found
    finally:
        store.close()
        drop()
