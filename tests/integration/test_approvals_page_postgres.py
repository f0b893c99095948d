"""A page of open approvals on PostgreSQL reads its rows in index order, on a fresh database
of its own (tests/unit/test_approvals_page_plan.py says why), and a version-11 database gets
the index."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from sagaloop.store.sql import SqlStore
from sagaloop.testing import services

sys.path.insert(0, str(Path(__file__).parents[1] / "unit"))

from test_approvals_page_plan import INDEX, check_upgrade_from_v11, page_plans

pytestmark = pytest.mark.integration


def test_postgres_reads_a_page_of_approvals_in_index_order(postgres_url: str) -> None:
    url, drop = services.fresh_database(postgres_url)
    store = SqlStore(url)
    try:
        store.upgrade()
        for plan in page_plans(store, "EXPLAIN "):
            assert INDEX in plan and "Sort" not in plan, plan
    finally:
        store.close()
        drop()


def test_a_v11_postgres_database_gets_the_page_index(postgres_url: str) -> None:
    url, drop = services.fresh_database(postgres_url)
    try:
        check_upgrade_from_v11(url)
    finally:
        drop()
