"""The store contract of the runs listing (``RunQueries.list_runs`` with its search, orders and
keyset cursors, ``last_run_update`` and ``run_waits``): each filter narrows, each order sorts
with ties broken by run id, and walking the pages while runs are updated between them never
shows a run twice (nor skips one, in a ``created`` order)."""

from __future__ import annotations

import dataclasses
from datetime import datetime, timedelta

import pytest

from sagaloop.engine import history as h
from sagaloop.engine.history import NewEvent
from sagaloop.engine.listing import RunOrder, run_cursor
from sagaloop.engine.ports import RunRecord, Store, Timer
from sagaloop.errors import ValidationError
from sagaloop.testing.store_contract._base import T0, ContractBase, new_id


def _ids(runs: list[RunRecord]) -> list[str]:
    return [r.run_id for r in runs]


class ListingContract(ContractBase):
    """The runs listing."""

    def _add(self, store: Store, run_id: str, **fields: object) -> RunRecord:
        values: dict[str, object] = {"app": "app", "saga": "s", "status": "running", "input": None}
        values.update(fields)
        created = fields.get("created_at", T0)
        values.setdefault("created_at", created)
        values.setdefault("updated_at", created)
        run = RunRecord(run_id=run_id, **values)  # type: ignore[arg-type]
        with store.transaction() as tx:
            assert store.create_run(tx, run)
        return run

    @staticmethod
    def _touch(store: Store, run: RunRecord, at: datetime) -> RunRecord:
        moved = dataclasses.replace(run, updated_at=at)
        with store.transaction() as tx:
            assert store.save_run(tx, moved)
        return moved

    def _walk(self, store: Store, order: RunOrder, size: int, between: object = None) -> list[str]:
        """The ids of every page of ``order`` in turn (``between(page_number)`` runs after
        each page is read)."""
        seen: list[str] = []
        after = None
        for page_number in range(1000):
            page = store.list_runs(limit=size, order=order, after=after)
            seen += _ids(page)
            if len(page) < size:
                return seen
            after = run_cursor(page[-1], order)
            if callable(between):
                between(page_number)
        raise AssertionError("the walk did not end within 1000 pages")

    def test_list_runs_searches_id_prefixes_literally(self, store: Store) -> None:
        tag = new_id("p")
        ids = [f"{tag}-a1", f"{tag}-a2", f"{tag}-b1", f"{tag}%x", f"{tag}_y", f"{tag}é"]
        for n, run_id in enumerate(ids):
            self._add(store, run_id, created_at=T0 + timedelta(seconds=n))
        found = _ids(store.list_runs(id_prefix=f"{tag}-a", order=RunOrder.CREATED_ASC))
        assert found == ids[:2], "a prefix finds the ids that start with it"
        assert _ids(store.list_runs(id_prefix=f"{tag}%")) == [f"{tag}%x"], "% is literal"
        assert _ids(store.list_runs(id_prefix=f"{tag}_")) == [f"{tag}_y"], "_ is literal"
        assert _ids(store.list_runs(id_prefix=f"{tag}é")) == [f"{tag}é"]
        assert _ids(store.list_runs(id_prefix=ids[2])) == [ids[2]], "a whole id finds its run"
        assert store.list_runs(id_prefix=f"{tag}-c") == []
        assert store.list_runs(id_prefix=tag.upper()) == [], "ids are case-sensitive"

    def test_list_runs_searches_input_text_and_filters(self, store: Store) -> None:
        paris = self._add(store, new_id("r"), input={"city": "Paris", "n": 1}, saga="trip")
        rome = self._add(
            store,
            new_id("r"),
            input={"city": "Rome 100%"},
            saga="trip",
            status="completed",
            created_at=T0 + timedelta(seconds=1),
        )
        other = self._add(store, new_id("r"), input={"city": "paris"}, app="other", saga="trip")
        assert set(_ids(store.list_runs(input_text="PARIS"))) == {paris.run_id, other.run_id}, (
            "input search is case-insensitive"
        )
        assert _ids(store.list_runs(input_text="paris", app="app")) == [paris.run_id]
        assert _ids(store.list_runs(input_text='"n":1')) == [paris.run_id], "the JSON text"
        assert _ids(store.list_runs(input_text="100%")) == [rome.run_id], "% is literal"
        zurich = self._add(store, new_id("r"), input={"city": "Zürich ✓"}, saga="trip")
        assert _ids(store.list_runs(input_text="zürich ✓")) == [zurich.run_id], "beyond ASCII"
        assert store.list_runs(input_text="1000") == []
        assert _ids(store.list_runs(input_text="trip", saga="trip")) == [], "input, not saga"
        assert _ids(store.list_runs(input_text="o", status="completed")) == [rome.run_id]
        since = T0 + timedelta(milliseconds=500)
        assert _ids(store.list_runs(updated_since=since)) == [rome.run_id]

    def test_orders_sort_by_time_then_run_id(self, store: Store) -> None:
        a = self._add(store, "order-a", created_at=T0)
        b = self._add(store, "order-b", created_at=T0)
        c = self._add(store, "order-c", created_at=T0 + timedelta(seconds=1))
        a = self._touch(store, a, T0 + timedelta(seconds=5))
        expect = {
            RunOrder.UPDATED_DESC: [a, c, b],
            RunOrder.UPDATED_ASC: [b, c, a],
            RunOrder.CREATED_DESC: [c, b, a],
            RunOrder.CREATED_ASC: [a, b, c],
        }
        for order, runs in expect.items():
            assert _ids(store.list_runs(order=order)) == _ids(runs), order
            assert _ids(store.list_runs(order=order, limit=2)) == _ids(runs)[:2], order
            after = run_cursor(runs[0], order)
            assert _ids(store.list_runs(order=order, after=after)) == _ids(runs)[1:], order

    def test_pages_of_equal_times_are_cut_by_run_id(self, store: Store) -> None:
        runs = [self._add(store, f"tie-{n:02}") for n in range(11)]
        for order in RunOrder:
            walked = self._walk(store, order, size=3)
            expected = sorted(_ids(runs), reverse=order.descending)
            assert walked == expected, f"{order}: every run once, in run id order"

    def test_a_created_walk_sees_each_run_once_while_runs_update(self, store: Store) -> None:
        runs = [
            self._add(store, new_id("w"), created_at=T0 + timedelta(seconds=n)) for n in range(17)
        ]
        clock = [T0 + timedelta(hours=1)]

        def update_some(page: int) -> None:
            for run in runs[page::3]:  # seen and unseen runs alike
                clock[0] += timedelta(seconds=1)
                self._touch(store, run, clock[0])

        for order in (RunOrder.CREATED_DESC, RunOrder.CREATED_ASC):
            walked = self._walk(store, order, size=4, between=update_some)
            assert sorted(walked) == sorted(_ids(runs)), f"{order}: none skipped"
            assert len(walked) == len(set(walked)), f"{order}: none twice"

    def test_an_updated_walk_never_shows_a_run_twice(self, store: Store) -> None:
        runs = [
            self._add(store, new_id("u"), created_at=T0 + timedelta(seconds=n)) for n in range(17)
        ]
        moved: set[str] = set()
        clock = [T0 + timedelta(hours=1)]

        def update_some(page: int) -> None:
            for run in runs[page * 2 : page * 2 + 2] + runs[-page - 1 :][:1]:
                clock[0] += timedelta(seconds=1)
                self._touch(store, run, clock[0])
                moved.add(run.run_id)

        walked = self._walk(store, RunOrder.UPDATED_DESC, size=4, between=update_some)
        assert len(walked) == len(set(walked)), "no run twice"
        unmoved = set(_ids(runs)) - moved
        assert unmoved <= set(walked), "every run not updated during the walk comes"
        fresh = store.list_runs(limit=len(moved), order=RunOrder.UPDATED_DESC)
        assert set(_ids(fresh)) == moved, "the updated runs lead a fresh first page"

    def test_a_cursor_is_checked(self, store: Store) -> None:
        run = self._add(store, new_id("c"))
        with pytest.raises(ValidationError, match="not a cursor"):
            store.list_runs(after="not-a-cursor")
        with pytest.raises(ValidationError, match="sorted by"):
            store.list_runs(after=run_cursor(run, RunOrder.CREATED_ASC))

    def test_last_run_update_is_the_newest_update(self, store: Store) -> None:
        assert store.last_run_update() is None
        run = self._add(store, new_id("l"), created_at=T0)
        self._add(store, new_id("l"), app="other", created_at=T0 + timedelta(seconds=1))
        assert store.last_run_update() == T0 + timedelta(seconds=1)
        last = store.last_run_update(app="app")
        assert last == T0 and last.utcoffset() == timedelta(0), "an aware UTC time"
        self._touch(store, run, T0 + timedelta(seconds=9))
        assert store.last_run_update(app="app") == T0 + timedelta(seconds=9)
        assert store.last_run_update(app="nobody") is None

    def test_run_waits_reads_approvals_timers_and_open_waits(self, store: Store) -> None:
        run = self._add(store, new_id("w"), status="waiting")
        idle = self._add(store, new_id("w"))
        request = {
            "status": "pending",
            "action": "refund",
            "args": {"cents": 1250},
            "args_hash": "h",
            "requested_at": T0.isoformat(),
        }
        events = [
            NewEvent(h.STEP_SCHEDULED, 0, "hold", {"queue": "default"}),
            NewEvent(h.STEP_COMPLETED, 0, "hold", {"result": 1}),
            NewEvent(h.EVENT_WAITING, 1, "shipped", {}),
            NewEvent(h.EVENT_ARRIVED, None, "shipped", {}),
            NewEvent(h.EVENT_WAITING, 2, "approval:2", {"timeout_at": T0.isoformat()}),
            NewEvent(h.STEP_SCHEDULED, 3, "notify", {"queue": "mail"}),
        ]
        with store.transaction() as tx:
            store.publish_approval(tx, run, "2", request, now=T0)
            store.add_timer(tx, Timer(run.run_id, 2, "wait", T0 + timedelta(hours=1)))
            appended = store.append_events(tx, run.run_id, 0, events, T0)
            run = dataclasses.replace(run, last_seq=appended[-1].seq)
            assert store.save_run(tx, run)
        found = store.run_waits([run, idle])
        assert set(found) == {run.run_id, idle.run_id}
        waits = found[run.run_id]
        assert [(a.call_id, a.request["action"]) for a in waits.approvals] == [("2", "refund")]
        assert [(t.kind, t.pos, t.fire_at) for t in waits.timers] == [
            ("wait", 2, T0 + timedelta(hours=1))
        ]
        assert [(e.pos, e.name) for e in waits.waits] == [(2, "approval:2")], "the open wait"
        assert [(e.pos, e.name) for e in waits.steps] == [(3, "notify")], "the open step"
        assert (found[idle.run_id].approvals, found[idle.run_id].waits) == ([], [])
        assert store.run_waits([]) == {}
