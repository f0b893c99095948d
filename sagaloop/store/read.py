"""Read models over the store for operators: the metrics read at scrape time
(``sagaloop.observability``; each read bounded) and the counts ``sagaloop health`` shows."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy import Connection

from sagaloop.engine import history as h
from sagaloop.engine.state import ALL_STATUSES, FINAL_STATUSES, NEEDS_ATTENTION
from sagaloop.store import payloads
from sagaloop.store import tables as t
from sagaloop.store.core import SqlCore


class SqlReadModels(SqlCore):
    def runs_in_flight(self) -> dict[str, int]:
        """How many unfinished runs each app has."""
        runs = t.runs.c
        q = sa.select(runs.app, sa.func.count()).where(runs.status.not_in(FINAL_STATUSES))
        with self._read() as conn:
            return {str(app): int(n) for app, n in conn.execute(q.group_by(runs.app))}

    def run_counts(self) -> dict[tuple[str, str], int]:
        """How many runs each (saga, status) has: one pass over the (saga, status) index."""
        c = t.runs.c
        q = sa.select(c.saga, c.status, sa.func.count()).group_by(c.saga, c.status)
        with self._read() as conn:
            return {(str(saga), str(status)): int(n) for saga, status, n in conn.execute(q)}

    def start_backlogs(self) -> dict[str, int]:
        """Per app with any, the runs whose start no engine took up yet."""
        c = t.runs.c
        q = sa.select(c.app, sa.func.count()).where(c.processed_seq == 0, c.status == "running")
        with self._read() as conn:
            return {str(app): int(n) for app, n in conn.execute(q.group_by(c.app))}

    def outbox_summary(self, now: datetime) -> dict[str, tuple[int, datetime | None]]:
        """Per queue, the rows of the outbox and since when the longest-waiting row that nobody
        holds (unclaimed, or its claim expired) is available (None when there is none)."""
        c = t.outbox.c
        free = sa.or_(c.claimed_until.is_(None), c.claimed_until < now)
        oldest = sa.func.min(sa.case((free, c.available_at)))
        q = sa.select(c.queue, sa.func.count(), oldest).group_by(c.queue)
        with self._read() as conn:
            rows = conn.execute(q).all()
        process = t.UTCDateTime().process_result_value
        return {str(q): (int(n), process(at, self.engine.dialect)) for q, n, at in rows}

    def dead_letters_per_queue(self) -> dict[str, int]:
        """The dead letters of the database queues, per queue they came from."""
        d = t.dead_letters.c
        q = sa.select(d.queue, sa.func.count()).group_by(d.queue)
        with self._read() as conn:
            return {str(queue): int(n) for queue, n in conn.execute(q)}

    def latest_published(
        self, prefix: str, statuses: Sequence[str], *, limit: int = 100_000
    ) -> list[tuple[str, str, str, Any]]:
        """``(saga, run_id, key, value)``: the latest value that each run in one of ``statuses``
        published under each key starting with ``prefix``, of at most ``limit`` runs. Reads
        only the history of those runs, through its primary key."""
        e, later = t.history.alias("e"), t.history.alias("later")
        newer = (
            sa.select(sa.literal(1))
            .where(
                later.c.run_id == e.c.run_id,
                later.c.kind == h.PUBLISHED,
                later.c.name == e.c.name,
                later.c.seq > e.c.seq,
            )
            .exists()
        )
        q = sa.select(e.c.run_id, e.c.name, e.c.data).where(
            e.c.run_id.in_(sa.bindparam("runs", expanding=True)),
            e.c.kind == h.PUBLISHED,
            e.c.name.startswith(prefix, autoescape=True),
            ~newer,
        )
        out = []
        with self._read() as conn:
            runs = _saga_of_runs(conn, t.runs.c.status.in_(list(statuses)), limit)
            for run_id, key, data in _in_batches(conn, q, runs):
                if not str(key).startswith(prefix):  # SQLite's LIKE ignores ASCII case
                    continue
                data = payloads.resolve_datas(conn, run_id, [data or {}])[0]
                out.append((runs[run_id], str(run_id), str(key), data.get("value")))
        return out

    def halted_steps(self, *, limit: int = 100_000) -> list[tuple[str, str, str]]:
        """``(saga, run_id, step)`` of each step halted in doubt (not dispatched again since) in
        a run that needs attention, of at most ``limit`` runs: what waits for an operator to
        check an effect."""
        e, later = t.history.alias("e"), t.history.alias("later")
        again = (
            sa.select(sa.literal(1))
            .where(
                later.c.run_id == e.c.run_id,
                later.c.pos == e.c.pos,
                later.c.kind == h.STEP_DISPATCHED,
                later.c.seq > e.c.seq,
            )
            .exists()
        )
        q = sa.select(e.c.run_id, e.c.name).where(
            e.c.run_id.in_(sa.bindparam("runs", expanding=True)),
            e.c.kind == h.STEP_HALTED,
            ~again,
        )
        with self._read() as conn:
            runs = _saga_of_runs(conn, t.runs.c.status == NEEDS_ATTENTION, limit)
            return [(runs[run], str(run), str(step)) for run, step in _in_batches(conn, q, runs)]

    def step_outcomes(
        self, since: datetime, *, limit: int = 100_000
    ) -> tuple[list[StepOutcome], bool]:
        """The outcomes of step and compensation attempts recorded at ``since`` or later, each
        with when its attempt was dispatched, and whether more were left out (``limit``: runs,
        and outcomes). The history has no global order: the runs updated since then are found
        with the (status, updated_at) index, and their events through the history's key."""
        e, start = t.history.alias("e"), t.history.alias("start")
        do = e.c.kind.in_(_DO_OUTCOMES)
        started = (
            sa.select(start.c.at)
            .where(
                start.c.run_id == e.c.run_id,
                start.c.pos == e.c.pos,
                start.c.seq < e.c.seq,
                sa.or_(
                    sa.and_(do, start.c.kind.in_((h.STEP_SCHEDULED, h.STEP_DISPATCHED))),
                    sa.and_(~do, start.c.kind == h.COMPENSATION_SCHEDULED),
                ),
            )
            .order_by(start.c.seq.desc())
            .limit(1)
            .scalar_subquery()
        )
        # only failures carry what the metrics need from ``data`` (in_doubt): not results
        data = sa.case((e.c.kind.in_(_DOUBT_OUTCOMES), e.c.data))
        q = sa.select(
            e.c.run_id,
            e.c.seq,
            e.c.name,
            e.c.kind,
            e.c.at,
            started.label("started_at"),
            data.label("data"),
        ).where(
            e.c.run_id.in_(sa.bindparam("runs", expanding=True)),
            e.c.at >= since,
            e.c.kind.in_(_DO_OUTCOMES + _UNDO_OUTCOMES),
        )
        c = t.runs.c
        # every status listed, so that the (status, updated_at) index serves
        recent = sa.and_(c.status.in_(ALL_STATUSES), c.updated_at >= since)
        out: list[StepOutcome] = []
        with self._read() as conn:
            runs = _saga_of_runs(conn, recent, limit)
            for run_id, seq, step, kind, at, started_at, data in _in_batches(conn, q, runs):
                doubt = kind == h.STEP_HALTED or bool((data or {}).get("in_doubt"))
                out.append(
                    StepOutcome(
                        str(run_id), seq, runs[run_id], str(step), kind, at, started_at, doubt
                    )
                )
                if len(out) >= limit:
                    return out, True
        return out, len(runs) >= limit


_DO_OUTCOMES = (h.STEP_COMPLETED, h.STEP_RETRYING, h.STEP_FAILED, h.STEP_HALTED)
_UNDO_OUTCOMES = (h.COMPENSATION_COMPLETED, h.COMPENSATION_RETRYING, h.COMPENSATION_FAILED)
_DOUBT_OUTCOMES = (h.STEP_RETRYING, h.STEP_FAILED, h.COMPENSATION_RETRYING, h.COMPENSATION_FAILED)
_BATCH = 500
"""Runs per query of their history (an ``IN`` list)."""


def _saga_of_runs(conn: Connection, where: Any, limit: int) -> dict[str, str]:
    """run_id -> saga of at most ``limit`` runs matching ``where``."""
    q = sa.select(t.runs.c.run_id, t.runs.c.saga).where(where).limit(limit)
    return {str(run_id): str(saga) for run_id, saga in conn.execute(q)}


def _in_batches(conn: Connection, q: Any, runs: dict[str, str]) -> Iterator[Any]:
    """The rows of ``q`` (with an expanding ``runs`` parameter) for these runs, a batch of
    them at a time: the history is read through its primary key, never scanned whole."""
    ids = sorted(runs)
    for i in range(0, len(ids), _BATCH):
        yield from conn.execute(q, {"runs": ids[i : i + _BATCH]})


@dataclasses.dataclass(frozen=True, slots=True)
class StepOutcome:
    """How an attempt of a step (or of its compensation) ended, as its run's history says."""

    run_id: str
    seq: int
    saga: str
    step: str
    kind: str
    """The history event: ``step_completed``, ``step_retrying``, ``compensation_failed``..."""
    at: datetime
    started_at: datetime | None
    """When the attempt was dispatched (its ``step_scheduled``, ``step_dispatched`` or
    ``compensation_scheduled``)."""
    in_doubt: bool
    """The attempt failed without proof that it took no effect."""
