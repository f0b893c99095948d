"""The deletes a checkpoint's one statement carries on PostgreSQL (``sagaloop.store.checkpoint``):
the published rows a relay left pending, and the row of the message being processed (an
in-process step's lane row), settled before the checkpoint, whose lost lease still discards
the attempt."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import event

from sagaloop.engine.messages import Envelope
from sagaloop.engine.ports import Checkpoint, Outgoing
from sagaloop.store.sql import SqlStore
from sagaloop.testing import services
from tests.unit.test_local_steps import a_lost_lease_discards_the_attempt

pytestmark = pytest.mark.integration

T0 = datetime(2030, 1, 2, tzinfo=UTC)
LEASE = timedelta(seconds=30)


@pytest.fixture
def database(postgres_url: str) -> Iterator[str]:
    """A database of this test's own, schema upgraded."""
    with services.migrated_database(postgres_url) as url:
        yield url


@pytest.fixture
def store(database: str) -> Iterator[SqlStore]:
    store = SqlStore(database)
    yield store
    store.close()


class _Rollback(Exception):
    pass


def _statements(store: SqlStore) -> list[str]:
    seen: list[str] = []
    event.listen(store.engine, "before_cursor_execute", lambda *a: seen.append(a[2]))
    return seen


def _deletes(statements: list[str]) -> list[str]:
    return [s for s in statements if s.lstrip().upper().startswith("DELETE")]


def test_a_lost_lease_discards_an_in_process_attempt(database: str) -> None:
    """The lane row's delete rides in the checkpoint's statement: no DELETE of its own."""
    statements = a_lost_lease_discards_the_attempt(database)
    fused = [s for s in statements if "sagaloop_inbox" in s and "DELETE FROM" in s]
    assert len(fused) == 1, "the checkpoint's statement carried the settle"
    assert _deletes(statements) == [], "no separate delete of the lane row"


def test_published_rows_are_deleted_by_the_next_checkpoint(store: SqlStore) -> None:
    """A relay's pending deletes ride in any transaction's checkpoint statement: no claim or
    ``delete_published`` transaction is needed; a checkpoint that rolls back leaves them
    pending, for the next one."""
    env = Envelope(type="event", message_id="m", run_id="r", created_at=T0)
    with store.transaction() as tx:
        store.enqueue(tx, [Outgoing("q", env)] * 3, T0)
    claimed = store.claim(["q"], 10, T0, LEASE)
    store.delete_later([m.id for m in claimed], claimed[0].claim_token)
    empty = Checkpoint(T0)
    with pytest.raises(_Rollback), store.transaction() as tx:
        store.write_checkpoint(tx, empty)
        raise _Rollback
    assert store.queue_depths() == {"q": 3}, "rolled back: the rows are there"
    statements = _statements(store)
    with store.transaction() as tx:
        store.write_checkpoint(tx, empty)
    assert len(statements) == 1 and _deletes(statements) == [], statements
    store.delete_published()
    assert len(statements) == 1, "nothing left pending: no transaction of its own"
    assert store.queue_depths() == {}, "deleted with the checkpoint"


def test_a_checkpoint_in_a_savepoint_carries_no_delete(store: SqlStore) -> None:
    """A transactional step's reply is written in a savepoint that is rolled back when a copy
    of its message stored its reply first: deletes carried there would be undone with it, so
    they wait for the commit (a settle) or stay pending (published rows)."""
    env = Envelope(type="event", message_id="m", run_id="r", created_at=T0)
    with store.transaction() as tx:
        store.enqueue(tx, [Outgoing("q", env)] * 2, T0)
    published, settled = store.claim(["q"], 10, T0, LEASE)
    store.delete_later([published.id], published.claim_token)
    with store.transaction() as tx:
        store.settle_claimed(tx, [settled.id], settled.claim_token, _Rollback())
        savepoint = tx.conn.begin_nested()
        store.write_checkpoint(tx, Checkpoint(T0))
        savepoint.rollback()
    assert store.queue_depths() == {"q": 1}, "the settle was made at the commit"
    store.delete_published()
    assert store.queue_depths() == {}, "the published row was still pending"
