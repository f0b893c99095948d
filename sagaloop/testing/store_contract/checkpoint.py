"""The store contract of ``RunStore.write_checkpoint``: a message's inbox row, its run's update,
the run's events and its outgoing messages, each written only if the one before was, with
the outcome told apart (written, duplicate, conflict), under races too, large values offloaded
and rows handed over with their own ids."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from datetime import timedelta

import pytest

from sagaloop.engine.history import NewEvent
from sagaloop.engine.messages import Envelope
from sagaloop.engine.ports import (
    Checkpoint,
    Outgoing,
    QueuedMessage,
    RunRecord,
    Store,
    Written,
)
from sagaloop.testing.store_contract._base import (
    FAR,
    LEASE,
    T0,
    ContractBase,
    in_threads,
    new_id,
)
from sagaloop.testing.store_contract.messages import LeaseLost

BIG = "x" * 100_000
"""A value over the payload table's threshold."""


class _Handoff:
    """Takes the rows of queues named ``leased`` (as a relay takes what it publishes)."""

    def __init__(self, leased: set[str]) -> None:
        self.token = new_id("handoff")
        self.leased = leased
        self.taken: list[QueuedMessage] = []

    def lease_for(self, queue: str) -> timedelta | None:
        return LEASE if queue in self.leased else None

    def take(self, rows: Sequence[QueuedMessage]) -> None:
        self.taken.extend(rows)


class CheckpointContract(ContractBase):
    """``write_checkpoint``."""

    @staticmethod
    def _checkpoint(
        run: RunRecord | None, key: str, messages: Sequence[Outgoing] = (), **kw: object
    ) -> Checkpoint:
        """The checkpoint of message ``key`` to the ``engine`` consumer: ``run`` (None: no run)
        from last_seq 0 to 2, with two events, a second later."""
        later, output = T0 + timedelta(seconds=1), kw.pop("output", None)
        saved = None
        if run is not None:
            saved = dataclasses.replace(
                run, last_seq=2, processed_seq=2, updated_at=later, output=output
            )
        events = [NewEvent("step_completed", 1, "s", {"result": kw.pop("result", 1)})]
        events.append(NewEvent("step_scheduled", 2, "s", {"args": []}))
        return Checkpoint(
            later,
            ("engine", key, kw.pop("inbox_result", None)),
            saved,
            0,
            events if run is not None else (),
            later,
            messages,
        )

    def test_a_checkpoint_writes_inbox_run_events_and_messages(self, store: Store) -> None:
        run, key, queue = self.new_run(store), new_id("m"), new_id("q")
        messages = [self.message(queue, 1), self.message(queue, 2)]
        with store.transaction() as tx:
            assert (
                store.write_checkpoint(tx, self._checkpoint(run, key, messages)) is Written.WRITTEN
            )
        assert store.inbox_get(None, "engine", key) == (True, None)
        saved = store.get_run(run.run_id)
        assert saved is not None and (saved.last_seq, saved.processed_seq) == (2, 2)
        assert saved.updated_at == T0 + timedelta(seconds=1)
        events = store.load_history(None, run.run_id)
        assert [(e.seq, e.kind, e.pos, e.name) for e in events] == [
            (1, "step_completed", 1, "s"),
            (2, "step_scheduled", 2, "s"),
        ]
        assert events[0].data == {"result": 1} and events[0].at == T0 + timedelta(seconds=1)
        bodies = [m.body for m in store.claim([queue], 10, T0 + timedelta(seconds=1), LEASE)]
        assert bodies == [m.envelope.to_bytes() for m in messages]

    def test_a_duplicate_checkpoint_writes_nothing(self, store: Store) -> None:
        run, key, queue = self.new_run(store), new_id("m"), new_id("q")
        with store.transaction() as tx:
            assert store.inbox_put(tx, "engine", key, None, T0)
        with store.transaction() as tx:
            cp = self._checkpoint(run, key, [self.message(queue)])
            assert store.write_checkpoint(tx, cp) is Written.DUPLICATE
            reply = self._checkpoint(None, key, [self.message(queue)], inbox_result={"a": 1})
            assert store.write_checkpoint(tx, reply) is Written.DUPLICATE, "with no run too"
        assert store.get_run(run.run_id) == run, "the run is not updated"
        assert store.load_history(None, run.run_id) == []
        assert store.claim([queue], 10, T0 + timedelta(seconds=1), LEASE) == []
        assert store.inbox_get(None, "engine", key) == (True, None), "the first row stays"

    def test_a_settle_before_a_checkpoint_commits_with_it_or_not_at_all(self, store: Store) -> None:
        """The message's row settled before its checkpoint (as an in-process step's is): a
        store may delete it in the checkpoint's own statement; whether or not, it is gone
        with the commit, and a lost lease raises the settle's error and writes nothing."""
        queue, sent = new_id("q"), new_id("q")
        self.enqueue(store, queue, 1)
        (old,) = store.claim([queue], 10, T0, LEASE)
        (new,) = store.claim([queue], 10, T0 + LEASE + timedelta(seconds=1), LEASE)
        run, key = self.new_run(store), new_id("m")
        with pytest.raises(LeaseLost), store.transaction() as tx:
            store.settle_claimed(tx, [old.id], old.claim_token, LeaseLost())
            store.write_checkpoint(tx, self._checkpoint(run, key, [self.message(sent)]))
        assert store.inbox_get(None, "engine", key) == (False, None), "nothing was written"
        assert store.get_run(run.run_id) == run
        assert store.claim([sent], 10, FAR, LEASE) == []
        with store.transaction() as tx:
            store.settle_claimed(tx, [new.id], new.claim_token, LeaseLost())
            cp = self._checkpoint(run, key, [self.message(sent)])
            assert store.write_checkpoint(tx, cp) is Written.WRITTEN
        assert store.claim([queue], 10, FAR, LEASE) == [], "settled with the checkpoint"
        assert len(store.claim([sent], 10, FAR, LEASE)) == 1

    def test_a_lone_transaction_is_atomic_up_to_its_checkpoint(self, store: Store) -> None:
        """``transaction(lone=True)``: its checkpoint may commit it, but never a part of it: a
        settle whose lease was lost still writes nothing, and a write before the checkpoint
        commits with it or not at all."""
        queue, sent = new_id("q"), new_id("q")
        self.enqueue(store, queue, 1)
        (old,) = store.claim([queue], 10, T0, LEASE)
        store.claim([queue], 10, T0 + LEASE + timedelta(seconds=1), LEASE)  # the lease is lost
        run, key = self.new_run(store), new_id("m")
        with pytest.raises(LeaseLost), store.transaction(lone=True) as tx:
            store.settle_claimed(tx, [old.id], old.claim_token, LeaseLost())
            store.write_checkpoint(tx, self._checkpoint(run, key, [self.message(sent)]))
        assert store.inbox_get(None, "engine", key) == (False, None), "nothing was written"
        with pytest.raises(LeaseLost), store.transaction(lone=True) as tx:
            store.enqueue(tx, [self.message(sent)], T0)
            store.write_checkpoint(tx, self._checkpoint(None, key, []))
            raise LeaseLost
        assert store.inbox_get(None, "engine", key) == (False, None)
        assert store.claim([sent], 10, FAR, LEASE) == [], "the write before it rolled back too"
        with store.transaction(lone=True) as tx:
            cp = self._checkpoint(run, key, [self.message(sent)])
            assert store.write_checkpoint(tx, cp) is Written.WRITTEN
        assert store.inbox_get(None, "engine", key) == (True, None)
        assert len(store.claim([sent], 10, FAR, LEASE)) == 1

    def test_a_lone_checkpoint_that_settles_a_duplicate_lets_the_block_decide(
        self, store: Store
    ) -> None:
        """A copy's reply stored already: as in a usual transaction, the checkpoint reports a
        duplicate with the settle's delete made, and the block's later writes (the stored
        reply sent again) commit with it, or roll back with it."""
        queue, sent = new_id("q"), new_id("q")
        run, key = self.new_run(store), new_id("m")
        with store.transaction() as tx:
            assert store.write_checkpoint(tx, self._checkpoint(run, key)) is Written.WRITTEN
        self.enqueue(store, queue, 1)
        (row,) = store.claim([queue], 10, T0, LEASE)
        for fails in (True, False):
            expect = pytest.raises(LeaseLost) if fails else nullcontext()
            with expect, store.transaction(lone=True) as tx:
                store.settle_claimed(tx, [row.id], row.claim_token, LeaseLost())
                cp = self._checkpoint(run, key, [self.message(sent)])
                assert store.write_checkpoint(tx, cp) is Written.DUPLICATE
                store.enqueue(tx, [self.message(sent)], T0)
                if fails:
                    raise LeaseLost
            if fails:
                assert store.claim([sent], 10, FAR, LEASE) == [], "the resend rolled back"
        assert len(store.claim([sent], 10, FAR, LEASE)) == 1, "the resend, once"
        assert store.claim([queue], 10, FAR, LEASE) == [], "settled with it"
        assert [e.seq for e in store.load_history(None, run.run_id)] == [1, 2]

    def test_a_checkpoint_without_a_run_writes_its_row_and_messages(self, store: Store) -> None:
        key, queue = new_id("m"), new_id("q")
        with store.transaction() as tx:
            cp = self._checkpoint(None, key, [self.message(queue)], inbox_result={"r": [1]})
            assert store.write_checkpoint(tx, cp) is Written.WRITTEN
        assert store.inbox_get(None, "engine", key) == (True, {"r": [1]})
        assert len(store.claim([queue], 10, T0 + timedelta(seconds=1), LEASE)) == 1

    def test_a_checkpoint_may_create_its_run(self, store: Store) -> None:
        """``create``: the run has no row yet (a start no client recorded); the checkpoint
        inserts it as saved, its input offloaded when large, under the same guards: a
        duplicate creates nothing, and a row of its id is a conflict, which in a lone
        transaction writes nothing at all."""
        run = RunRecord(new_id("run"), "app", "contract", "running", [BIG], T0, T0)
        key, queue = new_id("m"), new_id("q")

        def creating(key: str) -> Checkpoint:
            cp = self._checkpoint(run, key, [self.message(queue)], output=[BIG])
            assert cp.run is not None
            ended = dataclasses.replace(cp.run, error={"message": "no"}, reason="why")
            return dataclasses.replace(cp, run=ended, create=True)

        with store.transaction(lone=True) as tx:
            assert store.write_checkpoint(tx, creating(key)) is Written.WRITTEN
        saved = store.get_run(run.run_id)
        assert saved is not None
        assert (saved.app, saved.saga, saved.status, saved.input) == (
            "app",
            "contract",
            "running",
            [BIG],
        )
        assert (saved.output, saved.error, saved.reason) == ([BIG], {"message": "no"}, "why")
        assert (saved.last_seq, saved.processed_seq, saved.created_at) == (2, 2, T0)
        assert saved.updated_at == T0 + timedelta(seconds=1)
        assert [e.seq for e in store.load_history(None, run.run_id)] == [1, 2]
        assert store.inbox_get(None, "engine", key) == (True, None)
        assert len(store.claim([queue], 10, FAR, LEASE)) == 1
        with store.transaction() as tx:
            assert store.write_checkpoint(tx, creating(key)) is Written.DUPLICATE
        other = new_id("m")
        with pytest.raises(LeaseLost), store.transaction(lone=True) as tx:
            assert store.write_checkpoint(tx, creating(other)) is Written.CONFLICT
            raise LeaseLost  # as the engine raises ActivationConflict
        assert store.inbox_get(None, "engine", other) == (False, None), "no inbox row"
        assert [e.seq for e in store.load_history(None, run.run_id)] == [1, 2]
        assert store.claim([queue], 10, FAR, LEASE) == [], "no message"

    def test_a_checkpoint_on_a_moved_run_writes_no_run(self, store: Store) -> None:
        run, queue = self.new_run(store), new_id("q")
        with store.transaction() as tx:
            assert store.write_checkpoint(tx, self._checkpoint(run, new_id("m"))) is Written.WRITTEN
        with store.transaction() as tx:  # from last_seq 0 again: the run is at 2
            cp = self._checkpoint(run, new_id("m"), [self.message(queue)])
            assert store.write_checkpoint(tx, cp) is Written.CONFLICT
        assert [e.seq for e in store.load_history(None, run.run_id)] == [1, 2]
        assert store.claim([queue], 10, T0 + timedelta(seconds=1), LEASE) == []

    def test_a_lone_checkpoint_on_a_moved_run_writes_nothing(self, store: Store) -> None:
        """A conflict's checkpoint is rolled back by its caller; when the checkpoint is its
        transaction's commit (``lone``) it must have written nothing, not even its inbox row:
        else the message would look processed and its activation would never be written."""
        run, key = self.new_run(store), new_id("m")
        with store.transaction() as tx:
            assert store.write_checkpoint(tx, self._checkpoint(run, new_id("m"))) is Written.WRITTEN
        with pytest.raises(LeaseLost), store.transaction(lone=True) as tx:
            assert store.write_checkpoint(tx, self._checkpoint(run, key)) is Written.CONFLICT
            raise LeaseLost  # the engine raises ActivationConflict: the transaction rolls back
        assert store.inbox_get(None, "engine", key) == (False, None), "no inbox row"
        assert [e.seq for e in store.load_history(None, run.run_id)] == [1, 2]

    @pytest.mark.parametrize("create", [False, True], ids=["update", "create"])
    def test_racing_checkpoints_of_a_run_write_it_once(self, store: Store, create: bool) -> None:
        """Checkpoints of one run from last_seq 0 at once, each updating it or each creating
        it: one writes it, the others conflict."""
        run = RunRecord(new_id("run"), "app", "contract", "running", {"n": 1}, T0, T0)
        if not create:
            run = self.new_run(store)

        def write(i: int) -> Callable[[], Written]:
            def go() -> Written:
                cp = dataclasses.replace(self._checkpoint(run, new_id(f"m{i}")), create=create)
                with store.transaction() as tx:
                    written = store.write_checkpoint(tx, cp)
                    time.sleep(0.05)
                    return written

            return go

        results = in_threads([write(i) for i in range(4)], self.thread_timeout)
        assert sorted(results) == [Written.CONFLICT] * 3 + [Written.WRITTEN], results
        assert [e.seq for e in store.load_history(None, run.run_id)] == [1, 2]

    def test_a_checkpoint_offloads_large_values(self, store: Store) -> None:
        run, key, queue = self.new_run(store), new_id("m"), new_id("q")
        env = Envelope(type="step_result", run_id=run.run_id, payload={"result": BIG})
        with store.transaction() as tx:
            cp = self._checkpoint(
                run, key, [Outgoing(queue, env)], output=[BIG], result=BIG, inbox_result=[BIG]
            )
            assert store.write_checkpoint(tx, cp) is Written.WRITTEN
        assert store.inbox_get(None, "engine", key) == (True, [BIG])
        saved = store.get_run(run.run_id)
        assert saved is not None and saved.output == [BIG]
        assert store.load_history(None, run.run_id)[0].data == {"result": BIG}
        [row] = store.claim([queue], 10, T0 + timedelta(seconds=1), LEASE)
        assert len(row.body) < len(BIG), "the message holds a reference"
        assert store.resolve(None, Envelope.model_validate_json(row.body)).payload == env.payload

    def test_a_checkpoint_hands_over_its_rows_with_their_ids(self, store: Store) -> None:
        fast, slow, key = new_id("q"), new_id("q"), new_id("m")
        later = T0 + timedelta(seconds=1)
        messages = [self.message(fast, 0), self.message(slow, 1), self.message(fast, 2)]
        messages.append(self.message(fast, 3, available_at=later + timedelta(minutes=5)))
        messages.append(self.message(fast, 4))
        handoff, run = _Handoff({fast}), self.new_run(store)
        store.hand_over_to(handoff)
        try:
            with store.transaction() as tx:
                cp = self._checkpoint(run, key, messages)
                assert store.write_checkpoint(tx, cp) is Written.WRITTEN
        finally:
            store.hand_over_to(None)
        taken = [(m.queue, m.body) for m in handoff.taken]
        assert taken == [(fast, messages[n].envelope.to_bytes()) for n in (0, 2, 4)]
        for m in handoff.taken:  # each id is its own row's, claimed with the handoff's token
            assert m.claim_token == handoff.token and m.deliveries == 1
            assert store.delete_claimed(None, [m.id], m.claim_token) == 1
        assert store.claim([fast], 10, later, LEASE) == [], "no row left but the delayed one"
        [row] = store.claim([slow], 10, later, LEASE)
        assert row.body == messages[1].envelope.to_bytes(), "a queue without a lease: queued"
