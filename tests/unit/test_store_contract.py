"""The store contract run against SQLite (a file, and in memory), plus what only SQLite shows:
``database is locked`` is a TransientStoreError. Engine options and URL masking need no server
and are checked here too."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import exc as sa_exc

from sagaloop.errors import StoreError, TransientStoreError
from sagaloop.store.connect import create_sa_engine, is_transient, mask_url, scrub
from sagaloop.store.sql import SqlStore
from sagaloop.testing.store_contract import StoreContract


class TestSqliteFileStore(StoreContract):
    @pytest.fixture
    def store(self, tmp_path: Path) -> Iterator[SqlStore]:
        store = SqlStore("sqlite:///" + str(tmp_path / "db.sqlite"))
        store.upgrade()
        yield store
        store.close()


class TestSqliteMemoryStore(StoreContract):
    @pytest.fixture
    def store(self) -> Iterator[SqlStore]:
        store = SqlStore("sqlite://")
        store.upgrade()
        yield store
        store.close()


def test_database_is_locked_is_transient(tmp_path: Path) -> None:
    path = tmp_path / "db.sqlite"
    store = SqlStore(f"sqlite:///{path}", busy_timeout=0.05)
    store.upgrade()
    other = sqlite3.connect(path, isolation_level=None)
    other.execute("BEGIN IMMEDIATE")  # another process holds the write lock
    try:
        with pytest.raises(TransientStoreError) as info, store.transaction():
            pass
        assert info.value.code == "SQLITE_BUSY"
        assert "database is locked" in str(info.value)
        assert isinstance(info.value.__cause__, sa_exc.OperationalError)
    finally:
        other.execute("ROLLBACK")
        other.close()
    with store.transaction():
        pass  # free again
    store.close()


def test_a_missing_table_is_a_store_error_not_transient(tmp_path: Path) -> None:
    store = SqlStore(f"sqlite:///{tmp_path / 'db.sqlite'}")  # not upgraded
    with pytest.raises(StoreError) as info:
        store.get_run("x")
    assert not isinstance(info.value, TransientStoreError)
    assert "no such table" in str(info.value) and info.value.code == "SQLITE_ERROR"
    store.close()


def test_postgresql_urls_use_psycopg_with_a_sized_pool() -> None:
    engine = create_sa_engine(
        "postgresql://user:s3cret@db.example:5432/app", pool_size=3, max_overflow=7
    )
    assert engine.url.drivername == "postgresql+psycopg"
    pool: object = engine.pool
    assert getattr(pool, "size")() == 3 and getattr(pool, "_max_overflow") == 7  # noqa: B009
    assert getattr(pool, "_pre_ping") is False, "idle connections only: see _ping_idle"  # noqa: B009
    assert create_sa_engine("postgres://u@h/db").url.drivername == "postgresql+psycopg"
    store = SqlStore("postgresql://user:s3cret@db.example:5432/app")
    assert "s3cret" not in repr(store) and "***" in repr(store)


def test_passwords_are_masked() -> None:
    assert mask_url("postgresql://u:s3cret@h:5432/db") == "postgresql://u:***@h:5432/db"
    text = "failed for postgresql://u:s3cret@h/db with password=s3cret and password='a b'"
    assert "s3cret" not in scrub(text) and "a b" not in scrub(text)
    assert scrub("x topsecret y", "topsecret") == "x *** y"


def test_pool_timeout_is_transient() -> None:
    assert is_transient(sa_exc.TimeoutError("QueuePool limit reached"))
    assert not is_transient(ValueError("x"))
