"""The SQL of the process registry (``sagaloop_processes``): which service processes run, since
when, when each was last seen, and what is wrong with it. ``SqlStore`` wraps these functions;
``sagaloop.cli.processes`` writes and judges the rows."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

import sqlalchemy as sa
from sqlalchemy import Connection

from sagaloop.store import tables as t


@dataclass(frozen=True)
class ProcessRecord:
    name: str
    """``role@host:pid``."""
    app: str
    role: str
    started_at: datetime
    seen_at: datetime
    problem: str | None
    """Why the process is (or exited) unhealthy, or None."""
    stopped_at: datetime | None
    """When it exited (cleanly or because of ``problem``); None while it runs or if killed."""


_c = t.processes.c


def started(conn: Connection, name: str, app: str, role: str, now: datetime) -> None:
    """Insert the row of ``name``, replacing an earlier process's with the same name."""
    conn.execute(t.processes.delete().where(_c.name == name))
    conn.execute(
        t.processes.insert().values(
            name=name, app=app, role=role, started_at=now, seen_at=now, problem=None
        )
    )


def seen(conn: Connection, name: str, now: datetime, problem: str | None) -> bool:
    """Refresh the row; False when there is none (never written, or pruned)."""
    q = t.processes.update().where(_c.name == name).values(seen_at=now, problem=problem)
    return conn.execute(q.execution_options(preserve_rowcount=True)).rowcount == 1


def stopped(conn: Connection, name: str, now: datetime, problem: str | None) -> None:
    q = t.processes.update().where(_c.name == name)
    conn.execute(q.values(seen_at=now, stopped_at=now, problem=problem))


def prune(conn: Connection, before: datetime) -> int:
    q = t.processes.delete().where(_c.seen_at < before)
    return int(conn.execute(q.execution_options(preserve_rowcount=True)).rowcount)


def rows(conn: Connection) -> list[ProcessRecord]:
    q = sa.select(t.processes).order_by(_c.started_at, _c.name)
    return [ProcessRecord(**r) for r in conn.execute(q).mappings()]
