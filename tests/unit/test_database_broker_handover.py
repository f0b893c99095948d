"""Issue 27: the database broker's own hand-over. A row that a transaction of this process
writes to a queue whose consumer waits here is written claimed by this process and given to
that consumer in memory after the commit, without a claim transaction (on SQLite, a write);
a row of a queue nobody waits for here stays unclaimed, for any process; a clean stop gives
back what was handed and not taken; a crash leaves it to the lease (or the takeover)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest

from sagaloop import Client, Roles, Service, Tuning
from sagaloop.brokers.database import DatabaseBroker, DatabaseDelivery, LeaseLostError
from sagaloop.engine.messages import Envelope
from sagaloop.engine.ports import Delivery, Outgoing
from sagaloop.runtime.connect import open_broker, open_store
from sagaloop.runtime.lane import Handoffs, LocalLane
from sagaloop.store.sql import SqlStore
from sagaloop.testing import VirtualClock, eventually
from tests.unit.test_database_broker_wakes import STEPS, app, claims_of, hops

LEASE = timedelta(seconds=30)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[SqlStore]:
    store = SqlStore(f"sqlite:///{tmp_path / 'handover.db'}")
    store.upgrade()
    yield store
    store.close()


def _write(store: SqlStore, clock: VirtualClock, queue: str, message_id: str) -> None:
    env = Envelope(type="event", message_id=message_id, run_id="r", created_at=clock.now())
    with store.transaction() as tx:
        store.enqueue(tx, [Outgoing(queue, env)], clock.now())


def _handing(store: SqlStore, clock: VirtualClock, poll: float = 0.05) -> DatabaseBroker:
    broker = DatabaseBroker(store, clock=clock, lease=LEASE, poll_interval=poll)
    store.hand_over_to(Handoffs(None, None, broker=broker))
    return broker


def test_a_waiting_consumer_takes_the_row_without_a_claim(store: SqlStore) -> None:
    """A row is handed over to a consumer waiting when it commits. The consumer looks only
    once here (its next turn to look is a minute away): with the default turns, 50 ms apart,
    a busy machine could commit while it looked between two waits, when no consumer waits
    and the row is, rightly, left for a claim (seen once in make test)."""
    clock = VirtualClock()
    broker, claims = _handing(store, clock, poll=60), claims_of(store)
    got: list[Delivery] = []
    consumer = threading.Thread(target=lambda: got.extend(broker.receive(["q"], 4, 30)))
    consumer.start()
    eventually(lambda: broker._waiting["q"] == 1, 10, "the consumer to wait")
    _write(store, clock, "q", "m-1")
    consumer.join(10)
    assert [Envelope.from_bytes(d.body).message_id for d in got] == ["m-1"]
    assert got[0].deliveries == 1
    assert claims.count == 0, "handed over in memory: no claim"
    assert store.claim(["q"], 10, clock.now(), LEASE) == [], "held: nobody else claims it"
    with store.transaction() as tx:
        got[0].settle(tx)
    assert store.queue_depths() == {}, "deleted by the transaction that settled it"


def test_rows_nobody_waits_for_here_stay_unclaimed(store: SqlStore) -> None:
    clock = VirtualClock()
    broker = _handing(store, clock)
    broker._waiting["q"] = 1  # one consumer of q waits: one run's rows, not two, are held
    _write(store, clock, "other", "m-1")
    with store.transaction() as tx:
        env = [Envelope(type="event", message_id=f"m-{i}", run_id=f"r-{i}") for i in (2, 3)]
        store.enqueue(tx, [Outgoing("q", e) for e in env], clock.now())
    claimed = store.claim(None, 10, clock.now(), LEASE)
    assert sorted(r.queue for r in claimed) == ["other", "q"]


def test_the_rows_of_one_run_on_one_queue_go_to_one_consumer_in_order(store: SqlStore) -> None:
    """A saga that starts a run and sends it an event: both rows are handed over together,
    so the consumer that takes the start takes the event after it (split, another consumer
    could process the event first, before the run exists)."""
    clock = VirtualClock()
    broker = _handing(store, clock)
    broker._waiting["q"] = 1
    with store.transaction() as tx:
        start = Envelope(type="start", message_id="s", run_id="kid", saga="x", payload={})
        go = Envelope(type="event", message_id="e", run_id="kid", payload={"name": "go"})
        store.enqueue(tx, [Outgoing("q", start), Outgoing("q", go)], clock.now())
    assert store.claim(["q"], 10, clock.now(), LEASE) == [], "both held, none left to claim"
    rows = broker._pop_handed(["q"], 16)
    assert [Envelope.from_bytes(r.body).message_id for r in rows] == ["s", "e"]


def test_the_steps_of_one_run_are_held_one_per_waiting_consumer(store: SqlStore) -> None:
    """A fan-out's steps have no order: one waiting consumer here holds one of them, the
    others stay for any process's consumers."""
    clock = VirtualClock()
    broker = _handing(store, clock)
    broker._waiting["q"] = 1
    with store.transaction() as tx:
        steps = [
            Envelope(type="step", message_id=f"s-{i}", run_id="r", payload={}) for i in range(3)
        ]
        store.enqueue(tx, [Outgoing("q", e) for e in steps], clock.now())
    assert len(store.claim(["q"], 10, clock.now(), LEASE)) == 2


def test_a_clean_stop_gives_back_what_was_not_taken(store: SqlStore) -> None:
    clock = VirtualClock()
    broker = _handing(store, clock)
    broker._waiting["q"] = 1  # waited, then stopped before taking it
    _write(store, clock, "q", "m-1")
    assert store.claim(["q"], 10, clock.now(), LEASE) == []
    broker.release_handed()
    assert [r.deliveries for r in store.claim(["q"], 10, clock.now(), LEASE)] == [2]


def test_a_row_held_by_a_dead_process_is_claimed_after_its_lease(store: SqlStore) -> None:
    """A crash: the row stays claimed until its lease runs out (or the takeover releases the
    claim of a process proven dead); then another consumer claims it, and the first's result,
    if it ever came, is refused."""
    clock = VirtualClock()
    broker = _handing(store, clock)
    broker._waiting["q"] = 1
    _write(store, clock, "q", "m-1")
    handed = broker._pop_handed(["q"], 1)
    clock.advance(LEASE + timedelta(seconds=1))
    assert [r.deliveries for r in store.claim(["q"], 10, clock.now(), LEASE)] == [2]
    with pytest.raises(LeaseLostError), store.transaction() as tx:
        DatabaseDelivery(broker, handed[0]).settle(tx)  # the first holder's, late


def test_a_run_on_the_embedded_default_claims_almost_never(tmp_path: Path) -> None:
    """``sagaloop dev``'s assembly: each step's row and each result's is handed over (2.1
    claims per step were measured before the hand-over; a claim now comes only from a wake
    that raced with a hand-over, or a row committed while its consumer was still busy: on
    an idle machine none or one a run, under a load of 9 up to 0.8 per step)."""
    store = open_store(f"sqlite:///{tmp_path / 'dev.db'}", upgrade=True)
    broker = open_broker("database", store)
    claims = claims_of(store)
    tuning = Tuning(concurrency=4, poll=0.1)  # sagaloop dev's
    service = Service(app, store, broker, roles=Roles(), tuning=tuning).start()
    try:
        client = Client(store, app)
        client.result(client.start(hops, 1), timeout=60)
        before = claims.count
        assert client.result(client.start(hops, STEPS), timeout=60) == STEPS
        assert claims.count - before <= STEPS, f"{claims.count - before} claims"
    finally:
        service.stop()
    assert store.queue_depths() == {}, "nothing left behind, claimed or not"
    store.close()


def test_a_row_held_past_half_its_lease_is_extended_or_dropped(store: SqlStore) -> None:
    """Consumers busy for half the lease: a held row's claim is extended before it is taken;
    if it was lost meanwhile (the lease ran out and another consumer claimed it), the row is
    dropped from memory, not run twice."""
    clock, lease = VirtualClock(), timedelta(milliseconds=40)
    broker = DatabaseBroker(store, clock=clock, lease=lease)
    store.hand_over_to(Handoffs(None, None, broker=broker))
    broker._waiting["q"] = 1
    _write(store, clock, "q", "m-1")
    clock.advance(timedelta(milliseconds=30))  # past half the lease, within it
    taken = broker._pop_handed(["q"], 1)
    assert [r.deliveries for r in taken] == [1], "extended, taken"
    with store.transaction() as tx:
        DatabaseDelivery(broker, taken[0]).settle(tx)
    _write(store, clock, "q", "m-2")
    clock.advance(timedelta(seconds=1))
    assert [r.deliveries for r in store.claim(["q"], 10, clock.now(), LEASE)] == [2]
    assert broker._pop_handed(["q"], 1) == [], "its claim was lost: dropped"


# --- the in-process lane: the same hand-over, applied to one queue whose rows are always held


def _lane(store: SqlStore, clock: VirtualClock) -> LocalLane:
    lane = LocalLane(store, "a", clock=clock, lease=LEASE)
    store.hand_over_to(Handoffs(lane, None, owner="p1"))  # its claims' tokens: "p1.…"
    return lane


def test_the_lane_holds_its_rows_with_nobody_waiting(store: SqlStore) -> None:
    """Unlike a broker queue's, a lane row is written claimed even when no thread of the lane
    waits (none does here): the lane serves its rows first, another engine only after."""
    clock = VirtualClock()
    lane, claims = _lane(store, clock), claims_of(store)
    _write(store, clock, lane.queue, "m-1")
    assert store.claim([lane.queue], 10, clock.now(), LEASE) == [], "held by this process"
    before = claims.count
    assert [d.deliveries for d in lane.receive([lane.queue], 4, 0)] == [1]
    assert claims.count == before, "taken from memory, without a claim"


def test_a_lane_row_held_past_half_its_lease_is_taken_with_its_claim_extended(
    store: SqlStore,
) -> None:
    """Every thread of the lane busy for most of the lease: the row is taken with its claim
    extended (on the lane's clock, the clock of the claim's deadline), so that no other
    engine runs the step while this one does. The lane used to drop it, leaving the step to
    wait out its claim, and read its age on ``time.monotonic()`` beside a deadline on
    ``clock``."""
    clock = VirtualClock()
    lane = _lane(store, clock)
    _write(store, clock, lane.queue, "m-1")
    clock.advance(LEASE * 3 / 4)  # past half the lease, within it
    (taken,) = lane.receive([lane.queue], 1, 0)
    assert taken.deliveries == 1, "the row handed over, not claimed again"
    clock.advance(LEASE / 2)  # past the first claim's deadline, within the extended one
    assert store.claim([lane.queue], 10, clock.now(), LEASE) == [], "its claim was extended"
    with store.transaction() as tx:
        taken.settle(tx)
    assert store.queue_depths() == {}


def test_a_lane_row_whose_claim_was_released_while_held_is_claimed_again(
    store: SqlStore,
) -> None:
    """A held lane row whose claim was lost (a takeover released it, believing this process
    dead) is not run from memory: the lane claims it again from the database, as any engine
    of the app could, so that only one attempt's result counts."""
    clock = VirtualClock()
    lane = _lane(store, clock)
    _write(store, clock, lane.queue, "m-1")
    clock.advance(LEASE * 3 / 4)
    assert [r.queue for r in store.take_over("p1", "p1")] == [lane.queue]
    assert [d.deliveries for d in lane.receive([lane.queue], 1, 0)] == [2]
