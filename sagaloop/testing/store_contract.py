"""The store contract suite: the behaviour every :class:`~sagaloop.engine.ports.Store` must
show, written once and run against each implementation (SQLite, PostgreSQL, and yours).

Run it by subclassing :class:`StoreContract` in a test module under a name that starts with
``Test`` and providing a ``store`` fixture that returns a fresh store, schema upgraded::

    import pytest
    from sagaloop.store.sql import SqlStore
    from sagaloop.testing.store_contract import StoreContract

    class TestMyStore(StoreContract):
        @pytest.fixture
        def store(self, tmp_path):
            store = SqlStore("sqlite:///" + str(tmp_path / "db.sqlite"))
            store.upgrade()
            yield store
            store.close()

"Fresh" means empty: some operations are global (``take_due_timers``, ``claim`` of every
queue, ``prune``, ``count_runs``), so each test must start with no runs, timers, inbox or
outbox rows. The store must be safe to use from several threads at once, each thread with its
own transactions, as several engine processes would.

Several tests are races: threads start together on a barrier, and a store that does not
serialize or skip locked rows produces duplicates, lost updates or errors. One test measures
that a second transaction on a run starts its critical section only after the first committed;
:attr:`StoreContract.hold` is how long the first one holds the run.

The assertions carry their own messages; call
``pytest.register_assert_rewrite("sagaloop.testing.store_contract")`` in a ``conftest.py`` for
more detail.
"""

from __future__ import annotations

import itertools
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from datetime import UTC, datetime, timedelta, timezone
from typing import Any, TypeVar

import pytest

from sagaloop.engine.history import NewEvent
from sagaloop.engine.messages import MAX_MESSAGE_BYTES, Envelope, local_queue
from sagaloop.engine.ports import Outgoing, QueuedMessage, RunRecord, Store, Timer
from sagaloop.errors import MessageError, StoreError, TransientStoreError

__all__ = ["StoreContract"]

T = TypeVar("T")

T0 = datetime(2030, 1, 2, 3, 4, 5, 678901, tzinfo=UTC)
"""The virtual "now" of the tests (claims and timers take the time as an argument)."""
LEASE = timedelta(seconds=30)
FAR = T0 + timedelta(days=3650)


class _Rollback(Exception):
    """Raised inside a store transaction to roll it back."""


def _id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


def _in_threads(fns: Sequence[Callable[[], T]], timeout: float) -> list[T]:
    """Run each function in its own thread, started together; their results in order. The
    first exception of any thread is raised here."""
    barrier = threading.Barrier(len(fns))
    results: list[Any] = [None] * len(fns)
    errors: list[BaseException] = []

    def run(i: int, fn: Callable[[], T]) -> None:
        try:
            barrier.wait(timeout)
            results[i] = fn()
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i, fn), daemon=True) for i, fn in enumerate(fns)]
    for th in threads:
        th.start()
    deadline = time.monotonic() + timeout
    for th in threads:
        th.join(max(0.0, deadline - time.monotonic()))
    assert not any(th.is_alive() for th in threads), f"threads still running after {timeout} s"
    if errors:
        raise errors[0]
    return results


class StoreContract:
    """The contract tests. Subclass it as ``TestXxx`` and provide a ``store`` fixture."""

    hold: float = 0.3
    """Real seconds a transaction holds a lock while a concurrent one must wait."""
    thread_timeout: float = 30.0
    """Real seconds a concurrent test may take before it fails."""

    # --- helpers -----------------------------------------------------------------------------

    @staticmethod
    def new_run(
        store: Store,
        *,
        saga: str = "contract",
        status: str = "running",
        at: datetime = T0,
        run_id: str | None = None,
        app: str = "app",
    ) -> RunRecord:
        run = RunRecord(run_id or _id("run"), app, saga, status, {"n": 1}, at, at)
        with store.transaction() as tx:
            assert store.create_run(tx, run), "create_run of a new id must return True"
        return run

    @staticmethod
    def message(queue: str, n: int = 0, available_at: datetime | None = None) -> Outgoing:
        env = Envelope(type="step", run_id=f"run-{n}", payload={"n": n, "text": "é✓"})
        return Outgoing(queue, env, available_at)

    def enqueue(self, store: Store, queue: str, n: int, at: datetime = T0) -> list[bytes]:
        """Put ``n`` messages on ``queue``; their bodies, in order."""
        messages = [self.message(queue, i) for i in range(n)]
        with store.transaction() as tx:
            store.enqueue(tx, messages, at)
        return [m.envelope.to_bytes() for m in messages]

    @staticmethod
    def drain_timers(store: Store, now: datetime = FAR) -> list[Timer]:
        with store.transaction() as tx:
            return store.take_due_timers(tx, now, 1000)

    # --- runs --------------------------------------------------------------------------------

    def test_create_run_is_idempotent(self, store: Store) -> None:
        first = RunRecord(_id("run"), "app", "saga-a", "running", {"x": [1, "é"]}, T0, T0)
        with store.transaction() as tx:
            assert store.create_run(tx, first) is True
            again = RunRecord(first.run_id, "app", "saga-b", "failed", {"y": 2}, FAR, FAR)
            assert store.create_run(tx, again) is False, "same id in the same transaction"
        with store.transaction() as tx:
            assert store.create_run(tx, again) is False, "same id in a later transaction"
        got = store.get_run(first.run_id)
        assert got is not None
        assert (got.saga, got.status, got.input) == ("saga-a", "running", {"x": [1, "é"]}), (
            "a duplicate create_run must not change the existing run"
        )
        assert got.created_at == T0 and got.created_at.utcoffset() == timedelta(0)
        assert store.get_run(_id("missing")) is None

    def test_concurrent_create_run_inserts_once(self, store: Store) -> None:
        run_id = _id("run")

        def start(i: int) -> Callable[[], bool]:
            def go() -> bool:
                with store.transaction() as tx:
                    run = RunRecord(run_id, "app", "contract", "running", {"starter": i}, T0, T0)
                    inserted = store.create_run(tx, run)
                    time.sleep(0.05)  # keep the transaction open while the others try
                    return inserted

            return go

        results = _in_threads([start(i) for i in range(8)], self.thread_timeout)
        assert sum(results) == 1, f"8 concurrent create_run of one id inserted {sum(results)}"
        got = store.get_run(run_id)
        assert got is not None and got.input == {"starter": results.index(True)}, (
            "the run must be the one whose create_run returned True"
        )

    def test_save_run_round_trips(self, store: Store) -> None:
        run = self.new_run(store)
        later = T0 + timedelta(minutes=5)
        with store.transaction() as tx:
            locked = store.lock_run(tx, run.run_id)
            assert locked is not None and locked.run_id == run.run_id
            locked.status = "failed"
            locked.output = {"answer": 42.5, "items": [None, True]}
            locked.error = {"type": "Boom", "message": "ünïcode"}
            locked.reason = "why not"
            locked.last_seq, locked.processed_seq = 7, 5
            locked.updated_at = later.astimezone(timezone(timedelta(hours=-3)))
            store.save_run(tx, locked)
        got = store.get_run(run.run_id)
        assert got is not None
        assert (got.status, got.output, got.error, got.reason) == (
            "failed",
            {"answer": 42.5, "items": [None, True]},
            {"type": "Boom", "message": "ünïcode"},
            "why not",
        )
        assert (got.last_seq, got.processed_seq) == (7, 5)
        assert got.created_at == T0, "save_run must not change created_at"
        assert got.updated_at == later and got.updated_at.utcoffset() == timedelta(0), (
            "timestamps come back as aware UTC datetimes of the same instant"
        )
        with store.transaction() as tx:
            assert store.lock_run(tx, _id("missing")) is None

    def test_list_runs_and_count_runs_filter(self, store: Store) -> None:
        a_run = self.new_run(store, saga="a", at=T0 + timedelta(seconds=1))
        a_done = self.new_run(store, saga="a", status="completed", at=T0 + timedelta(seconds=2))
        b_run = self.new_run(store, saga="b", at=T0 + timedelta(seconds=3))
        b_fail = self.new_run(store, saga="b", status="failed", at=T0 + timedelta(seconds=4))

        def ids(runs: list[RunRecord]) -> list[str]:
            return [r.run_id for r in runs]

        newest_first = [b_fail.run_id, b_run.run_id, a_done.run_id, a_run.run_id]
        assert ids(store.list_runs()) == newest_first, "most recently updated first"
        assert ids(store.list_runs(status="running")) == [b_run.run_id, a_run.run_id]
        assert ids(store.list_runs(saga="a")) == [a_done.run_id, a_run.run_id]
        assert ids(store.list_runs(saga="b", status="failed")) == [b_fail.run_id]
        assert ids(store.list_runs(saga="a", status="failed")) == []
        assert ids(store.list_runs(limit=2)) == newest_first[:2]
        assert store.count_runs() == {"running": 2, "completed": 1, "failed": 1}
        assert store.count_runs(saga="b") == {"running": 1, "failed": 1}
        assert store.count_runs(saga="nobody") == {}

    def test_lock_run_serializes_transactions_on_a_run(self, store: Store) -> None:
        run = self.new_run(store)
        locked = threading.Event()
        marks: dict[str, float] = {}

        def increment(r: RunRecord) -> None:
            r.last_seq += 1
            r.updated_at = T0 + timedelta(seconds=r.last_seq)

        def first() -> None:
            with store.transaction() as tx:
                r = store.lock_run(tx, run.run_id)
                assert r is not None
                locked.set()
                time.sleep(self.hold)  # the critical section, while the second one waits
                increment(r)
                store.save_run(tx, r)
                marks["first_end"] = time.monotonic()

        def second() -> None:
            assert locked.wait(self.thread_timeout), "the first transaction never locked the run"
            with store.transaction() as tx:
                r = store.lock_run(tx, run.run_id)
                assert r is not None
                marks["second_start"] = time.monotonic()
                increment(r)
                store.save_run(tx, r)

        _in_threads([first, second], self.thread_timeout)
        early = marks["first_end"] - marks["second_start"]
        assert early <= 0, (
            f"the second transaction locked the run {early:.3f} s before the first committed"
        )
        got = store.get_run(run.run_id)
        last_seq = got.last_seq if got else None
        assert last_seq == 2, (
            f"two read-modify-write transactions under lock_run left last_seq={last_seq}"
            " (a lost update)"
        )

    # --- history -----------------------------------------------------------------------------

    def test_append_events_assigns_gap_free_seq(self, store: Store) -> None:
        run = self.new_run(store)
        with store.transaction() as tx:
            first = store.append_events(
                tx, run.run_id, 0, [NewEvent("a"), NewEvent("b", 1), NewEvent("c", 2, "n")], T0
            )
        with store.transaction() as tx:
            second = store.append_events(tx, run.run_id, 3, [NewEvent("d"), NewEvent("e")], T0)
            assert store.append_events(tx, run.run_id, 5, [], T0) == []
        assert [e.seq for e in first] == [1, 2, 3]
        assert [e.seq for e in second] == [4, 5]
        loaded = store.load_history(None, run.run_id)
        assert [(e.seq, e.kind) for e in loaded] == [
            (1, "a"),
            (2, "b"),
            (3, "c"),
            (4, "d"),
            (5, "e"),
        ]
        assert (loaded[2].pos, loaded[2].name) == (2, "n")

    def test_append_at_a_used_seq_fails_and_rolls_back_the_transaction(self, store: Store) -> None:
        run = self.new_run(store)
        other = self.new_run(store)
        queue = _id("q")
        with store.transaction() as tx:
            store.append_events(tx, run.run_id, 0, [NewEvent("a", data={"v": 1})], T0)
            store.append_events(tx, run.run_id, 1, [NewEvent("b", data={"v": 2})], T0)
        with pytest.raises(StoreError) as info, store.transaction() as tx:
            store.append_events(tx, other.run_id, 0, [NewEvent("x")], T0)
            assert store.inbox_put(tx, "contract", "m-1", None, T0)
            store.add_timer(tx, Timer(other.run_id, 1, "sleep", T0))
            store.enqueue(tx, [self.message(queue)], T0)
            locked = store.lock_run(tx, run.run_id)
            assert locked is not None
            locked.status = "failed"
            store.save_run(tx, locked)
            store.append_events(tx, run.run_id, 1, [NewEvent("racer", data={"v": 3})], T0)
        assert not isinstance(info.value, TransientStoreError), (
            "a primary-key violation is not worth retrying as is"
        )
        assert info.value.__cause__ is not None, "the driver error must be the __cause__"
        history = store.load_history(None, run.run_id)
        assert [(e.seq, e.kind, e.data) for e in history] == [
            (1, "a", {"v": 1}),
            (2, "b", {"v": 2}),
        ], "the conflicting append must not change the history"
        assert store.load_history(None, other.run_id) == [], "the whole transaction rolls back"
        got = store.get_run(run.run_id)
        assert got is not None and got.status == "running", "save_run was rolled back"
        with store.transaction() as tx:
            assert store.inbox_get(tx, "contract", "m-1") == (False, None), "inbox rolled back"
        assert self.drain_timers(store) == [], "add_timer was rolled back"
        assert store.claim([queue], 10, FAR, LEASE) == [], "enqueue was rolled back"

    def test_load_history_after_seq_returns_later_events_intact(self, store: Store) -> None:
        run = self.new_run(store)
        at = datetime(2031, 6, 7, 8, 9, 10, 123456, tzinfo=timezone(timedelta(hours=2)))
        data = [
            {"i": i, "nested": {"list": [1, 2.5, None, True], "text": f"ünï {i} ✓"}}
            for i in range(6)
        ]
        with store.transaction() as tx:
            store.append_events(
                tx, run.run_id, 0, [NewEvent("k", i, f"n{i}", d) for i, d in enumerate(data)], at
            )
        for tx_given in (False, True):
            if tx_given:
                with store.transaction() as tx:
                    later = store.load_history(tx, run.run_id, after_seq=2)
            else:
                later = store.load_history(None, run.run_id, after_seq=2)
            assert [e.seq for e in later] == [3, 4, 5, 6], "only events after after_seq, in order"
            assert [e.data for e in later] == data[2:]
            assert [(e.pos, e.name) for e in later] == [(i, f"n{i}") for i in range(2, 6)]
            for e in later:
                assert e.at == at, f"{e.at!r} is not the instant {at!r}"
                assert e.at.utcoffset() == timedelta(0), f"{e.at!r} is not aware UTC"
        assert store.load_history(None, run.run_id, after_seq=6) == []
        assert store.load_history(None, _id("missing")) == []

    # --- timers ------------------------------------------------------------------------------

    def test_add_timer_replaces_the_same_run_pos_and_kind(self, store: Store) -> None:
        run = self.new_run(store)
        with store.transaction() as tx:
            store.add_timer(tx, Timer(run.run_id, 1, "retry", T0 + timedelta(hours=1), 1))
            store.add_timer(tx, Timer(run.run_id, 1, "retry", T0 + timedelta(hours=2), 2))
            store.add_timer(tx, Timer(run.run_id, 1, "sleep", T0 + timedelta(hours=3)))
            store.add_timer(tx, Timer(run.run_id, 2, "retry", T0 + timedelta(hours=4)))
        with store.transaction() as tx:
            store.add_timer(tx, Timer(run.run_id, 2, "retry", T0 + timedelta(hours=5), 7))
        assert store.next_timer_at() == T0 + timedelta(hours=2)
        taken = self.drain_timers(store)
        assert [(x.pos, x.kind, x.fire_at, x.attempt) for x in taken] == [
            (1, "retry", T0 + timedelta(hours=2), 2),
            (1, "sleep", T0 + timedelta(hours=3), 0),
            (2, "retry", T0 + timedelta(hours=5), 7),
        ], "one timer per (run, pos, kind), the last one set, earliest first"
        assert all(x.run_id == run.run_id for x in taken)

    def test_take_due_timers_returns_only_due_ones_and_deletes_them(self, store: Store) -> None:
        run = self.new_run(store)
        fire = [T0 - timedelta(minutes=2), T0 - timedelta(minutes=1), T0, T0 + timedelta(seconds=1)]
        with store.transaction() as tx:
            for pos, at in reversed(list(enumerate(fire))):
                store.add_timer(tx, Timer(run.run_id, pos, "sleep", at))
        with store.transaction() as tx:
            first = store.take_due_timers(tx, T0, 2)
        assert [x.pos for x in first] == [0, 1], "earliest first, at most limit"
        assert first[0].fire_at == fire[0] and first[0].fire_at.utcoffset() == timedelta(0)
        with store.transaction() as tx:
            assert [x.pos for x in store.take_due_timers(tx, T0, 10)] == [2], "due at now counts"
        with store.transaction() as tx:
            assert store.take_due_timers(tx, T0, 10) == [], "taken timers are deleted"
        assert store.next_timer_at() == fire[3]
        with pytest.raises(_Rollback), store.transaction() as tx:
            assert [x.pos for x in store.take_due_timers(tx, FAR, 10)] == [3]
            raise _Rollback
        assert [x.pos for x in self.drain_timers(store)] == [3], "a rolled back take keeps it"
        assert store.next_timer_at() is None

    def test_timers_belong_to_the_app_of_their_run(self, store: Store) -> None:
        a, b = self.new_run(store, app="app-a"), self.new_run(store, app="app-b")
        with store.transaction() as tx:
            store.add_timer(tx, Timer(a.run_id, 1, "sleep", T0 + timedelta(minutes=1)))
            store.add_timer(tx, Timer(b.run_id, 1, "sleep", T0))
            store.add_timer(tx, Timer(b.run_id, 2, "wait", T0 + timedelta(minutes=2)))
        assert store.next_timer_at(app="app-a") == T0 + timedelta(minutes=1)
        assert store.next_timer_at(app="app-b") == T0
        assert store.next_timer_at(app="app-c") is None
        assert store.next_timer_at() == T0, "without an app: every app's"
        with store.transaction() as tx:
            mine = store.take_due_timers(tx, FAR, 10, app="app-a")
        assert [(x.run_id, x.pos, x.app) for x in mine] == [(a.run_id, 1, "app-a")], (
            "an app takes only the timers of its own runs"
        )
        with store.transaction() as tx:
            theirs = store.take_due_timers(tx, FAR, 10, app="app-b")
        assert [(x.run_id, x.pos, x.app) for x in theirs] == [
            (b.run_id, 1, "app-b"),
            (b.run_id, 2, "app-b"),
        ]
        assert self.drain_timers(store) == []

    def test_delete_timers_of_a_run(self, store: Store) -> None:
        keep, drop = self.new_run(store), self.new_run(store)
        with store.transaction() as tx:
            for run in (keep, drop):
                store.add_timer(tx, Timer(run.run_id, 1, "sleep", T0))
                store.add_timer(tx, Timer(run.run_id, 2, "wait", T0))
        with store.transaction() as tx:
            store.delete_timers(tx, drop.run_id)
        assert {(x.run_id, x.pos) for x in self.drain_timers(store)} == {
            (keep.run_id, 1),
            (keep.run_id, 2),
        }

    def test_concurrent_timer_takers_get_disjoint_sets(self, store: Store) -> None:
        run = self.new_run(store)
        n = 12
        with store.transaction() as tx:
            for pos in range(n):
                store.add_timer(tx, Timer(run.run_id, pos, "sleep", T0 - timedelta(seconds=pos)))
        taken = threading.Event()

        def slow() -> list[Timer]:
            with store.transaction() as tx:
                mine = store.take_due_timers(tx, T0, n // 3)
                taken.set()
                time.sleep(self.hold)  # hold the taken rows, uncommitted
                return mine

        def fast() -> list[Timer]:
            assert taken.wait(self.thread_timeout)
            with store.transaction() as tx:
                return store.take_due_timers(tx, T0, n)

        a, b = _in_threads([slow, fast], self.thread_timeout)
        pa, pb = [x.pos for x in a], [x.pos for x in b]
        assert len(pa) == n // 3
        assert not set(pa) & set(pb), f"both takers got timers {sorted(set(pa) & set(pb))}"
        assert sorted(pa + pb) == list(range(n)), "together they took every due timer"
        assert self.drain_timers(store) == []

    # --- inbox -------------------------------------------------------------------------------

    def test_inbox_put_once_per_key_and_get_returns_the_result(self, store: Store) -> None:
        result = {"reply": ["a", 1, None], "text": "ü"}
        with store.transaction() as tx:
            assert store.inbox_get(tx, "worker", "m-1") == (False, None)
            assert store.inbox_put(tx, "worker", "m-1", result, T0) is True
            assert store.inbox_put(tx, "worker", "m-1", {"other": 1}, T0) is False
        with store.transaction() as tx:
            assert store.inbox_put(tx, "worker", "m-1", {"other": 2}, T0) is False
            assert store.inbox_get(tx, "worker", "m-1") == (True, result), "the first result"
            assert store.inbox_put(tx, "engine", "m-1", None, T0) is True, "keys are per consumer"
            assert store.inbox_get(tx, "engine", "m-1") == (True, None)

    def test_concurrent_inbox_put_records_once(self, store: Store) -> None:
        def put(i: int) -> Callable[[], bool]:
            def go() -> bool:
                with store.transaction() as tx:
                    inserted = store.inbox_put(tx, "engine", "m-race", {"by": i}, T0)
                    time.sleep(0.05)
                    return inserted

            return go

        results = _in_threads([put(i) for i in range(8)], self.thread_timeout)
        assert sum(results) == 1, f"8 concurrent inbox_put of one key inserted {sum(results)}"
        with store.transaction() as tx:
            assert store.inbox_get(tx, "engine", "m-race") == (True, {"by": results.index(True)})

    # --- outbox ------------------------------------------------------------------------------

    def test_claim_takes_available_rows_oldest_first(self, store: Store) -> None:
        q1, q2 = _id("q"), _id("q")
        bodies = self.enqueue(store, q1, 3)
        other = self.enqueue(store, q2, 1)
        first = store.claim([q1], 2, T0, LEASE)
        assert [m.body for m in first] == bodies[:2], "oldest first, at most limit"
        assert all(type(m.body) is bytes for m in first), "bodies come back as bytes"
        assert {m.queue for m in first} == {q1} and {m.deliveries for m in first} == {1}
        assert first[0].claim_token == first[1].claim_token and first[0].claim_token
        assert first[0].id != first[1].id
        assert [m.body for m in store.claim([q1], 10, T0, LEASE)] == bodies[2:]
        assert store.claim([q1], 10, T0, LEASE) == [], "claimed rows are leased"
        assert [m.body for m in store.claim(None, 10, T0, LEASE)] == other, "None: any queue"
        assert store.claim(None, 10, T0, LEASE) == []

    def test_a_probing_claim_takes_what_a_claim_takes(self, store: Store) -> None:
        """``probe=True`` (a poll) looks before it opens a transaction: the same rows."""
        queue = _id("q")
        assert store.claim([queue], 10, T0, LEASE, probe=True) == []
        bodies = self.enqueue(store, queue, 2)
        assert [m.body for m in store.claim([queue], 10, T0, LEASE, probe=True)] == bodies
        assert store.claim([queue], 10, T0, LEASE, probe=True) == [], "claimed rows are leased"
        after = T0 + LEASE + timedelta(seconds=1)
        assert [m.body for m in store.claim([queue], 10, after, LEASE, probe=True)] == bodies

    def test_a_sweep_never_takes_an_in_process_lane(self, store: Store) -> None:
        """``queues=None`` (a relay's sweep) takes every queue but the lanes of in-process
        steps (``<app>/local``): those are the app's engines' alone."""
        lane, other = local_queue(_id("app")), _id("q")
        self.enqueue(store, lane, 1)
        bodies = self.enqueue(store, other, 1)
        swept = store.claim(None, 1000, FAR, LEASE) + store.claim(None, 1000, FAR, LEASE)
        assert lane not in {m.queue for m in swept} and bodies[0] in {m.body for m in swept}
        assert len(store.claim([lane], 10, FAR, LEASE)) == 1

    def test_a_delayed_message_is_claimable_from_its_available_at(self, store: Store) -> None:
        queue = _id("q")
        later = T0 + timedelta(seconds=10)
        with store.transaction() as tx:
            store.enqueue(tx, [self.message(queue, 1, later)], T0)
        assert store.claim([queue], 10, T0, LEASE) == []
        assert store.oldest_outbox_message() == later
        assert len(store.claim([queue], 10, later, LEASE)) == 1

    def test_oldest_outbox_message(self, store: Store) -> None:
        assert store.oldest_outbox_message() is None
        self.enqueue(store, _id("q"), 2, T0 + timedelta(seconds=5))
        self.enqueue(store, _id("q"), 1, T0)
        oldest = store.oldest_outbox_message()
        assert oldest == T0 and oldest is not None and oldest.utcoffset() == timedelta(0)

    def test_an_expired_lease_redelivers_and_voids_the_old_token(self, store: Store) -> None:
        queue = _id("q")
        (body,) = self.enqueue(store, queue, 1)
        (old,) = store.claim([queue], 10, T0, LEASE)
        assert store.claim([queue], 10, T0 + LEASE - timedelta(seconds=1), LEASE) == []
        after = T0 + LEASE + timedelta(seconds=1)
        (new,) = store.claim([queue], 10, after, LEASE)
        assert (new.id, new.body, new.deliveries) == (old.id, body, 2)
        assert new.claim_token != old.claim_token, "a new claim gets a new token"
        # the previous holder lost the lease: none of its operations may touch the row
        assert store.delete_claimed(None, [old.id], old.claim_token) == 0
        assert store.extend_claim(old.id, old.claim_token, FAR) is False
        store.release([old.id], old.claim_token, T0)
        store.dead_letter(old.id, old.claim_token, "stale", after)
        assert store.dead_letters() == []
        assert store.claim([queue], 10, after, LEASE) == [], "still leased to the new holder"
        assert store.delete_claimed(None, [new.id], new.claim_token) == 1
        assert store.claim([queue], 10, FAR, LEASE) == [], "deleted for good"

    def test_delete_claimed_in_the_callers_transaction(self, store: Store) -> None:
        queue = _id("q")
        self.enqueue(store, queue, 3)
        claimed = store.claim([queue], 10, T0, LEASE)
        ids = [m.id for m in claimed]
        token = claimed[0].claim_token
        with pytest.raises(_Rollback), store.transaction() as tx:
            assert store.delete_claimed(tx, ids[:2], token) == 2
            raise _Rollback
        with store.transaction() as tx:
            assert store.delete_claimed(tx, ids[:2], "not-the-token") == 0
            assert store.delete_claimed(tx, ids[:2], token) == 2, "the rollback kept them"
        assert [m.id for m in store.claim([queue], 10, FAR, LEASE)] == ids[2:]

    def test_extend_claim_keeps_the_lease(self, store: Store) -> None:
        queue = _id("q")
        self.enqueue(store, queue, 1)
        (m,) = store.claim([queue], 10, T0, LEASE)
        until = T0 + 4 * LEASE
        assert store.extend_claim(m.id, "not-the-token", FAR) is False
        assert store.extend_claim(m.id, m.claim_token, until) is True
        assert store.claim([queue], 10, T0 + 2 * LEASE, LEASE) == [], "the extended lease holds"
        (again,) = store.claim([queue], 10, until + timedelta(seconds=1), LEASE)
        assert (again.id, again.deliveries) == (m.id, 2)

    def test_release_makes_a_row_available_again(self, store: Store) -> None:
        queue = _id("q")
        self.enqueue(store, queue, 1)
        (m,) = store.claim([queue], 10, T0, LEASE)
        retry_at = T0 + timedelta(seconds=5)
        store.release([m.id], m.claim_token, retry_at)
        assert store.claim([queue], 10, retry_at - timedelta(seconds=1), LEASE) == []
        (again,) = store.claim([queue], 10, retry_at, LEASE)
        assert (again.id, again.deliveries) == (m.id, 2)

    def test_dead_letter_moves_the_row(self, store: Store) -> None:
        queue = _id("q")
        bodies = self.enqueue(store, queue, 2)
        first, second = store.claim([queue], 10, T0, LEASE)
        store.dead_letter(first.id, first.claim_token, "poison: not JSON", T0)
        assert store.dead_letters() == [(queue, bodies[0], "poison: not JSON")]
        assert all(type(b) is bytes for _, b, _ in store.dead_letters())
        assert store.delete_claimed(None, [first.id], first.claim_token) == 0, "it left the queue"
        assert [m.id for m in store.claim([queue], 10, FAR, LEASE)] == [second.id]

    def test_concurrent_claimers_get_disjoint_rows(self, store: Store) -> None:
        queue = _id("q")
        bodies = self.enqueue(store, queue, 60)

        def claimer() -> list[QueuedMessage]:
            mine: list[QueuedMessage] = []
            while batch := store.claim([queue], 3, T0, LEASE):
                mine.extend(batch)
            return mine

        results = _in_threads([claimer] * 8, self.thread_timeout)
        ids = [m.id for r in results for m in r]
        dupes = sorted({i for i in ids if ids.count(i) > 1})
        assert not dupes, f"rows claimed twice: {dupes}"
        assert sorted(m.body for r in results for m in r) == sorted(bodies), "all rows claimed"

    # --- rate limits (``@app.step(rate_limit=...)``) ----------------------------------------

    def test_rate_limit_slots_are_one_interval_apart_and_an_idle_limiter_starts_now(
        self, store: Store
    ) -> None:
        key, step = _id("rate"), timedelta(seconds=0.1)
        assert [store.reserve_slot(key, 0.1, T0) for _ in range(3)] == [
            T0,
            T0 + step,
            T0 + 2 * step,
        ]
        later = T0 + timedelta(seconds=0.25)  # between two slots: the next free one
        assert store.reserve_slot(key, 0.1, later) == T0 + 3 * step
        idle = T0 + timedelta(seconds=10)  # idle since: no burst is saved up
        assert [store.reserve_slot(key, 0.1, idle) for _ in range(2)] == [idle, idle + step]
        assert store.reserve_slot(_id("rate"), 0.5, T0) == T0, "each key has its own limiter"

    def test_concurrent_rate_limit_reservations_are_distinct_and_one_interval_apart(
        self, store: Store
    ) -> None:
        key = _id("rate")

        def reserve() -> list[datetime]:
            return [store.reserve_slot(key, 0.01, T0) for _ in range(25)]

        slots = sorted(s for r in _in_threads([reserve] * 4, self.thread_timeout) for s in r)
        assert len(set(slots)) == 100, "a slot given twice"
        gaps = {round((b - a).total_seconds(), 4) for a, b in itertools.pairwise(slots)}
        assert gaps == {0.01}, f"starts must be one interval apart: gaps {sorted(gaps)}"

    def test_a_held_rate_limit_slot_is_fresh_for_the_first_delivery_that_takes_it(
        self, store: Store
    ) -> None:
        key, message = _id("rate"), _id("step:r")
        slot = T0 + timedelta(seconds=5)
        store.hold_slot(message, key, slot, in_doubt=False, give_backs=1, now=T0)
        first = store.take_held_slot(message)
        assert first is not None and first.fresh and first.slot == slot
        assert (first.key, first.in_doubt, first.give_backs) == (key, False, 1)
        again = store.take_held_slot(message)
        assert again is not None and not again.fresh, "taken before: that holder may have run it"
        store.hold_slot(message, key, slot, in_doubt=True, give_backs=2, now=T0)
        third = store.take_held_slot(message)
        assert third is not None and third.fresh and third.in_doubt and third.give_backs == 2
        assert store.take_held_slot(_id("step:r")) is None

    # --- retention ---------------------------------------------------------------------------

    def test_prune_deletes_old_inbox_rows_and_finished_runs_only(self, store: Store) -> None:
        old, recent = T0 - timedelta(days=2), T0
        before = T0 - timedelta(days=1)
        old_done = [self.new_run(store, status=s, at=old) for s in ("completed", "failed")]
        old_running = self.new_run(store, status="running", at=old)
        new_done = self.new_run(store, status="completed", at=recent)
        runs = [*old_done, old_running, new_done]
        with store.transaction() as tx:
            for run in runs:
                store.append_events(tx, run.run_id, 0, [NewEvent("a"), NewEvent("b")], old)
                store.add_timer(tx, Timer(run.run_id, 1, "sleep", FAR))
            store.inbox_put(tx, "engine", "old", None, old)
            store.inbox_put(tx, "engine", "recent", None, recent)
        total = 0
        for _ in range(10):  # batch=1: as the retention job does, prune until nothing is left
            removed = store.prune(before=before, batch=1)
            assert removed >= 0
            if removed == 0:
                break
            total += removed
        assert total >= 3, f"prune reported {total} rows for 1 inbox row and 2 runs"
        assert store.prune(before=before) == 0, "nothing left to prune"
        for run in old_done:
            assert store.get_run(run.run_id) is None, f"finished run {run.status} kept"
            assert store.load_history(None, run.run_id) == [], "history of a pruned run kept"
        for run in (old_running, new_done):
            got = store.get_run(run.run_id)
            assert got is not None, f"{run.status} run updated at {run.updated_at} pruned"
            assert len(store.load_history(None, run.run_id)) == 2
        left = {x.run_id for x in self.drain_timers(store)}
        assert left == {old_running.run_id, new_done.run_id}, "timers of pruned runs kept"
        with store.transaction() as tx:
            assert store.inbox_get(tx, "engine", "old") == (False, None), "old inbox row kept"
            assert store.inbox_get(tx, "engine", "recent") == (True, None)

    # --- large payloads ----------------------------------------------------------------------

    @staticmethod
    def large_text() -> str:
        """Over the message limit: a store must keep it out of message bodies and rows."""
        line = "assistant: voilà le reçu de la commande 7 ✓\n"
        return (line * (MAX_MESSAGE_BYTES // len(line) + 1000))[: MAX_MESSAGE_BYTES + 4096]

    def test_large_values_round_trip_and_travel_by_reference(self, store: Store) -> None:
        big = self.large_text()
        run = RunRecord(_id("run"), "app", _id("saga"), "running", {"prompt": big}, T0, T0)
        reply = {"outcome": "completed", "result": big}
        env = Envelope(type="step_result", run_id=run.run_id, payload=reply)
        events = [
            NewEvent("step_completed", 1, "s", {"result": big, "reconciled": False}),
            NewEvent("saga_finished", data={"output": [big]}),
        ]
        with store.transaction() as tx:
            assert store.create_run(tx, run)
            store.append_events(tx, run.run_id, 0, events, T0)
            locked = store.lock_run(tx, run.run_id)
            assert locked is not None and locked.input == {"prompt": big}, "input not loaded"
            locked.status, locked.output = "completed", [big]
            store.save_run(tx, locked)
            assert store.inbox_put(tx, "worker", "big-reply", reply, T0)
            store.enqueue(tx, [Outgoing("payloads", env)], T0)
        got = store.get_run(run.run_id)
        assert got is not None and (got.input, got.output) == ({"prompt": big}, [big])
        assert [r.output for r in store.list_runs(saga=run.saga)] == [[big]]
        assert [e.data for e in store.load_history(None, run.run_id)] == [e.data for e in events]
        assert store.inbox_get(None, "worker", "big-reply") == (True, reply)
        [row] = store.claim(["payloads"], 10, T0, LEASE)
        assert len(row.body) < MAX_MESSAGE_BYTES // 8, (
            f"a body of {len(row.body)} bytes: large values must travel by reference"
        )
        resolved = store.resolve(None, Envelope.from_bytes(row.body))
        assert (resolved.message_id, resolved.payload) == (env.message_id, reply)

    def test_values_shaped_like_references_round_trip_unchanged(self, store: Store) -> None:
        shaped = {"$sagaloop": "payload", "sha256": "0" * 64, "size": 1}
        escaped = {"$sagaloop": "literal", "value": 1}
        run = RunRecord(_id("run"), "app", "contract", "running", shaped, T0, T0)
        payload = {"result": shaped, "args": escaped, "name": "x"}
        with store.transaction() as tx:
            assert store.create_run(tx, run)
            store.append_events(tx, run.run_id, 0, [NewEvent("e", 1, "s", payload)], T0)
            store.inbox_put(tx, "worker", "shaped", escaped, T0)
            env = Envelope(type="step", run_id=run.run_id, payload=payload)
            store.enqueue(tx, [Outgoing("payloads", env)], T0)
        got = store.get_run(run.run_id)
        assert got is not None and got.input == shaped, "a user value taken for a reference"
        assert store.load_history(None, run.run_id)[0].data == payload
        assert store.inbox_get(None, "worker", "shaped") == (True, escaped)
        [row] = store.claim(["payloads"], 10, T0, LEASE)
        assert store.resolve(None, Envelope.from_bytes(row.body)).payload == payload

    def test_resolve_refuses_a_reference_that_does_not_resolve(self, store: Store) -> None:
        small = Envelope(type="event", run_id=_id("run"), payload={"name": "x", "data": [1]})
        assert store.resolve(None, small) == small
        for data in ({"$sagaloop": "payload", "sha256": "0" * 64, "size": 1}, {"$sagaloop": 7}):
            forged = Envelope(
                type="event", run_id=small.run_id, payload={"name": "x", "data": data}
            )
            with pytest.raises(MessageError):  # published raw: its consumer dead-letters it
                store.resolve(None, forged)

    def test_prune_deletes_the_payloads_of_pruned_runs(self, store: Store) -> None:
        old = T0 - timedelta(days=2)
        run = self.new_run(store, status="completed", at=old)
        env = Envelope(type="step", run_id=run.run_id, payload={"args": {"t": self.large_text()}})
        with store.transaction() as tx:
            store.enqueue(tx, [Outgoing("payloads", env)], old)
        [row] = store.claim(["payloads"], 1, T0, LEASE)
        assert store.resolve(None, Envelope.from_bytes(row.body)).payload == env.payload
        while store.prune(before=T0 - timedelta(days=1)):
            pass
        assert store.get_run(run.run_id) is None
        with pytest.raises(MessageError, match="pruned"):
            store.resolve(None, Envelope.from_bytes(row.body))
