"""The outbox table: messages to send and, for the database broker, the queue itself (the
store's ``OutboxQueue`` role, and the dead letters of the database queues).

Claims lock their rows with ``FOR UPDATE SKIP LOCKED`` on PostgreSQL, so that concurrent
claimers take disjoint rows without waiting for each other; SQLite serializes write
transactions instead. A claim is a lease: a claim token and a deadline, after which the row is
claimable again; every later operation on the row names the token it was claimed with.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterator, Sequence
from datetime import datetime, timedelta
from typing import Any, NamedTuple

import sqlalchemy as sa
from sqlalchemy import Connection

from sagaloop.engine.messages import LOCAL_SUFFIX, Envelope
from sagaloop.engine.ports import Handoff, OutboxQueue, Outgoing, QueuedMessage
from sagaloop.store import payloads
from sagaloop.store import tables as t
from sagaloop.store.core import (
    Settle,
    SqlCore,
    SqlTx,
    conn_of,
    delete_claimed,
    flush_settles,
    open_tx,
)

c = t.outbox.c
RAW_PREFIX = "raw:"
"""Starts the ``message_id`` column of rows put by ``enqueue_raw``: bodies nobody checked, so
not trusted as internal messages. (Rows of ``enqueue`` carry their envelope's id; sagaloop's
internal ids start with their kind, ``step:``, ``result:``, ``timer:``.)"""
DELETE_CHUNK = 1000
"""The most published rows one statement deletes."""


class Released(NamedTuple):
    id: int
    queue: str
    message_id: str


class DeadLetterRow(NamedTuple):
    id: int
    queue: str
    body: bytes
    reason: str
    at: datetime


class SqlOutbox(SqlCore, OutboxQueue):
    """The outbox on SQL: enqueued in the writer's transaction, claimed with a lease, deleted
    by claim token; and its dead letters."""

    def enqueue(self, tx: Any, messages: Sequence[Outgoing], now: datetime) -> None:
        """Rows available now, written in a transaction of the store while a handoff is set
        (see :meth:`hand_over_to`), are inserted already claimed with the handoff's token when
        their queue has a lease, and handed over after the commit. Large payload values go to
        the payload table (see ``payloads.py``)."""
        if not messages:
            return
        conn = conn_of(tx)
        offload = payloads.Offloader()
        rows = self.outbox_rows(tx, messages, now, offload)
        offload.flush(conn, now)
        later = [r for r in rows if "claim_token" not in r]
        ready = [r for r in rows if "claim_token" in r]
        if later:
            conn.execute(t.outbox.insert(), later)
        ids = conn.execute(_INSERT_CLAIMED, ready).scalars().all() if ready else []
        inserted(tx, rows, ids)

    def outbox_rows(
        self, tx: SqlTx, messages: Sequence[Outgoing], now: datetime, offload: payloads.Offloader
    ) -> list[dict[str, Any]]:
        """The rows of ``messages`` (large values collected by ``offload``); those to hand over
        after the commit (see :meth:`enqueue`) carry their claim (``claim_token``...)."""
        handoff = self.handoff if tx.own else None
        until_of = None if handoff is None else _deadlines(handoff, now)
        rows = []
        for m in messages:
            at = m.available_at or now
            r = _row(m.queue, m.envelope.message_id, offload.message(m.envelope), at, now)
            until = None
            if until_of is not None and at <= now:
                env = m.envelope
                until = until_of(m.queue, None if env.type == "step" else env.run_id)
            if handoff is not None and until is not None:
                r.update(claim_token=handoff.token, claimed_until=until, deliveries=1)
            rows.append(r)
        return rows

    def resolve(self, tx: Any, env: Envelope) -> Envelope:
        """Reads the payload table; no query when ``env`` holds no reference."""
        if not payloads.marked_fields(env.payload):
            return env
        with self._in(tx) as conn:
            return payloads.resolve_message(conn, env)

    def enqueue_raw(
        self, batch: Sequence[tuple[str, bytes]], now: datetime, *, trusted: bool = False
    ) -> None:
        """Put bodies on database queues as they are (the database broker's publish): not
        trusted as internal messages unless ``trusted``."""
        if not batch:
            return
        prefix = "" if trusted else RAW_PREFIX
        rows = [_row(queue, prefix + uuid.uuid4().hex, body, now, now) for queue, body in batch]
        with self.transaction() as tx:
            tx.conn.execute(t.outbox.insert(), rows)
            tx.queues.extend(queue for queue, _ in batch)

    def claim(
        self,
        queues: Sequence[str] | None,
        limit: int,
        now: datetime,
        lease: timedelta,
        *,
        probe: bool = False,
    ) -> list[QueuedMessage]:
        """The token is :func:`claim_token` of the store's ``claim_owner``. In the same
        transaction, first, delete the published rows :meth:`delete_later` left pending (with
        none, on PostgreSQL, the claim is one statement: ``_CLAIM_ONE``, which writes nothing
        when nothing is due). ``probe``: elsewhere, with nothing to delete and nothing to claim,
        one read and no transaction."""
        with self._published_lock:
            pending = bool(self._published)
        named = queues is not None
        params: dict[str, Any] = {"now": now, "limit": limit}
        if queues is not None:
            params["queues"] = list(queues)
        if self.dialect == "postgresql" and not pending:  # one statement, its own commit
            token = params["token"] = claim_token(self.claim_owner)
            params["until"] = now + lease
            with self._one_write() as conn:
                rows = sorted(conn.execute(_CLAIM_ONE[named], params), key=lambda r: int(r.id))
            return [
                QueuedMessage(r.id, r.queue, bytes(r.body), r.deliveries, token, _trusted(r))
                for r in rows
            ]
        if probe and not pending:
            with self._read() as conn:
                if conn.execute(_PROBE[named], params).first() is None:
                    return []
        q = _CLAIM[named, self.dialect == "postgresql"]
        with self.transaction() as tx:
            self._delete_published(tx)
            rows = list(tx.conn.execute(q, params))
            if not rows:
                return []
            token = claim_token(self.claim_owner)
            tx.conn.execute(
                t.outbox.update()
                .where(c.id.in_([r.id for r in rows]))
                .values(claimed_until=now + lease, claim_token=token, deliveries=c.deliveries + 1)
            )
            return [
                QueuedMessage(r.id, r.queue, bytes(r.body), r.deliveries + 1, token, _trusted(r))
                for r in rows
            ]

    def delete_claimed(self, tx: Any, ids: Sequence[int], claim_token: str) -> int:
        if tx is not None:
            return delete_claimed(conn_of(tx), ids, claim_token)
        with self.transaction() as own:
            return delete_claimed(own.conn, ids, claim_token)

    def delete_later(self, ids: Sequence[int], claim_token: str) -> None:
        with self._published_lock:
            self._published.append((list(ids), claim_token))

    def delete_published(self) -> None:
        with self._published_lock:
            if not self._published:
                return
        with self.transaction() as tx:
            self._delete_published(tx)

    def _delete_published(self, tx: SqlTx) -> None:
        """Delete the pending rows in ``tx``; if it does not commit, they stay pending."""
        for token, ids in self.take_published(tx).items():
            for chunk in batched(ids, DELETE_CHUNK):
                delete_claimed(tx.conn, chunk, token)

    def take_published(self, tx: SqlTx) -> dict[str, list[int]]:
        """The pending deletions of published rows, by claim token, for ``tx`` to carry (a
        relay publishes under one token: one statement): if it does not commit, they are
        pending again (``SqlCore.transaction``). Nothing for a transaction the store does not
        commit (``attach``): it would not know whether they were deleted."""
        if not tx.own:
            return {}
        with self._published_lock:
            published, self._published = self._published, []
        tx.published.extend(published)
        by_token: dict[str, list[int]] = {}
        for ids, token in published:
            by_token.setdefault(token, []).extend(ids)
        return by_token

    def settle_claimed(
        self, tx: Any, ids: Sequence[int], claim_token: str, lost: Exception
    ) -> None:
        """In a transaction of the store's own, the delete waits in ``tx.settles`` for the
        next checkpoint statement (``SqlCheckpoints``), else for the commit; in an attached
        one (whose commit the store does not see), it is made at once; ``tx`` None: in a
        transaction of its own."""
        if tx is None:
            with self.transaction() as own:
                self.settle_claimed(own, ids, claim_token, lost)
            return
        open_tx(tx).settles.append(Settle(list(ids), claim_token, lost))
        if not tx.own:
            flush_settles(tx)

    def release(self, ids: Sequence[int], claim_token: str, available_at: datetime) -> None:
        q = (
            t.outbox.update()
            .where(c.id.in_(list(ids)), c.claim_token == claim_token)
            .values(claimed_until=None, claim_token=None, available_at=available_at)
        )
        with self.transaction() as tx:
            tx.enqueued = bool(tx.conn.execute(q).rowcount)

    def extend_claim(self, id: int, claim_token: str, until: datetime) -> bool:
        q = t.outbox.update().where(c.id == id, c.claim_token == claim_token)
        with self.transaction() as tx:
            return bool(tx.conn.execute(q.values(claimed_until=until)).rowcount)

    def dead_letter(self, id: int, claim_token: str, reason: str, now: datetime) -> None:
        with self.transaction() as tx:
            conn = tx.conn
            row = conn.execute(
                sa.select(c.queue, c.body).where(c.id == id, c.claim_token == claim_token)
            ).first()
            if row is None:
                return
            conn.execute(
                t.dead_letters.insert().values(
                    queue=row.queue, body=row.body, reason=reason, at=now
                )
            )
            conn.execute(t.outbox.delete().where(c.id == id))

    def dead_letters(self) -> list[tuple[str, bytes, str]]:
        with self._read() as conn:
            rows = conn.execute(sa.select(_d.queue, _d.body, _d.reason).order_by(_d.id))
            return [(r.queue, bytes(r.body), r.reason) for r in rows]

    def dead_letter_rows(
        self, *, ids: Sequence[int] | None = None, limit: int | None = None
    ) -> list[DeadLetterRow]:
        """Dead letters, oldest first: those of ``ids`` (None: all), at most ``limit``."""
        q = sa.select(*_DEAD_COLUMNS).order_by(_d.id).limit(limit)
        if ids is not None:
            q = q.where(_d.id.in_(list(ids)))
        with self._read() as conn:
            return [_dead_row(r) for r in conn.execute(q)]

    def count_dead_letters(self) -> int:
        q = sa.select(sa.func.count()).select_from(t.dead_letters)
        with self._read() as conn:
            return int(conn.execute(q).scalar_one())

    def requeue_dead_letters(
        self,
        ids: Sequence[int] | None,
        now: datetime,
        *,
        trusted: Callable[[str, bytes, str], bool],
    ) -> list[DeadLetterRow]:
        """Move dead letters (all when ``ids`` is None) back to their queues, bodies unchanged,
        in one transaction; return them. What one transaction deleted it requeues, so a dead
        letter resent twice at once goes out once. A row is trusted as sagaloop's own when
        ``trusted(queue, body, reason)``; it then carries its envelope's ``message_id``, as
        rows of :meth:`enqueue` do."""
        with self.transaction() as tx:
            rows = _take_dead_letters(tx.conn, ids)
            if rows:
                tx.conn.execute(
                    t.outbox.insert(),
                    [_row(r.queue, _requeued_id(r, trusted), r.body, now, now) for r in rows],
                )
            tx.queues.extend(r.queue for r in rows)
            return rows

    def delete_dead_letters(self, ids: Sequence[int] | None) -> int:
        """Delete dead letters for good (all when ``ids`` is None); return how many."""
        with self.transaction() as tx:
            return len(_take_dead_letters(tx.conn, ids))

    def queue_depths(self) -> dict[str, int]:
        q = sa.select(c.queue, sa.func.count()).group_by(c.queue)
        with self._read() as conn:
            return {str(name): int(n) for name, n in conn.execute(q)}

    def queue_stats(self, now: datetime) -> dict[str, tuple[int, datetime | None]]:
        """Per queue: how many rows it holds (due, delayed and claimed alike) and when the
        oldest of those due by ``now`` became due (None: none is due); the database broker's
        queues are these rows, so this is their depth and the age of their oldest message."""
        due = sa.case((c.available_at <= now, c.available_at), else_=None)
        q = sa.select(c.queue, sa.func.count(), sa.func.min(due)).group_by(c.queue)
        with self._read() as conn:
            return {str(name): (int(n), oldest) for name, n, oldest in conn.execute(q)}

    def oldest_outbox_message(self) -> datetime | None:
        q = sa.select(sa.func.min(c.available_at)).where(c.queue.not_like(f"%{LOCAL_SUFFIX}"))
        with self._read() as conn:
            value: datetime | None = conn.execute(q).scalar()
            return value


_INSERT_CLAIMED = t.outbox.insert().returning(c.id, sort_by_parameter_order=True)


def inserted(tx: SqlTx, rows: Sequence[dict[str, Any]], claimed_ids: Sequence[int]) -> None:
    """Once ``rows`` (of :meth:`SqlOutbox.outbox_rows`) are inserted, ``claimed_ids`` the ids
    of the claimed ones in order: after the commit, hand those over and wake consumers for
    the others."""
    claimed = [r for r in rows if "claim_token" in r]
    tx.queues.extend(r["queue"] for r in rows if "claim_token" not in r)
    tx.handed.extend(
        QueuedMessage(i, r["queue"], r["body"], 1, r["claim_token"])
        for i, r in zip(claimed_ids, claimed, strict=True)
    )


def batched(items: Sequence[Any], size: int) -> Iterator[Sequence[Any]]:
    for i in range(0, len(items), size):
        yield items[i : i + size]


def _deadlines(handoff: Handoff, now: datetime) -> Callable[[str, str | None], datetime | None]:
    """The claim deadline of a row handed over to ``handoff``, by its queue and run (None: not
    taken). The rows of one run on one queue share the first one's: they are handed over
    together, in order, or left together for a claim, which takes them in order too. Decided
    row by row, a run's start could be handed to one consumer and the event sent to the run
    after it left for another, which may process it first. Steps (``run_id`` None) are
    decided one by one: a run's steps have no order, and a fan-out's must not all be held for
    this process's consumers while those of other processes wait."""
    decided: dict[tuple[str, str], datetime | None] = {}

    def until(queue: str, run_id: str | None) -> datetime | None:
        if run_id is None:
            lease = handoff.lease_for(queue)
            return None if lease is None else now + lease
        key = (queue, run_id)
        if key not in decided:
            lease = handoff.lease_for(queue)
            decided[key] = None if lease is None else now + lease
        return decided[key]

    return until


def _row(queue: str, message_id: str, body: bytes, available_at: datetime, now: datetime) -> Any:
    return {
        "queue": queue,
        "message_id": message_id,
        "body": body,
        "available_at": available_at,
        "deliveries": 0,
        "created_at": now,
    }


_NOW: sa.BindParameter[datetime] = sa.bindparam("now")
_DUE = sa.and_(c.available_at <= _NOW, sa.or_(c.claimed_until.is_(None), c.claimed_until < _NOW))
_WHERE = {
    True: c.queue.in_(sa.bindparam("queues", expanding=True)),
    # a relay's sweep: every queue but the in-process lanes, which no broker serves
    False: c.queue.not_like(f"%{LOCAL_SUFFIX}"),
}
"""The rows claimable ``now``: of the named ``queues`` (True), or of any queue a relay sweeps."""
_PROBE = {named: sa.select(c.id).where(_DUE, where).limit(1) for named, where in _WHERE.items()}


def _claim(where: Any, skip_locked: bool) -> sa.Select[Any]:
    q = sa.select(c.id, c.queue, c.body, c.deliveries, c.message_id).where(_DUE, where)
    q = q.order_by(c.id).limit(sa.bindparam("limit", type_=sa.Integer))
    return q.with_for_update(skip_locked=True) if skip_locked else q


_CLAIM = {
    (named, skip_locked): _claim(where, skip_locked)
    for named, where in _WHERE.items()
    for skip_locked in (True, False)
}
"""The claims' statements, built once (a sweep runs every ``--poll`` seconds in every process:
building them each time was a third of its cost). ``skip_locked``: PostgreSQL's
``FOR UPDATE SKIP LOCKED``; SQLite serializes write transactions instead."""


def _claim_one(where: Any) -> sa.Update:
    picked = sa.select(c.id).where(_DUE, where).order_by(c.id)
    picked = picked.limit(sa.bindparam("limit", type_=sa.Integer)).with_for_update(skip_locked=True)
    return (
        t.outbox.update()
        .where(c.id.in_(picked))
        .values(
            claimed_until=sa.bindparam("until"),
            claim_token=sa.bindparam("token"),
            deliveries=c.deliveries + 1,
        )
        .returning(c.id, c.queue, c.body, c.deliveries, c.message_id)
    )


_CLAIM_ONE = {named: _claim_one(where) for named, where in _WHERE.items()}
"""On PostgreSQL with no published rows to delete first: the claim as one statement on an
autocommitting connection (its rows locked and skipped by other claims as in ``_CLAIM``), 1
round trip instead of 4. ``RETURNING`` has no order: the rows are sorted by id."""


def claim_token(owner: str | None) -> str:
    """A fresh claim token: ``<owner>.<random>`` for a registered process (whose claims are
    released by that prefix once it is proven dead: :func:`release_owned`), else random."""
    fresh = uuid.uuid4().hex
    return f"{owner}.{fresh}" if owner else fresh


def release_owned(conn: Connection, owner: str) -> list[Released]:
    """Release every row claimed with a token of ``owner`` (a process proven dead): they are
    claimable at once, their delivery count kept, as when a lease runs out."""
    mine = c.claim_token.like(f"{owner}.%")
    rows = [
        Released(int(r.id), str(r.queue), str(r.message_id))
        for r in conn.execute(sa.select(c.id, c.queue, c.message_id).where(mine).order_by(c.id))
    ]
    if rows:
        conn.execute(
            t.outbox.update()
            .where(c.id.in_([r.id for r in rows]), mine)
            .values(claim_token=None, claimed_until=None)
        )
    return rows


def _trusted(row: Any) -> bool:
    """Whether sagaloop's store wrote the row (``enqueue``), not ``enqueue_raw``."""
    return not str(row.message_id).startswith(RAW_PREFIX)


_d = t.dead_letters.c
_DEAD_COLUMNS = (_d.id, _d.queue, _d.body, _d.reason, _d.at)


def _dead_row(r: Any) -> DeadLetterRow:
    return DeadLetterRow(int(r.id), str(r.queue), bytes(r.body), str(r.reason), r.at)


def _take_dead_letters(conn: Connection, ids: Sequence[int] | None) -> list[DeadLetterRow]:
    """Delete them (all when ``ids`` is None); return the rows deleted. Of two transactions
    deleting the same row, one gets it: the other waits for its row lock, then finds it gone."""
    q = t.dead_letters.delete().returning(*_DEAD_COLUMNS)
    if ids is not None:
        q = q.where(_d.id.in_(list(ids)))
    return sorted((_dead_row(r) for r in conn.execute(q)), key=lambda r: r.id)


def _requeued_id(row: DeadLetterRow, trusted: Callable[[str, bytes, str], bool]) -> str:
    if not trusted(row.queue, row.body, row.reason):
        return RAW_PREFIX + uuid.uuid4().hex
    try:
        message_id = json.loads(row.body).get("message_id")
    except (ValueError, RecursionError, AttributeError):
        message_id = None
    usable = isinstance(message_id, str) and 0 < len(message_id) <= 200
    if not usable or message_id.startswith(RAW_PREFIX):
        return uuid.uuid4().hex
    return str(message_id)
