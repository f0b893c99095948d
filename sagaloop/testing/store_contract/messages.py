"""The store contract of messages: the inbox (``InboxStore``: one row per key, even under
races), the outbox queue (``OutboxQueue``: claims oldest first with a lease, an expired lease
voids the old claim token, concurrent claimers get disjoint rows) and rate-limit slots
(``RateLimits``: one interval apart, distinct under races)."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from datetime import datetime, timedelta

import pytest

from sagaloop.engine.messages import local_queue
from sagaloop.engine.ports import QueuedMessage, Store
from sagaloop.testing.store_contract._base import (
    FAR,
    LEASE,
    T0,
    ContractBase,
    Rollback,
    in_threads,
    new_id,
)


class LeaseLost(Exception):
    """The error a test's settle raises when its lease was lost."""


class MessageContract(ContractBase):
    """The inbox, the outbox queue and rate-limit slots."""

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

        results = in_threads([put(i) for i in range(8)], self.thread_timeout)
        assert sum(results) == 1, f"8 concurrent inbox_put of one key inserted {sum(results)}"
        with store.transaction() as tx:
            assert store.inbox_get(tx, "engine", "m-race") == (True, {"by": results.index(True)})

    # --- outbox ------------------------------------------------------------------------------

    def test_claim_takes_available_rows_oldest_first(self, store: Store) -> None:
        q1, q2 = new_id("q"), new_id("q")
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
        queue = new_id("q")
        assert store.claim([queue], 10, T0, LEASE, probe=True) == []
        bodies = self.enqueue(store, queue, 2)
        assert [m.body for m in store.claim([queue], 10, T0, LEASE, probe=True)] == bodies
        assert store.claim([queue], 10, T0, LEASE, probe=True) == [], "claimed rows are leased"
        after = T0 + LEASE + timedelta(seconds=1)
        assert [m.body for m in store.claim([queue], 10, after, LEASE, probe=True)] == bodies

    def test_a_sweep_never_takes_an_in_process_lane(self, store: Store) -> None:
        """``queues=None`` (a relay's sweep) takes every queue but the lanes of in-process
        steps (``<app>/local``): those are the app's engines' alone."""
        lane, other = local_queue(new_id("app")), new_id("q")
        self.enqueue(store, lane, 1)
        bodies = self.enqueue(store, other, 1)
        swept = store.claim(None, 1000, FAR, LEASE) + store.claim(None, 1000, FAR, LEASE)
        assert lane not in {m.queue for m in swept} and bodies[0] in {m.body for m in swept}
        assert len(store.claim([lane], 10, FAR, LEASE)) == 1

    def test_a_delayed_message_is_claimable_from_its_available_at(self, store: Store) -> None:
        queue = new_id("q")
        later = T0 + timedelta(seconds=10)
        with store.transaction() as tx:
            store.enqueue(tx, [self.message(queue, 1, later)], T0)
        assert store.claim([queue], 10, T0, LEASE) == []
        assert store.oldest_outbox_message() == later
        assert len(store.claim([queue], 10, later, LEASE)) == 1

    def test_oldest_outbox_message(self, store: Store) -> None:
        assert store.oldest_outbox_message() is None
        self.enqueue(store, new_id("q"), 2, T0 + timedelta(seconds=5))
        self.enqueue(store, new_id("q"), 1, T0)
        oldest = store.oldest_outbox_message()
        assert oldest == T0 and oldest is not None and oldest.utcoffset() == timedelta(0)

    def test_an_expired_lease_redelivers_and_voids_the_old_token(self, store: Store) -> None:
        queue = new_id("q")
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
        queue = new_id("q")
        self.enqueue(store, queue, 3)
        claimed = store.claim([queue], 10, T0, LEASE)
        ids = [m.id for m in claimed]
        token = claimed[0].claim_token
        with pytest.raises(Rollback), store.transaction() as tx:
            assert store.delete_claimed(tx, ids[:2], token) == 2
            raise Rollback
        with store.transaction() as tx:
            assert store.delete_claimed(tx, ids[:2], "not-the-token") == 0
            assert store.delete_claimed(tx, ids[:2], token) == 2, "the rollback kept them"
        assert [m.id for m in store.claim([queue], 10, FAR, LEASE)] == ids[2:]

    def test_settle_claimed_deletes_by_the_commit_or_raises_its_error(self, store: Store) -> None:
        """A settle (the message being processed): its rows are gone once the transaction
        commits; a row no longer claimed with the token (its lease was lost) raises the
        settle's own error in the transaction, and nothing of it commits."""
        queue, other = new_id("q"), new_id("q")
        self.enqueue(store, queue, 2)
        first, second = store.claim([queue], 10, T0, LEASE)
        with store.transaction() as tx:
            store.settle_claimed(tx, [first.id], first.claim_token, LeaseLost())
        (again,) = store.claim([queue], 10, T0 + LEASE + timedelta(seconds=1), LEASE)
        assert again.id == second.id, "the settled row is gone; the other one's lease ran out"
        with pytest.raises(LeaseLost), store.transaction() as tx:
            store.enqueue(tx, [self.message(other)], T0)
            store.settle_claimed(tx, [second.id], second.claim_token, LeaseLost())
        assert store.claim([other], 10, FAR, LEASE) == [], "the transaction did not commit"
        assert store.delete_claimed(None, [again.id], again.claim_token) == 1, "still claimed"

    def test_extend_claim_keeps_the_lease(self, store: Store) -> None:
        queue = new_id("q")
        self.enqueue(store, queue, 1)
        (m,) = store.claim([queue], 10, T0, LEASE)
        until = T0 + 4 * LEASE
        assert store.extend_claim(m.id, "not-the-token", FAR) is False
        assert store.extend_claim(m.id, m.claim_token, until) is True
        assert store.claim([queue], 10, T0 + 2 * LEASE, LEASE) == [], "the extended lease holds"
        (again,) = store.claim([queue], 10, until + timedelta(seconds=1), LEASE)
        assert (again.id, again.deliveries) == (m.id, 2)

    def test_release_makes_a_row_available_again(self, store: Store) -> None:
        queue = new_id("q")
        self.enqueue(store, queue, 1)
        (m,) = store.claim([queue], 10, T0, LEASE)
        retry_at = T0 + timedelta(seconds=5)
        store.release([m.id], m.claim_token, retry_at)
        assert store.claim([queue], 10, retry_at - timedelta(seconds=1), LEASE) == []
        (again,) = store.claim([queue], 10, retry_at, LEASE)
        assert (again.id, again.deliveries) == (m.id, 2)

    def test_dead_letter_moves_the_row(self, store: Store) -> None:
        queue = new_id("q")
        bodies = self.enqueue(store, queue, 2)
        first, second = store.claim([queue], 10, T0, LEASE)
        store.dead_letter(first.id, first.claim_token, "poison: not JSON", T0)
        assert store.dead_letters() == [(queue, bodies[0], "poison: not JSON")]
        assert all(type(b) is bytes for _, b, _ in store.dead_letters())
        assert store.delete_claimed(None, [first.id], first.claim_token) == 0, "it left the queue"
        assert [m.id for m in store.claim([queue], 10, FAR, LEASE)] == [second.id]

    def test_concurrent_claimers_get_disjoint_rows(self, store: Store) -> None:
        queue = new_id("q")
        bodies = self.enqueue(store, queue, 60)

        def claimer() -> list[QueuedMessage]:
            mine: list[QueuedMessage] = []
            while batch := store.claim([queue], 3, T0, LEASE):
                mine.extend(batch)
            return mine

        results = in_threads([claimer] * 8, self.thread_timeout)
        ids = [m.id for r in results for m in r]
        dupes = sorted({i for i in ids if ids.count(i) > 1})
        assert not dupes, f"rows claimed twice: {dupes}"
        assert sorted(m.body for r in results for m in r) == sorted(bodies), "all rows claimed"

    # --- rate limits (``@app.step(rate_limit=...)``) ----------------------------------------

    def test_rate_limit_slots_are_one_interval_apart_and_an_idle_limiter_starts_now(
        self, store: Store
    ) -> None:
        key, step = new_id("rate"), timedelta(seconds=0.1)
        assert [store.reserve_slot(key, 0.1, T0) for _ in range(3)] == [
            T0,
            T0 + step,
            T0 + 2 * step,
        ]
        later = T0 + timedelta(seconds=0.25)  # between two slots: the next free one
        assert store.reserve_slot(key, 0.1, later) == T0 + 3 * step
        idle = T0 + timedelta(seconds=10)  # idle since: no burst is saved up
        assert [store.reserve_slot(key, 0.1, idle) for _ in range(2)] == [idle, idle + step]
        assert store.reserve_slot(new_id("rate"), 0.5, T0) == T0, "each key has its own limiter"

    def test_concurrent_rate_limit_reservations_are_distinct_and_one_interval_apart(
        self, store: Store
    ) -> None:
        key = new_id("rate")

        def reserve() -> list[datetime]:
            return [store.reserve_slot(key, 0.01, T0) for _ in range(25)]

        slots = sorted(s for r in in_threads([reserve] * 4, self.thread_timeout) for s in r)
        assert len(set(slots)) == 100, "a slot given twice"
        gaps = {round((b - a).total_seconds(), 4) for a, b in itertools.pairwise(slots)}
        assert gaps == {0.01}, f"starts must be one interval apart: gaps {sorted(gaps)}"

    def test_a_held_rate_limit_slot_is_fresh_for_the_first_delivery_that_takes_it(
        self, store: Store
    ) -> None:
        key, message = new_id("rate"), new_id("step:r")
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
        assert store.take_held_slot(new_id("step:r")) is None
