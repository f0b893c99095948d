"""The store contract of what a store keeps: ``prune`` deletes old inbox rows and finished
runs only (with their history, timers and payloads), and a large value is stored once and
travels by reference, coming back unchanged."""

from __future__ import annotations

from datetime import timedelta

import pytest

from sagaloop.engine.history import NewEvent
from sagaloop.engine.messages import MAX_MESSAGE_BYTES, Envelope
from sagaloop.engine.ports import Outgoing, RunRecord, Store, Timer
from sagaloop.errors import MessageError
from sagaloop.testing.store_contract._base import (
    FAR,
    LEASE,
    T0,
    ContractBase,
    new_id,
)


class RetentionContract(ContractBase):
    """Pruning and large payloads."""

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
        run = RunRecord(new_id("run"), "app", new_id("saga"), "running", {"prompt": big}, T0, T0)
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
        run = RunRecord(new_id("run"), "app", "contract", "running", shaped, T0, T0)
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
        small = Envelope(type="event", run_id=new_id("run"), payload={"name": "x", "data": [1]})
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
