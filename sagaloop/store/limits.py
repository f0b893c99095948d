"""Rate limits shared by every worker process of a database, as SQL.

A limiter is a GCRA with no burst, one row per key: ``next_free`` is the earliest start the
next reservation may get. Reserving is one atomic statement, an upsert::

    slot = max(next_free, now); next_free = slot + interval; return slot

so concurrent workers get distinct slots ``interval`` apart, on PostgreSQL (the row lock of the
upsert serializes them) as on SQLite (the write lock). A slot that is not used is a gap: the
limiter never hands it out again.

A step message given back to its queue until its slot keeps the slot in ``sagaloop_rate_holds``
(keyed by the message's inbox key), with what the next delivery needs to know: whether the
attempt was already in doubt, and how often it was given back. Taking a hold adds 1 to its
``turn`` (0 when given back), so the delivery that follows a give-back sees 1, and a later one
(the holder died after taking it) sees more: its attempt may have run.

The store's ``RateLimits`` role; each operation is one statement (autocommit on PostgreSQL).
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy import Connection
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert

from sagaloop.engine.ports import HeldSlot, RateLimits
from sagaloop.store import tables as t
from sagaloop.store.core import SqlCore

_limits, _holds = t.rate_limits.c, t.rate_holds.c


def _seconds(when: datetime) -> float:
    return when.timestamp()


def _datetime(seconds: float) -> datetime:
    return datetime.fromtimestamp(seconds, UTC)


class Statements:
    """The statements, built once per dialect with bound parameters."""

    def __init__(self, dialect: str) -> None:
        b = sa.bindparam
        insert: Any = pg_insert if dialect == "postgresql" else sqlite_insert
        greatest = sa.func.greatest if dialect == "postgresql" else sa.func.max
        now, interval = b("p_now", type_=sa.Double), b("p_interval", type_=sa.Double)
        reserve = insert(t.rate_limits).values(key=b("p_key"), next_free=now + interval)
        self.reserve = reserve.on_conflict_do_update(
            index_elements=[_limits.key],
            set_={"next_free": greatest(_limits.next_free, now) + interval},
        ).returning(_limits.next_free)
        hold = insert(t.rate_holds).values(
            message_id=b("p_message_id"),
            key=b("p_key"),
            slot=b("p_slot"),
            in_doubt=b("p_in_doubt"),
            give_backs=b("p_give_backs"),
            turn=0,
            at=b("p_at"),
        )
        self.hold = hold.on_conflict_do_update(
            index_elements=[_holds.message_id],
            set_={
                "key": hold.excluded.key,
                "slot": hold.excluded.slot,
                "in_doubt": hold.excluded.in_doubt,
                "give_backs": hold.excluded.give_backs,
                "turn": 0,
                "at": hold.excluded.at,
            },
        )
        self.take = (
            t.rate_holds.update()
            .where(_holds.message_id == b("p_message_id"))
            .values(turn=_holds.turn + 1)
            .returning(_holds.key, _holds.slot, _holds.in_doubt, _holds.give_backs, _holds.turn)
        )


_statements: dict[str, Statements] = {}


def statements(dialect: str) -> Statements:
    found = _statements.get(dialect)
    if found is None:
        found = _statements[dialect] = Statements(dialect)
    return found


class SqlRateLimits(SqlCore, RateLimits):
    """The rate limits of the database, and the slots held by given-back step messages."""

    def reserve_slot(self, key: str, interval: float, now: datetime) -> datetime:
        """One statement (an upsert), atomic by itself."""
        params = {"p_key": key, "p_now": _seconds(now), "p_interval": interval}
        with self._one_write() as conn:
            next_free = conn.execute(statements(self.dialect).reserve, params).scalar_one()
        return _datetime(float(next_free) - interval)

    def hold_slot(
        self,
        message_id: str,
        key: str,
        slot: datetime,
        *,
        in_doubt: bool,
        give_backs: int,
        now: datetime,
    ) -> None:
        """An upsert, its ``turn`` set to 0."""
        params = {
            "p_message_id": message_id,
            "p_key": key,
            "p_slot": _seconds(slot),
            "p_in_doubt": in_doubt,
            "p_give_backs": give_backs,
            "p_at": now,
        }
        with self._one_write() as conn:
            conn.execute(statements(self.dialect).hold, params)

    def take_held_slot(self, message_id: str) -> HeldSlot | None:
        """Adds 1 to the hold's ``turn``: the delivery that sees 1 follows the give-back."""
        take = statements(self.dialect).take
        with self._one_write() as conn:
            row = conn.execute(take, {"p_message_id": message_id}).first()
        if row is None:
            return None
        key, slot, in_doubt, give_backs, turn = row
        return HeldSlot(
            str(key), _datetime(float(slot)), bool(in_doubt), int(give_backs), turn == 1
        )


def prune(conn: Connection, before: datetime) -> int:
    """Delete the holds written before ``before`` (their messages were answered long ago)."""
    return int(conn.execute(t.rate_holds.delete().where(_holds.at < before)).rowcount)
