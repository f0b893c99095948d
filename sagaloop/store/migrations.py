"""Numbered schema migrations, applied by ``sagaloop db upgrade`` and verified at start-up.

Each migration is a function of a connection that takes a database from the version before it
to its own; once released, it never changes, and it uses explicit DDL (never ``tables.py``,
which describes the latest schema). An empty database gets the latest schema at once from
``tables.py`` and is stamped with the latest version.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    Boolean,
    Column,
    Connection,
    Double,
    Engine,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Table,
    Text,
    inspect,
    select,
    text,
)

from sagaloop.errors import SchemaOutdatedError, SchemaTooNewError
from sagaloop.store import payloads
from sagaloop.store import tables as t


def _v1(conn: Connection) -> None:
    raise AssertionError("version 1 is only ever created whole, from an empty database")


def _v2(conn: Connection) -> None:
    """Timers belong to an app; payloads, secrets and processes tables."""
    conn.execute(
        text("ALTER TABLE sagaloop_timers ADD COLUMN app VARCHAR(200) NOT NULL DEFAULT ''")
    )
    conn.execute(
        text(
            "UPDATE sagaloop_timers SET app = COALESCE((SELECT r.app FROM sagaloop_runs r "
            "WHERE r.run_id = sagaloop_timers.run_id), '')"
        )
    )
    conn.execute(text("DROP INDEX sagaloop_timers_due"))
    conn.execute(text("CREATE INDEX sagaloop_timers_due ON sagaloop_timers (app, fire_at)"))
    _V2_TABLES.create_all(conn)


_V2_TABLES = MetaData()  # the tables version 2 added, frozen as it added them
Table(
    "sagaloop_payloads",
    _V2_TABLES,
    Column("run_id", String(200), primary_key=True),
    Column("hash", String(64), primary_key=True),
    Column("data", LargeBinary, nullable=False),
    Column("size", t.BigId, nullable=False),
    Column("created_at", t.UTCDateTime, nullable=False),
)
Table(
    "sagaloop_secrets",
    _V2_TABLES,
    Column("name", String(100), primary_key=True),
    Column("value", LargeBinary, nullable=False),
    Column("created_at", t.UTCDateTime, nullable=False),
)
Table(
    "sagaloop_processes",
    _V2_TABLES,
    Column("name", String(200), primary_key=True),
    Column("app", String(200), nullable=False),
    Column("role", String(32), nullable=False),
    Column("started_at", t.UTCDateTime, nullable=False),
    Column("seen_at", t.UTCDateTime, nullable=False),
    Column("problem", Text),
    Column("stopped_at", t.UTCDateTime),
)


def _v3(conn: Connection) -> None:
    """Rate limits shared by the workers: a limiter per key and the slots of given-back
    messages."""
    _V3_TABLES.create_all(conn)


_V3_TABLES = MetaData()  # the tables version 3 added, frozen as it added them
Table(
    "sagaloop_rate_limits",
    _V3_TABLES,
    Column("key", String(200), primary_key=True),
    Column("next_free", Double, nullable=False),
)
Table(
    "sagaloop_rate_holds",
    _V3_TABLES,
    Column("message_id", String(200), primary_key=True),
    Column("key", String(200), nullable=False),
    Column("slot", Double, nullable=False),
    Column("in_doubt", Boolean, nullable=False),
    Column("give_backs", Integer, nullable=False),
    Column("turn", Integer, nullable=False),
    Column("at", t.UTCDateTime, nullable=False),
)


def _v4(conn: Connection) -> None:
    """Approvals indexed when asked (``sagaloop_approvals``); the open ones of unfinished runs
    are copied from their histories. Processes report the attempts they abandoned, the queues
    they consume and what proves them dead (their claims are then taken over)."""
    conn.execute(text("ALTER TABLE sagaloop_processes ADD COLUMN abandoned TEXT"))
    for column in ("queues TEXT", "app_queues TEXT", "token VARCHAR(64)", "host TEXT"):
        conn.execute(text(f"ALTER TABLE sagaloop_processes ADD COLUMN {column}"))
    _V4_TABLES.create_all(conn)
    rows = conn.execute(
        text(
            "SELECT r.run_id, r.app, r.saga, h.name, h.data, h.at FROM sagaloop_runs r "
            "JOIN sagaloop_history h ON h.run_id = r.run_id WHERE r.status NOT IN "
            "('completed', 'failed', 'compensated', 'cancelled') AND h.kind = 'published' "
            "AND h.name LIKE 'approval:%' ORDER BY r.run_id, h.seq"
        ).columns(at=t.UTCDateTime())
    ).all()
    latest: dict[tuple[str, str], tuple[str, str, Any, datetime]] = {}
    for run_id, app, saga, name, data, at in rows:
        if str(name).startswith("approval:"):  # SQLite's LIKE ignores ASCII case
            value = payloads.resolve_datas(conn, run_id, [json.loads(data or "{}")])[0]
            latest[(run_id, name[len("approval:") :])] = (app, saga, value.get("value"), at)
    approvals = Table("sagaloop_approvals", _V4_TABLES)
    for (run_id, call_id), (app, saga, request, at) in latest.items():
        if not isinstance(request, dict):
            continue
        conn.execute(
            approvals.insert().values(
                run_id=run_id,
                call_id=call_id,
                app=app,
                saga=saga,
                status=str(request.get("status", "")),
                request=json.dumps(request, separators=(",", ":")),
                request_id=secrets.token_hex(16),
                requested_at=at,
                updated_at=datetime.now(UTC),
            )
        )


_V4_TABLES = MetaData()  # the tables version 4 added, frozen as it added them
Table(
    "sagaloop_approvals",
    _V4_TABLES,
    Column("run_id", String(200), primary_key=True),
    Column("call_id", String(200), primary_key=True),
    Column("app", String(200), nullable=False),
    Column("saga", String(200), nullable=False),
    Column("status", String(16), nullable=False),
    Column("request", Text, nullable=False),
    Column("request_id", String(64), nullable=False),
    Column("requested_at", t.UTCDateTime, nullable=False),
    Column("answer_id", String(200)),
    Column("answer", Text),
    Column("updated_at", t.UTCDateTime, nullable=False),
    Index("sagaloop_approvals_open", "app", "status", "requested_at"),
)


def _v5(conn: Connection) -> None:
    """Runs indexed by app, status and how far an engine took them: the start backlog that
    ``Client.start`` limits (``processed_seq = 0``) and the running runs that an engine's start
    window counts (``> 0``) are each a range of it."""
    conn.execute(
        text("CREATE INDEX sagaloop_runs_app ON sagaloop_runs (app, status, processed_seq)")
    )


def _v6(conn: Connection) -> None:
    """Schedules (``sagaloop_schedules``): what starts sagas on a cron or an interval."""
    _V6_TABLES.create_all(conn)


_V6_TABLES = MetaData()  # the tables version 6 added, frozen as it added them
Table(
    "sagaloop_schedules",
    _V6_TABLES,
    Column("app", String(200), primary_key=True),
    Column("name", String(200), primary_key=True),
    Column("saga", String(200), nullable=False),
    Column("spec", String(300), nullable=False),
    Column("input", Text),
    Column("catch_up", String(16), nullable=False),
    Column("paused", Boolean, nullable=False),
    Column("origin", String(16), nullable=False),
    Column("next_tick", t.UTCDateTime, nullable=False),
    Column("last_tick", t.UTCDateTime),
    Column("last_run_id", String(200)),
    Column("updated_at", t.UTCDateTime, nullable=False),
)


def _v7(conn: Connection) -> None:
    """Run concurrency keys: the slots of each key and the runs queued for one."""
    _V7_TABLES.create_all(conn)


_V7_TABLES = MetaData()  # the tables version 7 (run concurrency) added, frozen as it added them
Table(
    "sagaloop_concurrency_slots",
    _V7_TABLES,
    Column("app", String(200), primary_key=True),
    Column("saga", String(200), primary_key=True),
    Column("key", String(200), primary_key=True),
    Column("slot", Integer, primary_key=True),
    Column("run_id", String(200), nullable=False, unique=True),
    Column("claimed_at", t.UTCDateTime, nullable=False),
)
Table(
    "sagaloop_concurrency_waiters",
    _V7_TABLES,
    Column("id", t.BigId, primary_key=True, autoincrement=True),
    Column("run_id", String(200), nullable=False, unique=True),
    Column("app", String(200), nullable=False),
    Column("saga", String(200), nullable=False),
    Column("key", String(200), nullable=False),
    Column("started_at", t.UTCDateTime, nullable=False),
    Index("sagaloop_concurrency_waiters_key", "app", "saga", "key", "started_at", "id"),
)


def _v8(conn: Connection) -> None:
    """Event subscriptions (``sagaloop_subscriptions``): the runs a published event reaches."""
    _V8_TABLES.create_all(conn)


_V8_TABLES = MetaData()  # the tables version 8 (published events) added, frozen as it added them
Table(
    "sagaloop_subscriptions",
    _V8_TABLES,
    Column("app", String(200), primary_key=True),
    Column("name", String(200), primary_key=True),
    Column("key", String(200), primary_key=True),
    Column("run_id", String(200), primary_key=True),
    Index("sagaloop_subscriptions_run", "run_id"),
)


def _v9(conn: Connection) -> None:
    """Debounced starts (``sagaloop_debounced``): the open window of each debounced saga's key."""
    _V9_TABLES.create_all(conn)


_V9_TABLES = MetaData()  # the tables version 9 (debounce) added, frozen as it added them
Table(
    "sagaloop_debounced",
    _V9_TABLES,
    Column("app", String(200), primary_key=True),
    Column("saga", String(200), primary_key=True),
    Column("key", String(200), primary_key=True),
    Column("run_id", String(200), nullable=False, unique=True),
    Column("input", Text),
    Column("first_at", t.UTCDateTime, nullable=False),
    Column("last_at", t.UTCDateTime, nullable=False),
    Column("due_at", t.UTCDateTime, nullable=False),
    Column("starts", Integer, nullable=False),
    Index("sagaloop_debounced_due", "app", "due_at"),
)


def _v10(conn: Connection) -> None:
    """The runs listing's indexes: its orders and cursors, and (PostgreSQL) run id prefixes.
    ``IF NOT EXISTS``: a database that tests took back to an older version keeps them."""
    for name, columns in (
        ("sagaloop_runs_updated", "updated_at, run_id"),
        ("sagaloop_runs_created", "created_at, run_id"),
    ):
        conn.execute(text(f"CREATE INDEX IF NOT EXISTS {name} ON sagaloop_runs ({columns})"))
    if conn.dialect.name == "postgresql":
        conn.execute(
            text(
                "CREATE INDEX IF NOT EXISTS sagaloop_runs_id_pattern ON sagaloop_runs "
                "(run_id varchar_pattern_ops)"
            )
        )


def _v11(conn: Connection) -> None:
    """A schedule's note (``sagaloop_schedules.note``): why it was paused, told back by
    ``client.schedules.describe``. Added only if missing: a database that tests took back
    to an older version keeps it."""
    if "note" not in {c["name"] for c in inspect(conn).get_columns("sagaloop_schedules")}:
        conn.execute(text("ALTER TABLE sagaloop_schedules ADD COLUMN note TEXT"))


def _v12(conn: Connection) -> None:
    """The open approvals' page index (``sagaloop_approvals_page``) in place of
    ``sagaloop_approvals_open`` (``app, status, requested_at``), which could not give the
    page's order over two statuses: every page sorted all the open approvals."""
    conn.execute(text("DROP INDEX IF EXISTS sagaloop_approvals_open"))
    conn.execute(
        text(
            "CREATE INDEX IF NOT EXISTS sagaloop_approvals_page ON sagaloop_approvals "
            "(app, requested_at, run_id, call_id) WHERE status IN ('escalated', 'pending')"
        )
    )


MIGRATIONS: list[tuple[int, Callable[[Connection], None]]] = [
    (1, _v1),
    (2, _v2),
    (3, _v3),
    (4, _v4),
    (5, _v5),
    (6, _v6),
    (7, _v7),
    (8, _v8),
    (9, _v9),
    (10, _v10),
    (11, _v11),
    (12, _v12),
]
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
        if before == 0:
            t.metadata.create_all(conn)
        for number, migrate in MIGRATIONS:
            if 0 < before < number:
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
