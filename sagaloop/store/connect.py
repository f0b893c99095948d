"""Connecting to the database and translating driver errors into sagaloop's error tree.

Everything that depends on the driver (psycopg 3 for PostgreSQL, the standard ``sqlite3``) is
here: engine and pool options, and which failures are worth retrying.
"""

from __future__ import annotations

import re
import select
import time
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy import Connection, event
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import Engine as SAEngine
from sqlalchemy.pool import StaticPool

from sagaloop._secrets import mask_url as mask_url  # re-exported: one masking function
from sagaloop._secrets import password_of
from sagaloop._secrets import scrub as scrub
from sagaloop.errors import DatabaseAccessRefused, StoreError, TransientStoreError

# PostgreSQL SQLSTATEs worth retrying: the transaction lost a race, or the server is going away
# or not there yet. Class 08 (connection exception) is transient as a whole.
TRANSIENT_SQLSTATES = frozenset(
    {
        "40001",  # serialization_failure
        "40P01",  # deadlock_detected
        "55P03",  # lock_not_available (lock_timeout, NOWAIT)
        "57P01",  # admin_shutdown (the server is stopping)
        "57P02",  # crash_shutdown (another backend crashed)
        "57P03",  # cannot_connect_now (the server is starting up or shutting down)
        "53300",  # too_many_connections
    }
)
_SQLITE_TRANSIENT = frozenset({5, 6})  # SQLITE_BUSY ("database is locked"), SQLITE_LOCKED


def create_sa_engine(
    url: str,
    *,
    pool_size: int = 5,
    max_overflow: int = 10,
    pool_timeout: float = 30.0,
    connect_timeout: float = 10.0,
    busy_timeout: float = 30.0,
) -> SAEngine:
    """An SQLAlchemy engine configured for sagaloop's access patterns.

    ``postgresql://`` (or ``postgres://``) URLs use psycopg 3. The pool holds ``pool_size``
    connections plus up to ``max_overflow`` more under load; a caller waits at most
    ``pool_timeout`` seconds for one. A connection that sat idle in the pool is checked before
    use (see :func:`_ping_idle`), so a restarted server costs one reconnect, not an error.
    ``connect_timeout`` bounds a
    connection attempt to PostgreSQL; ``busy_timeout`` is how long SQLite waits for the write
    lock before ``database is locked``.
    """
    u = sa.make_url(url)
    if u.get_backend_name() == "sqlite":
        return _sqlite_engine(u, pool_size, max_overflow, pool_timeout, busy_timeout)
    if u.drivername in ("postgresql", "postgres"):
        u = u.set(drivername="postgresql+psycopg")
    connect_args: dict[str, Any] = {}
    if u.get_backend_name() == "postgresql" and "connect_timeout" not in u.query:
        connect_args["connect_timeout"] = max(1, round(connect_timeout))
    engine = sa.create_engine(
        u,
        pool_size=pool_size,
        max_overflow=max_overflow,
        pool_timeout=pool_timeout,
        connect_args=connect_args,
    )
    _ping_idle(engine)
    return engine


IDLE_BEFORE_PING = 1.0
"""Seconds a pooled connection may sit unused and still be handed out without a ping."""


def _ping_idle(engine: SAEngine) -> None:
    """Check a connection on checkout, without a round trip unless it sat idle.

    SQLAlchemy's ``pool_pre_ping`` pings on every checkout: a round trip per transaction on the
    hot path. Instead: a connection whose socket has something to read while no query is out
    was closed (or is being closed) by the server, say by a restart, and is replaced; one that
    sat in the pool for ``IDLE_BEFORE_PING`` seconds or more is also pinged, which finds the
    connections a network failure cut without a word. Either way a dead connection is replaced
    at once, and the caller never sees it."""

    @event.listens_for(engine, "checkin")
    def _on_checkin(dbapi_conn: Any, record: Any) -> None:
        record.info["sagaloop_idle_since"] = time.monotonic()

    @event.listens_for(engine, "checkout")
    def _on_checkout(dbapi_conn: Any, record: Any, proxy: Any) -> None:
        if _has_input(dbapi_conn):
            raise sa_exc.DisconnectionError("the server closed a pooled connection")
        idle_since = record.info.get("sagaloop_idle_since")
        if idle_since is None or time.monotonic() - idle_since < IDLE_BEFORE_PING:
            return
        try:
            engine.dialect.do_ping(dbapi_conn)
        except Exception as e:
            raise sa_exc.DisconnectionError(f"a pooled connection failed its ping: {e}") from e


def _has_input(dbapi_conn: Any) -> bool:
    """Whether an idle connection's socket is readable (or gone): the server said goodbye."""
    try:
        readable, _, _ = select.select([dbapi_conn.fileno()], [], [], 0)
    except Exception:  # closed: psycopg has no socket any more
        return True
    return bool(readable)


def _sqlite_engine(
    u: sa.URL, pool_size: int, max_overflow: int, pool_timeout: float, busy_timeout: float
) -> SAEngine:
    memory = u.database in (None, "", ":memory:")
    pool: dict[str, Any] = (
        {"poolclass": StaticPool}
        if memory
        else {"pool_size": pool_size, "max_overflow": max_overflow, "pool_timeout": pool_timeout}
    )
    engine = sa.create_engine(
        u,
        connect_args={"check_same_thread": False, "timeout": busy_timeout},
        **pool,
    )
    busy_ms = max(0, round(busy_timeout * 1000))

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, record: Any) -> None:
        dbapi_conn.isolation_level = None  # sagaloop emits BEGIN itself
        cur = dbapi_conn.cursor()
        if not memory:
            cur.execute("PRAGMA journal_mode=WAL")
        cur.execute("PRAGMA synchronous=NORMAL")  # durable across process kills in WAL
        cur.execute(f"PRAGMA busy_timeout={busy_ms}")
        cur.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Connection) -> None:
        read = conn.get_execution_options().get("sagaloop_read")
        conn.exec_driver_sql("BEGIN" if read else "BEGIN IMMEDIATE")

    return engine


# --- errors --------------------------------------------------------------------------------


def error_code(e: BaseException) -> str | None:
    """The SQLSTATE (PostgreSQL) or SQLite error name of a driver error, if it has one."""
    orig = e.orig if isinstance(e, sa_exc.DBAPIError) else e
    state = getattr(orig, "sqlstate", None) or getattr(orig, "pgcode", None)
    if isinstance(state, str) and state:
        return state
    name = getattr(orig, "sqlite_errorname", None)
    return name if isinstance(name, str) and name else None


def is_transient(e: BaseException) -> bool:
    """Whether retrying the failed transaction may succeed (see TransientStoreError)."""
    if isinstance(e, sa_exc.TimeoutError):  # no pooled connection came free in time
        return True
    if not isinstance(e, sa_exc.DBAPIError):
        return False
    if e.connection_invalidated:  # SQLAlchemy recognised a lost connection
        return True
    orig = e.orig
    state = getattr(orig, "sqlstate", None) or getattr(orig, "pgcode", None)
    if isinstance(state, str) and state:
        return state in TRANSIENT_SQLSTATES or state.startswith("08")
    sqlite_code = getattr(orig, "sqlite_errorcode", None)
    if isinstance(sqlite_code, int):
        return sqlite_code & 0xFF in _SQLITE_TRANSIENT
    message = str(orig).lower()
    if "database is locked" in message or "database table is locked" in message:
        return True
    # psycopg gives no SQLSTATE when the client itself failed: connection refused, timed out,
    # or closed by the server. Other drivers' operational errors are not guessed at.
    return isinstance(e, sa_exc.OperationalError) and type(orig).__module__.startswith("psycopg")


_REFUSED_SQLSTATES = {
    "28P01": "the password was refused",  # invalid_password
    "28000": "the login was refused",  # invalid_authorization_specification
    "3D000": "the database does not exist",  # invalid_catalog_name
}
_REFUSED_MESSAGES = (
    (
        re.compile(r'password authentication failed for user "([^"]*)"'),
        "the password of user {!r} was refused",
    ),
    (re.compile(r'role "([^"]*)" does not exist'), "the role {!r} does not exist"),
    (re.compile(r'database "([^"]*)" does not exist'), "the database {!r} does not exist"),
    (re.compile(r"no pg_hba\.conf entry for"), "pg_hba.conf lets no such connection in"),
    (
        re.compile(r"permission denied for database|not have CONNECT privilege"),
        "the user may not connect to this database",
    ),
    (re.compile(r"(\w+) authentication failed for user"), "{} authentication failed"),
)


def refused_access(e: BaseException) -> str | None:
    """What the database refused, in a few words, when a connection failed for a reason that
    waiting will not fix (a wrong password, a role or database that does not exist, no
    pg_hba.conf entry); None for any other error (a refused or timed-out connection, too many
    clients, a server starting up: worth retrying). psycopg gives no SQLSTATE for a failed
    connection, so the server's (English) message is read."""
    orig = e.orig if isinstance(e, sa_exc.DBAPIError) else e
    if not type(orig).__module__.startswith("psycopg"):
        return None
    state = getattr(orig, "sqlstate", None)
    if isinstance(state, str) and state:
        return _REFUSED_SQLSTATES.get(state)
    message = str(orig)
    for pattern, reason in _REFUSED_MESSAGES:
        found = pattern.search(message)
        if found:
            return reason.format(*found.groups())
    return None


def translate(e: BaseException, url: sa.URL, what: str = "database operation") -> StoreError:
    """The StoreError (TransientStoreError when worth retrying; DatabaseAccessRefused when the
    server refused the login or the database) to raise ``from e``."""
    orig = e.orig if isinstance(e, sa_exc.DBAPIError) else e
    code = error_code(e)
    detail = " ".join(str(orig).split())
    if len(detail) > 500:
        detail = detail[:500] + "..."
    # The driver may quote a piece of a password that the URL parser cut short (at an ``@``).
    full = password_of(url.render_as_string(hide_password=False))
    detail = scrub(detail, url.password if isinstance(url.password, str) else None, full)
    kind = type(orig).__name__ + (f" [{code}]" if code else "")
    where = mask_url(url)
    refusal = refused_access(e)
    if refusal is not None:
        refusal = scrub(refusal, url.password if isinstance(url.password, str) else None, full)
        message = (
            f"{what} failed on {where}: the server refused access: {refusal} ({kind}: {detail})"
        )
        return DatabaseAccessRefused(message, reason=refusal, where=where, code=code)
    if is_transient(e):
        message = (
            f"{what} failed on {where}, retry it: the database is unreachable or busy "
            f"({kind}: {detail})"
        )
        return TransientStoreError(message, code=code)
    return StoreError(f"{what} failed on {where}: {kind}: {detail}", code=code)


def sqlite_file(url: str) -> Path | None:
    """The file a SQLite URL names (relative to the current folder), or None for another
    database or an in-memory one."""
    try:
        u = sa.make_url(url)
    except sa_exc.ArgumentError:
        return None
    if u.get_backend_name() != "sqlite" or not u.database or u.database == ":memory:":
        return None
    if u.database.startswith("file:") or u.query.get("mode") == "memory":
        return None
    return Path(u.database)
