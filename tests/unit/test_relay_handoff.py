"""The relay's hand-over: the rows a transaction of this process wrote are published from memory
right after the commit, and nobody else publishes them meanwhile; the sweep takes what nobody
holds, and deletes the rows published since the last one."""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from sagaloop.brokers.memory import MemoryBroker
from sagaloop.engine.messages import Envelope
from sagaloop.engine.ports import Outgoing
from sagaloop.runtime.relay import Relay
from sagaloop.store.sql import SqlStore
from sagaloop.testing import VirtualClock

QUEUE = "app.engine"


@pytest.fixture
def store(tmp_path: Path) -> Iterator[SqlStore]:
    store = SqlStore(f"sqlite:///{tmp_path / 'relay.db'}")
    store.upgrade()
    yield store
    store.close()


def _message(i: int, clock: VirtualClock) -> Outgoing:
    env = Envelope(type="event", message_id=f"m-{i}", run_id="r", created_at=clock.now())
    return Outgoing(QUEUE, env)


def _write(store: SqlStore, clock: VirtualClock, *ids: int) -> None:
    with store.transaction() as tx:
        store.enqueue(tx, [_message(i, clock) for i in ids], clock.now())


def _received(broker: MemoryBroker) -> list[str]:
    out = []
    for delivery in broker.receive([QUEUE], 100, 0):
        out.append(Envelope.from_bytes(delivery.body).message_id)
        delivery.ack()
    return out


def test_rows_are_handed_over_and_a_sweep_leaves_them_alone(store: SqlStore) -> None:
    clock, broker = VirtualClock(), MemoryBroker()
    relay = Relay(store, broker, clock=clock)
    store.hand_over_to(relay)
    _write(store, clock, 1, 2)
    assert relay.relay_once() == 0, "held by this relay: a sweep does not take them"
    assert relay.send_handed() == 2
    assert _received(broker) == ["m-1", "m-2"]
    _write(store, clock, 3)
    assert store.queue_depths() == {QUEUE: 3}, "not deleted on the hot path"
    assert relay.send_handed() == 1
    assert relay.relay_once() == 0
    assert store.queue_depths() == {}, "the sweep deleted the published rows"
    assert _received(broker) == ["m-3"]
    _write(store, clock, 4)
    assert relay.send_handed() == 1
    store.delete_published()  # at stop
    assert store.queue_depths() == {}


def test_rows_of_a_dead_relay_are_swept_once_their_claim_runs_out(store: SqlStore) -> None:
    clock, broker = VirtualClock(), MemoryBroker()
    dead = Relay(store, broker, clock=clock)
    store.hand_over_to(dead)
    _write(store, clock, 1)  # committed, handed over, never published: the process died
    store.hand_over_to(None)
    survivor = Relay(store, broker, clock=clock)
    assert survivor.relay_once() == 0
    clock.advance(dead.handoff_lease + timedelta(milliseconds=1))
    assert survivor.relay_once() == 1
    assert _received(broker) == ["m-1"]


def test_a_row_held_too_long_in_memory_is_left_to_the_sweep(store: SqlStore) -> None:
    clock, broker = VirtualClock(), MemoryBroker()
    relay = Relay(store, broker, clock=clock, lease=timedelta(milliseconds=200))
    assert relay.handoff_lease == timedelta(milliseconds=200), "never longer than the lease"
    store.hand_over_to(relay)
    _write(store, clock, 1)
    time.sleep(0.15)  # past half the lease: another relay may be sweeping it soon
    assert relay.send_handed() == 0
    clock.advance(relay.handoff_lease + timedelta(milliseconds=1))
    assert relay.relay_once() == 1, "published once, by the sweep"
    assert _received(broker) == ["m-1"]


def test_rows_of_an_attached_transaction_are_not_handed_over(store: SqlStore) -> None:
    clock, broker = VirtualClock(), MemoryBroker()
    relay = Relay(store, broker, clock=clock)
    store.hand_over_to(relay)
    with store.engine.begin() as conn:  # the caller's own transaction, committed by the caller
        store.enqueue(store.attach(conn), [_message(1, clock)], clock.now())
    assert relay.send_handed() == 0
    assert relay.relay_once() == 1, "swept at once: nobody holds it"
    assert _received(broker) == ["m-1"]


def test_the_sweep_deletes_what_a_relay_published_in_one_statement(store: SqlStore) -> None:
    """Rows handed over and published one transaction at a time share the relay's token: the
    next sweep deletes all of them with one DELETE, not one per publish."""
    from sqlalchemy import event

    clock, broker = VirtualClock(), MemoryBroker()
    relay = Relay(store, broker, clock=clock)
    store.hand_over_to(relay)
    for i in range(5):
        _write(store, clock, i)
        assert relay.send_handed() == 1
    deletes: list[str] = []

    def seen(conn: object, cursor: object, statement: str, *args: object) -> None:
        if statement.lstrip().upper().startswith("DELETE"):
            deletes.append(statement)

    event.listen(store.engine, "before_cursor_execute", seen)
    assert relay.relay_once() == 0
    assert len(deletes) == 1 and store.queue_depths() == {}


def test_an_idle_sweep_and_an_idle_timer_poll_are_one_read_each(
    store: SqlStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Polling while nothing is to be done costs one statement each, a read (each process
    polls every ``--poll`` seconds, idle or not): no write transaction (on PostgreSQL, a
    ``BEGIN``, the claim's ``SELECT ... FOR UPDATE`` and a ``COMMIT``: three round trips)."""
    from sagaloop import App
    from sagaloop.runtime.consumers import TimerScheduler

    clock, broker = VirtualClock(), MemoryBroker()
    relay = Relay(store, broker, clock=clock)
    timers = TimerScheduler(App("idle"), store, clock)
    opened: list[int] = []
    transaction = store.transaction

    def counted() -> Any:
        opened.append(1)
        return transaction()

    monkeypatch.setattr(store, "transaction", counted)
    assert relay.relay_once() == 0 and timers.fire_due() == 0
    assert opened == []
    _write(store, clock, 1)  # written by another process: nothing holds it
    opened.clear()
    assert relay.relay_once() == 1 and len(opened) == 1, "found by the look, then claimed"


class _LaterBroker(MemoryBroker):
    """A memory broker that also publishes without waiting, as RabbitMQ's does: the batch is
    delivered at once and its confirm (``then``) waits until the test calls ``confirm``."""

    def __init__(self, *, down: bool = False) -> None:
        super().__init__()
        self.down = down
        self.pending: list[tuple[list[tuple[str, bytes]], Any]] = []
        self.threads: list[str] = []

    def publish_later(self, batch: Any, then: Any) -> None:
        import threading

        from sagaloop.errors import BrokerError

        if self.down:
            raise BrokerError("not connected")
        self.threads.append(threading.current_thread().name)
        self.publish(batch)
        self.pending.append((list(batch), then))

    def confirm(self, error: Exception | None = None) -> None:
        for _, then in self.pending:
            then(error)
        self.pending.clear()


def test_the_committing_thread_publishes_its_rows_and_the_confirm_marks_them_published(
    store: SqlStore,
) -> None:
    """With a broker that publishes without waiting, the rows leave with the commit, from the
    thread that committed (no hop through the relay's thread); they are deleted only once the
    broker confirmed them."""
    import threading

    clock, broker = VirtualClock(), _LaterBroker()
    relay = Relay(store, broker, clock=clock)
    store.hand_over_to(relay)
    _write(store, clock, 1, 2)
    assert broker.threads == [threading.current_thread().name]
    assert _received(broker) == ["m-1", "m-2"], "published with the commit"
    assert relay.send_handed() == 0, "nothing left for the relay's thread"
    assert relay.settle(0) is False, "a confirm is awaited"
    assert relay.relay_once() == 0
    assert store.queue_depths() == {QUEUE: 2}, "not deleted before the broker confirmed"
    broker.confirm()
    assert relay.settle(0) is True
    assert relay.relay_once() == 0
    assert store.queue_depths() == {}, "deleted by the sweep once confirmed"


def test_a_batch_that_fails_without_waiting_goes_to_the_relays_thread(store: SqlStore) -> None:
    """A refused batch (say, the connection was lost before its confirms) is published again by
    the relay's thread, the usual way; so is one the broker could not take at all."""
    from sagaloop.errors import BrokerError

    clock, broker = VirtualClock(), _LaterBroker()
    relay = Relay(store, broker, clock=clock)
    store.hand_over_to(relay)
    _write(store, clock, 1)
    assert _received(broker) == ["m-1"]
    broker.confirm(BrokerError("the connection to RabbitMQ was lost before confirms"))
    assert relay.settle(0) is True
    assert relay.send_handed() == 1, "published again by the relay's thread"
    assert _received(broker) == ["m-1"], "a duplicate publish, which consumers deduplicate"
    broker.down = True
    _write(store, clock, 2)
    assert _received(broker) == [] and relay.settle(0) is True
    assert relay.send_handed() == 1
    assert _received(broker) == ["m-2"]
    assert relay.relay_once() == 0
    assert store.queue_depths() == {}
