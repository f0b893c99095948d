"""Numbered schema migrations, applied by ``sagaloop db upgrade`` and verified at start-up.

Each migration is a function of a connection; once released, it never changes. Migration 1
creates the tables as ``tables.py`` defined them at version 1; later ones use explicit DDL.
"""

from __future__ import annotations

from collections.abc import Callable

from sqlalchemy import Connection, Engine, inspect, select, text

from sagaloop.errors import SchemaOutdatedError, SchemaTooNewError
from sagaloop.store import tables as t


def _v1(conn: Connection) -> None:
    t.metadata.create_all(conn)


MIGRATIONS: list[tuple[int, Callable[[Connection], None]]] = [(1, _v1)]
LATEST = MIGRATIONS[-1][0]


def current_version(conn: Connection) -> int:
    if not inspect(conn).has_table(t.schema_version.name):
        return 0
    return int(conn.execute(select(t.schema_version.c.version)).scalar() or 0)


# An arbitrary constant: the PostgreSQL advisory lock that serializes concurrent upgrades.
UPGRADE_LOCK_KEY = 0x5A6A_100F


def upgrade(engine: Engine) -> tuple[int, int]:
    """Apply the missing migrations in one transaction; return (from, to).

    Concurrent upgrades (several services starting at once) are serialized: by an advisory
    lock on PostgreSQL (DDL is transactional there), by the write lock on SQLite."""
    with engine.begin() as conn:
        if conn.dialect.name == "postgresql":
            conn.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": UPGRADE_LOCK_KEY})
        before = current_version(conn)
        if before > LATEST:
            raise SchemaTooNewError(before, LATEST)
        for number, migrate in MIGRATIONS:
            if number > before:
                migrate(conn)
        if before == 0:
            conn.execute(t.schema_version.insert().values(id=1, version=LATEST))
        elif before < LATEST:
            conn.execute(t.schema_version.update().values(version=LATEST))
    return before, LATEST


def verify(engine: Engine) -> None:
    with engine.connect() as conn:
        version = current_version(conn)
    if version < LATEST:
        raise SchemaOutdatedError(version, LATEST)
    if version > LATEST:
        raise SchemaTooNewError(version, LATEST)
