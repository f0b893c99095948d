"""The store contract of timers (``TimerStore``): one timer per run, position and kind;
``take_due_timers`` takes only due timers of its app's runs and deletes them, and concurrent
takers get disjoint sets."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest

from sagaloop.engine.ports import Store, Timer
from sagaloop.testing.store_contract._base import (
    FAR,
    T0,
    ContractBase,
    Rollback,
    in_threads,
)


class TimerContract(ContractBase):
    """Timers."""

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
        with pytest.raises(Rollback), store.transaction() as tx:
            assert [x.pos for x in store.take_due_timers(tx, FAR, 10)] == [3]
            raise Rollback
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

    def test_delete_the_timers_at_one_position_of_a_run(self, store: Store) -> None:
        run = self.new_run(store)
        with store.transaction() as tx:
            for pos in (1, 2):
                store.add_timer(tx, Timer(run.run_id, pos, "sleep", T0))
        with store.transaction() as tx:
            store.delete_timers(tx, run.run_id, pos=1)
        assert [(x.run_id, x.pos) for x in self.drain_timers(store)] == [(run.run_id, 2)]

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

        a, b = in_threads([slow, fast], self.thread_timeout)
        pa, pb = [x.pos for x in a], [x.pos for x in b]
        assert len(pa) == n // 3
        assert not set(pa) & set(pb), f"both takers got timers {sorted(set(pa) & set(pb))}"
        assert sorted(pa + pb) == list(range(n)), "together they took every due timer"
        assert self.drain_timers(store) == []
