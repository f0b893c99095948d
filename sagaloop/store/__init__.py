"""Storage adapters: SQLAlchemy Core tables, migrations, SQLite and PostgreSQL specifics."""

from sagaloop.store.sql import SqlStore, create_sa_engine

__all__ = ["SqlStore", "create_sa_engine"]
