"""The SQL of the process registry (``sagaloop_processes``): which service processes run, since
when, when each was last seen, and what is wrong with it (the store's ``ProcessRegistry`` role,
and what ``sagaloop health`` reads); ``sagaloop.runtime.registry`` writes and judges the rows."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import sqlalchemy as sa

from sagaloop.engine.ports import ProcessRegistry
from sagaloop.store import queue
from sagaloop.store import tables as t
from sagaloop.store.core import SqlCore


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
    abandoned: list[dict[str, Any]] | None = None
    """The attempts it abandoned past their timeouts whose threads still ran when it was last
    seen (``step``, ``run_id``, ``position``, ``attempt``, ``since``)."""
    queues: list[str] | None = None
    """The queues it consumes (full names)."""
    app_queues: list[str] | None = None
    """The step queues its app declares."""
    token: str | None = None
    """The prefix of its claim tokens; None once its claims were taken over (or never)."""
    host: dict[str, Any] | None = None
    """Where it runs: ``hostname``, ``machine``, ``pid``, ``start`` (see ``runtime.takeover``)."""


_c = t.processes.c


@dataclass(frozen=True)
class Identity:
    """What a process writes about itself at start, besides its name, app and role."""

    queues: Sequence[str] = ()
    app_queues: Sequence[str] = ()
    token: str | None = None
    host: dict[str, Any] | None = None


class SqlRegistry(SqlCore, ProcessRegistry):
    """The process registry on SQL; each write is a transaction of its own."""

    def process_started(
        self,
        name: str,
        app: str,
        role: str,
        now: datetime,
        identity: Identity | None = None,
    ) -> None:
        """Register process ``name`` (``role@host:pid``) as running since ``now``, with what
        it consumes and what proves it dead (``identity``), replacing an earlier process's row
        with the same name."""
        who = identity or Identity()
        with self.transaction() as tx:
            tx.conn.execute(t.processes.delete().where(_c.name == name))
            tx.conn.execute(
                t.processes.insert().values(
                    name=name,
                    app=app,
                    role=role,
                    started_at=now,
                    seen_at=now,
                    problem=None,
                    queues=list(who.queues) or None,
                    app_queues=list(who.app_queues) or None,
                    token=who.token,
                    host=who.host,
                )
            )

    def take_over(self, name: str, token: str) -> list[queue.Released]:
        """Release every outbox row that process ``name``, proven dead, claimed (tokens
        prefixed ``token``), and forget its token (the row stays, for health); return the
        rows released."""
        forget = t.processes.update().where(_c.name == name, _c.token == token)
        with self.transaction() as tx:
            rows = queue.release_owned(tx.conn, token)
            tx.conn.execute(forget.values(token=None))
            tx.enqueued = bool(rows)
            tx.queues.extend(r.queue for r in rows)  # announced to the engines' relays
            return rows

    def process_seen(
        self,
        name: str,
        now: datetime,
        problem: str | None,
        abandoned: Sequence[dict[str, Any]] = (),
    ) -> bool:
        """Refresh the process's row with its current problem (None: healthy) and the
        attempts it abandoned whose threads still run; False when it has no row (never
        written, or pruned)."""
        values = {"seen_at": now, "problem": problem, "abandoned": list(abandoned) or None}
        q = t.processes.update().where(_c.name == name).values(values)
        with self.transaction() as tx:
            return tx.conn.execute(q.execution_options(preserve_rowcount=True)).rowcount == 1

    def abandoned_attempts(self, run_id: str, *, seen_after: datetime) -> list[dict[str, Any]]:
        """Read from the rows of the live processes (their ``abandoned`` column)."""
        q = sa.select(_c.name, _c.abandoned).where(
            _c.seen_at > seen_after, _c.stopped_at.is_(None), _c.abandoned.is_not(None)
        )
        with self._read() as conn:
            return [
                {**item, "process": name}
                for name, items in conn.execute(q)
                for item in items or []
                if isinstance(item, dict) and item.get("run_id") == run_id
            ]

    def live_queues(self, *, seen_after: datetime) -> list[tuple[str, list[str], list[str]]]:
        """Read from the rows of the live processes (``queues``, ``app_queues``)."""
        q = sa.select(_c.app, _c.queues, _c.app_queues).where(
            _c.seen_at > seen_after, _c.stopped_at.is_(None)
        )
        with self._read() as conn:
            return [(str(app), list(qs or []), list(aqs or [])) for app, qs, aqs in conn.execute(q)]

    def process_stopped(self, name: str, now: datetime, problem: str | None) -> None:
        """Mark the process as exited, with the problem it exits because of (None: cleanly)."""
        q = t.processes.update().where(_c.name == name)
        with self.transaction() as tx:
            tx.conn.execute(q.values(seen_at=now, stopped_at=now, problem=problem, abandoned=None))

    def prune_processes(self, before: datetime) -> int:
        """Delete the rows of processes last seen before ``before``; return how many."""
        q = t.processes.delete().where(_c.seen_at < before)
        with self.transaction() as tx:
            return int(tx.conn.execute(q.execution_options(preserve_rowcount=True)).rowcount)

    def processes(self) -> list[ProcessRecord]:
        """Every registered process, oldest first."""
        q = sa.select(t.processes).order_by(_c.started_at, _c.name)
        with self._read() as conn:
            return [ProcessRecord(**r) for r in conn.execute(q).mappings()]
