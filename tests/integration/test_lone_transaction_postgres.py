"""A lone transaction on PostgreSQL (``store.transaction(lone=True)``): when the checkpoint is
its first write, the checkpoint's one statement is the whole transaction, with no ``BEGIN``
and no ``COMMIT`` (a worker's reply: 2 round trips instead of 4); any other first write
begins a usual transaction, and nothing written after the statement can slip out of it."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import pytest
from sqlalchemy import event

from sagaloop.engine.messages import Envelope
from sagaloop.engine.ports import Checkpoint, Outgoing, Written
from sagaloop.store.sql import SqlStore

pytestmark = pytest.mark.integration

T0 = datetime(2030, 1, 2, tzinfo=UTC)


@pytest.fixture
def store(database: str) -> Iterator[SqlStore]:
    store = SqlStore(database)
    with store.transaction() as tx:
        tx.conn.exec_driver_sql("TRUNCATE sagaloop_inbox, sagaloop_outbox")
    yield store
    store.close()


class _Boom(Exception):
    pass


def _trips(store: SqlStore) -> list[str]:
    """The round trips of the store's transactions: each statement, and the ``BEGIN`` and
    ``COMMIT`` psycopg sends for a transaction that does not autocommit."""
    seen: list[str] = []

    def transaction(kind: str) -> Any:
        def listener(conn: Any, *_: Any) -> None:
            if conn.get_execution_options().get("isolation_level") != "AUTOCOMMIT":
                seen.append(kind)

        return listener

    event.listen(store.engine, "before_cursor_execute", lambda *a: seen.append(a[2].split()[0]))
    event.listen(store.engine, "begin", transaction("BEGIN"))
    event.listen(store.engine, "commit", transaction("COMMIT"))
    return seen


def _reply(message_id: str) -> Checkpoint:
    env = Envelope(type="step_result", message_id=f"r-{message_id}", run_id="run", created_at=T0)
    return Checkpoint(T0, ("worker", message_id, {"ok": 1}), messages=[Outgoing("replies", env)])


def _inbox(store: SqlStore, message_id: str) -> bool:
    return store.inbox_get(None, "worker", message_id)[0]


def test_a_lone_checkpoint_is_one_statement(store: SqlStore) -> None:
    trips = _trips(store)
    with store.transaction(lone=True) as tx:
        assert store.write_checkpoint(tx, _reply("m1")) is Written.WRITTEN
    # the rows nobody holds (no relay takes them in memory here) wake other processes' relays
    assert trips == ["WITH", "NOTIFY"], "the statement alone: no BEGIN, no COMMIT"
    assert _inbox(store, "m1") and store.queue_depths() == {"replies": 1}


def test_a_write_before_the_checkpoint_begins_a_transaction(store: SqlStore) -> None:
    """Both writes commit together, or neither does."""
    env = Envelope(type="event", message_id="e", run_id="run", created_at=T0)
    trips = _trips(store)
    with pytest.raises(_Boom), store.transaction(lone=True) as tx:
        store.enqueue(tx, [Outgoing("events", env)], T0)
        store.write_checkpoint(tx, _reply("m2"))
        raise _Boom
    assert trips[:1] == ["BEGIN"] and trips[-1] == "ROLLBACK", trips
    assert not _inbox(store, "m2") and store.queue_depths() == {}, "nothing committed"
    with store.transaction(lone=True) as tx:
        store.enqueue(tx, [Outgoing("events", env)], T0)
        store.write_checkpoint(tx, _reply("m2"))
    assert _inbox(store, "m2") and store.queue_depths() == {"events": 1, "replies": 1}


def test_no_write_after_a_lone_checkpoint(store: SqlStore) -> None:
    """The statement committed the transaction: a write after it would commit alone, so it
    is refused (the caller broke ``lone``'s promise)."""
    env = Envelope(type="event", message_id="e", run_id="run", created_at=T0)
    with pytest.raises(RuntimeError, match="no write after"), store.transaction(lone=True) as tx:
        store.write_checkpoint(tx, _reply("m3"))
        store.enqueue(tx, [Outgoing("events", env)], T0)
    assert _inbox(store, "m3") and store.queue_depths() == {"replies": 1}


def test_a_duplicate_lone_checkpoint_leaves_the_transaction_open(store: SqlStore) -> None:
    """A copy's checkpoint writes nothing (its reply is stored already): the worker then sends
    the stored reply again, in a transaction that begins with that write."""
    with store.transaction(lone=True) as tx:
        store.write_checkpoint(tx, _reply("m4"))
    trips = _trips(store)
    env = Envelope(type="step_result", message_id="again", run_id="run", created_at=T0)
    with pytest.raises(_Boom), store.transaction(lone=True) as tx:
        assert store.write_checkpoint(tx, _reply("m4")) is Written.DUPLICATE
        store.enqueue(tx, [Outgoing("replies", env)], T0)
        raise _Boom
    assert trips == ["WITH", "BEGIN", "INSERT", "ROLLBACK"], trips
    assert store.queue_depths() == {"replies": 1}, "the resend rolled back"
