"""The outbox table as SQL: messages to send and, for the database broker, the queue itself.

Functions of an open connection; :class:`~sagaloop.store.sql.SqlStore` owns the transactions.
Claims lock their rows with ``FOR UPDATE SKIP LOCKED`` on PostgreSQL, so that concurrent
claimers take disjoint rows without waiting for each other; SQLite serializes write
transactions instead. A claim is a lease: a claim token and a deadline, after which the row is
claimable again; every later operation on the row names the token it was claimed with.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Sequence
from datetime import datetime, timedelta
from typing import Any, NamedTuple

import sqlalchemy as sa
from sqlalchemy import Connection

from sagaloop.engine.messages import LOCAL_SUFFIX
from sagaloop.engine.ports import Outgoing, QueuedMessage
from sagaloop.store import payloads
from sagaloop.store import tables as t

c = t.outbox.c
RAW_PREFIX = "raw:"
"""Starts the ``message_id`` column of rows put by ``enqueue_raw``: bodies nobody checked, so
not trusted as internal messages. (Rows of ``enqueue`` carry their envelope's id; sagaloop's
internal ids start with their kind, ``step:``, ``result:``, ``timer:``.)"""


def enqueue(
    conn: Connection,
    messages: Sequence[Outgoing],
    now: datetime,
    claim: tuple[str, Callable[[str], datetime | None]] | None = None,
) -> list[QueuedMessage]:
    """Insert the messages. With ``claim`` (a token, and the deadline of a row's claim by its
    queue: None, not claimed), the rows available now that get a deadline are inserted
    already claimed with the token, and returned, so that their writer can hand them over.
    Large payload values go to the payload table (see ``payloads.py``)."""
    offload = payloads.Offloader()
    bodies = [offload.message(m.envelope) for m in messages]
    rows = [
        _row(m.queue, m.envelope.message_id, body, m.available_at or now, now)
        for m, body in zip(messages, bodies, strict=True)
    ]
    offload.flush(conn, now)
    if claim is None:
        if rows:
            conn.execute(t.outbox.insert(), rows)
        return []
    token, until_of = claim
    ready, later = [], []
    for r in rows:
        until = until_of(r["queue"]) if r["available_at"] <= now else None
        if until is None:
            later.append(r)
        else:
            r.update(claim_token=token, claimed_until=until, deliveries=1)
            ready.append(r)
    if later:
        conn.execute(t.outbox.insert(), later)
    if not ready:
        return []
    ids = conn.execute(_INSERT_CLAIMED, ready).scalars().all()
    return [
        QueuedMessage(i, r["queue"], r["body"], 1, token) for i, r in zip(ids, ready, strict=True)
    ]


_INSERT_CLAIMED = t.outbox.insert().returning(c.id, sort_by_parameter_order=True)


def enqueue_raw(
    conn: Connection, batch: Sequence[tuple[str, bytes]], now: datetime, *, trusted: bool = False
) -> None:
    if not batch:
        return
    prefix = "" if trusted else RAW_PREFIX
    rows = [_row(queue, prefix + uuid.uuid4().hex, body, now, now) for queue, body in batch]
    conn.execute(t.outbox.insert(), rows)


def _row(queue: str, message_id: str, body: bytes, available_at: datetime, now: datetime) -> Any:
    return {
        "queue": queue,
        "message_id": message_id,
        "body": body,
        "available_at": available_at,
        "deliveries": 0,
        "created_at": now,
    }


def _claimable(q: sa.Select[Any], queues: Sequence[str] | None, now: datetime) -> sa.Select[Any]:
    q = q.where(
        c.available_at <= now,
        sa.or_(c.claimed_until.is_(None), c.claimed_until < now),
    )
    if queues is not None:
        return q.where(c.queue.in_(list(queues)))
    # a relay's sweep: every queue but the in-process lanes, which no broker serves
    return q.where(c.queue.not_like(f"%{LOCAL_SUFFIX}"))


def any_claimable(conn: Connection, queues: Sequence[str] | None, now: datetime) -> bool:
    """Whether :func:`claim` would find a row now (without locking anything)."""
    return conn.execute(_claimable(sa.select(c.id), queues, now).limit(1)).first() is not None


def claim(
    conn: Connection,
    dialect: str,
    queues: Sequence[str] | None,
    limit: int,
    now: datetime,
    lease: timedelta,
    owner: str | None = None,
) -> list[QueuedMessage]:
    """Claim up to ``limit`` rows with a fresh token (:func:`claim_token` of ``owner``)."""
    q = _claimable(sa.select(c.id, c.queue, c.body, c.deliveries, c.message_id), queues, now)
    q = q.order_by(c.id).limit(limit)
    if dialect == "postgresql":
        q = q.with_for_update(skip_locked=True)
    rows = list(conn.execute(q))
    if not rows:
        return []
    token = claim_token(owner)
    conn.execute(
        t.outbox.update()
        .where(c.id.in_([r.id for r in rows]))
        .values(claimed_until=now + lease, claim_token=token, deliveries=c.deliveries + 1)
    )
    return [
        QueuedMessage(r.id, r.queue, bytes(r.body), r.deliveries + 1, token, _trusted(r))
        for r in rows
    ]


def claim_token(owner: str | None) -> str:
    """A fresh claim token: ``<owner>.<random>`` for a registered process (whose claims are
    released by that prefix once it is proven dead: :func:`release_owned`), else random."""
    fresh = uuid.uuid4().hex
    return f"{owner}.{fresh}" if owner else fresh


class Released(NamedTuple):
    id: int
    queue: str
    message_id: str


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


def delete_claimed(conn: Connection, ids: Sequence[int], claim_token: str) -> int:
    return int(conn.execute(_DELETE_CLAIMED, {"ids": list(ids), "token": claim_token}).rowcount)


_DELETE_CLAIMED = t.outbox.delete().where(
    c.id.in_(sa.bindparam("ids", expanding=True)), c.claim_token == sa.bindparam("token")
)


def release(conn: Connection, ids: Sequence[int], claim_token: str, available_at: datetime) -> bool:
    result = conn.execute(
        t.outbox.update()
        .where(c.id.in_(list(ids)), c.claim_token == claim_token)
        .values(claimed_until=None, claim_token=None, available_at=available_at)
    )
    return bool(result.rowcount)


def extend_claim(conn: Connection, id: int, claim_token: str, until: datetime) -> bool:
    result = conn.execute(
        t.outbox.update()
        .where(c.id == id, c.claim_token == claim_token)
        .values(claimed_until=until)
    )
    return bool(result.rowcount)


def dead_letter(conn: Connection, id: int, claim_token: str, reason: str, now: datetime) -> bool:
    row = conn.execute(
        sa.select(c.queue, c.body).where(c.id == id, c.claim_token == claim_token)
    ).first()
    if row is None:
        return False  # the lease was lost: whoever holds it now decides
    conn.execute(
        t.dead_letters.insert().values(queue=row.queue, body=row.body, reason=reason, at=now)
    )
    conn.execute(t.outbox.delete().where(c.id == id))
    return True


def dead_letters(conn: Connection) -> list[tuple[str, bytes, str]]:
    d = t.dead_letters.c
    rows = conn.execute(sa.select(d.queue, d.body, d.reason).order_by(d.id))
    return [(r.queue, bytes(r.body), r.reason) for r in rows]


class DeadLetterRow(NamedTuple):
    id: int
    queue: str
    body: bytes
    reason: str
    at: datetime


_d = t.dead_letters.c
_DEAD_COLUMNS = (_d.id, _d.queue, _d.body, _d.reason, _d.at)


def _dead_row(r: Any) -> DeadLetterRow:
    return DeadLetterRow(int(r.id), str(r.queue), bytes(r.body), str(r.reason), r.at)


def dead_letter_rows(
    conn: Connection, ids: Sequence[int] | None, limit: int | None
) -> list[DeadLetterRow]:
    q = sa.select(*_DEAD_COLUMNS).order_by(_d.id).limit(limit)
    if ids is not None:
        q = q.where(_d.id.in_(list(ids)))
    return [_dead_row(r) for r in conn.execute(q)]


def count_dead_letters(conn: Connection) -> int:
    return int(conn.execute(sa.select(sa.func.count()).select_from(t.dead_letters)).scalar_one())


def delete_dead_letters(conn: Connection, ids: Sequence[int] | None) -> list[DeadLetterRow]:
    """Delete them (all when ``ids`` is None); return the rows deleted. Of two transactions
    deleting the same row, one gets it: the other waits for its row lock, then finds it gone."""
    q = t.dead_letters.delete().returning(*_DEAD_COLUMNS)
    if ids is not None:
        q = q.where(_d.id.in_(list(ids)))
    return sorted((_dead_row(r) for r in conn.execute(q)), key=lambda r: r.id)


def requeue_dead_letters(
    conn: Connection,
    ids: Sequence[int] | None,
    now: datetime,
    trusted: Callable[[str, bytes, str], bool],
) -> list[DeadLetterRow]:
    """Move dead letters back to their queue, bodies unchanged, in one statement pair: what one
    transaction deleted it requeues, so a dead letter resent twice at once goes out once. A row
    is trusted as sagaloop's own when ``trusted(queue, body, reason)``; it then carries its
    envelope's ``message_id``, as rows of :func:`enqueue` do."""
    rows = delete_dead_letters(conn, ids)
    if rows:
        conn.execute(
            t.outbox.insert(),
            [_row(r.queue, _requeued_id(r, trusted), r.body, now, now) for r in rows],
        )
    return rows


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


def depths(conn: Connection) -> dict[str, int]:
    q = sa.select(c.queue, sa.func.count()).group_by(c.queue)
    return {str(name): int(n) for name, n in conn.execute(q)}


def oldest_available(conn: Connection) -> datetime | None:
    """Since when the longest-waiting row to publish has been available: not counting the
    in-process lanes, whose rows are never published (one stays while its step runs)."""
    q = sa.select(sa.func.min(c.available_at)).where(c.queue.not_like(f"%{LOCAL_SUFFIX}"))
    value: datetime | None = conn.execute(q).scalar()
    return value
