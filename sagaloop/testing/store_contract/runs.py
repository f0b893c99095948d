"""The store contract of runs (``RunStore``, ``RunQueries``) and their history: a run is
created once, even by racing transactions; ``lock_run`` serializes the transactions on a run;
history sequence numbers are gap-free, and appending at a used one fails and rolls the whole
transaction back."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import datetime, timedelta, timezone

import pytest

from sagaloop.engine.history import NewEvent
from sagaloop.engine.ports import RunRecord, Store, Timer
from sagaloop.errors import StoreError, TransientStoreError
from sagaloop.testing.store_contract._base import (
    FAR,
    LEASE,
    T0,
    ContractBase,
    in_threads,
    new_id,
)


class RunContract(ContractBase):
    """Runs and their history."""

    # --- runs --------------------------------------------------------------------------------

    def test_create_run_is_idempotent(self, store: Store) -> None:
        first = RunRecord(new_id("run"), "app", "saga-a", "running", {"x": [1, "é"]}, T0, T0)
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
        assert store.get_run(new_id("missing")) is None

    def test_concurrent_create_run_inserts_once(self, store: Store) -> None:
        run_id = new_id("run")

        def start(i: int) -> Callable[[], bool]:
            def go() -> bool:
                with store.transaction() as tx:
                    run = RunRecord(run_id, "app", "contract", "running", {"starter": i}, T0, T0)
                    inserted = store.create_run(tx, run)
                    time.sleep(0.05)  # keep the transaction open while the others try
                    return inserted

            return go

        results = in_threads([start(i) for i in range(8)], self.thread_timeout)
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
            assert store.lock_run(tx, new_id("missing")) is None

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

        in_threads([first, second], self.thread_timeout)
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
        queue = new_id("q")
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
        assert store.load_history(None, new_id("missing")) == []
