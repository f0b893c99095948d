"""A lone transaction on PostgreSQL (``store.transaction(lone=True)``): when the checkpoint is
its first write, the checkpoint's one statement is the whole transaction, with no ``BEGIN``
and no ``COMMIT`` (a worker's reply: 2 round trips instead of 4); any other first write
begins a usual transaction, and nothing written after the statement can slip out of it.

The engine applies a message whose plan is its checkpoint alone (``Engine.alone``) in a lone
transaction; every other plan (a timer, an approval, a subscription, a freed slot) in a usual
one, whose writes all commit together."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import closing
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import event

from sagaloop import App, Concurrency, SagaContext, StepContext
from sagaloop.engine.activation import Engine
from sagaloop.engine.messages import Envelope
from sagaloop.engine.ports import Checkpoint, Outgoing, Written
from sagaloop.store.sql import SqlStore
from sagaloop.testing import Harness

pytestmark = pytest.mark.integration

T0 = datetime(2030, 1, 2, tzinfo=UTC)


@pytest.fixture
def store(database: str) -> Iterator[SqlStore]:
    store = SqlStore(database)
    with store.transaction() as tx:
        tx.conn.exec_driver_sql("TRUNCATE sagaloop_inbox, sagaloop_outbox")
    yield store
    store.close()


class _Boom(Exception):
    pass


def _trips(store: SqlStore) -> list[str]:
    """The round trips of the store's transactions: each statement, and the ``BEGIN`` and
    ``COMMIT`` psycopg sends for a transaction that does not autocommit."""
    seen: list[str] = []

    def transaction(kind: str) -> Any:
        def listener(conn: Any, *_: Any) -> None:
            if conn.get_execution_options().get("isolation_level") != "AUTOCOMMIT":
                seen.append(kind)

        return listener

    event.listen(store.engine, "before_cursor_execute", lambda *a: seen.append(a[2].split()[0]))
    event.listen(store.engine, "begin", transaction("BEGIN"))
    event.listen(store.engine, "commit", transaction("COMMIT"))
    return seen


def _reply(message_id: str) -> Checkpoint:
    env = Envelope(type="step_result", message_id=f"r-{message_id}", run_id="run", created_at=T0)
    return Checkpoint(T0, ("worker", message_id, {"ok": 1}), messages=[Outgoing("replies", env)])


def _inbox(store: SqlStore, message_id: str) -> bool:
    return store.inbox_get(None, "worker", message_id)[0]


def test_a_lone_checkpoint_is_one_statement(store: SqlStore) -> None:
    trips = _trips(store)
    with store.transaction(lone=True) as tx:
        assert store.write_checkpoint(tx, _reply("m1")) is Written.WRITTEN
    # the rows nobody holds (no relay takes them in memory here) wake other processes' relays
    assert trips == ["WITH", "NOTIFY"], "the statement alone: no BEGIN, no COMMIT"
    assert _inbox(store, "m1") and store.queue_depths() == {"replies": 1}


def test_a_write_before_the_checkpoint_begins_a_transaction(store: SqlStore) -> None:
    """Both writes commit together, or neither does."""
    env = Envelope(type="event", message_id="e", run_id="run", created_at=T0)
    trips = _trips(store)
    with pytest.raises(_Boom), store.transaction(lone=True) as tx:
        store.enqueue(tx, [Outgoing("events", env)], T0)
        store.write_checkpoint(tx, _reply("m2"))
        raise _Boom
    assert trips[:1] == ["BEGIN"] and trips[-1] == "ROLLBACK", trips
    assert not _inbox(store, "m2") and store.queue_depths() == {}, "nothing committed"
    with store.transaction(lone=True) as tx:
        store.enqueue(tx, [Outgoing("events", env)], T0)
        store.write_checkpoint(tx, _reply("m2"))
    assert _inbox(store, "m2") and store.queue_depths() == {"events": 1, "replies": 1}


def test_no_write_after_a_lone_checkpoint(store: SqlStore) -> None:
    """The statement committed the transaction: a write after it would commit alone, so it
    is refused (the caller broke ``lone``'s promise)."""
    env = Envelope(type="event", message_id="e", run_id="run", created_at=T0)
    with pytest.raises(RuntimeError, match="no write after"), store.transaction(lone=True) as tx:
        store.write_checkpoint(tx, _reply("m3"))
        store.enqueue(tx, [Outgoing("events", env)], T0)
    assert _inbox(store, "m3") and store.queue_depths() == {"replies": 1}


def test_a_duplicate_lone_checkpoint_leaves_the_transaction_open(store: SqlStore) -> None:
    """A copy's checkpoint writes nothing (its reply is stored already): the worker then sends
    the stored reply again, in a transaction that begins with that write."""
    with store.transaction(lone=True) as tx:
        store.write_checkpoint(tx, _reply("m4"))
    trips = _trips(store)
    env = Envelope(type="step_result", message_id="again", run_id="run", created_at=T0)
    with pytest.raises(_Boom), store.transaction(lone=True) as tx:
        assert store.write_checkpoint(tx, _reply("m4")) is Written.DUPLICATE
        store.enqueue(tx, [Outgoing("replies", env)], T0)
        raise _Boom
    assert trips == ["WITH", "BEGIN", "INSERT", "ROLLBACK"], trips
    assert store.queue_depths() == {"replies": 1}, "the resend rolled back"


def _blocks(trips: list[str]) -> list[list[str]]:
    """The writes of ``trips`` by transaction: ``BEGIN`` to ``COMMIT``, or one statement that
    autocommits (reads and ``NOTIFY`` left out)."""
    blocks: list[list[str]] = []
    open_: list[str] | None = None
    for trip in trips:
        if trip == "BEGIN":
            open_ = []
        if open_ is not None:
            open_.append(trip)
            if trip in ("COMMIT", "ROLLBACK"):
                blocks.append(open_)
                open_ = None
        elif trip not in ("SELECT", "NOTIFY"):
            blocks.append([trip])
    return blocks


app = App("lone")


@app.step(queue="work")
def add(ctx: StepContext, x: int) -> int:
    return x + 1


@app.saga(name="everything", concurrency=Concurrency(limit=1))
async def everything(ctx: SagaContext, x: int) -> dict[str, Any]:
    """Plain steps, then each write an activation makes after its checkpoint: a subscription,
    a timer, an approval asked and answered, a published event, the slot freed at the end."""
    for _ in range(3):
        x = await ctx.call(add, x)
    ctx.subscribe("price", key="k")
    await ctx.sleep(timedelta(minutes=5))
    ok = await ctx.approval("refund", {"x": x})
    price = await ctx.wait_for_event("price")
    ctx.unsubscribe("price", key="k")
    return {"x": await ctx.call(add, x), "approved": ok.approved, "price": price}


def test_the_engine_commits_a_checkpoint_alone_with_its_statement(database: str) -> None:
    """Each engine transaction is either the checkpoint's statement alone (no ``BEGIN``, no
    ``COMMIT``) or a usual one; an activation that writes after its checkpoint is never lone
    (the store would refuse the write: the run would not finish)."""
    with closing(Harness(app, url=database, broker="memory")) as h:
        trips = _trips(h.store)
        engine: list[list[str]] = []  # the round trips of each message the engine processed
        roles: list[str] = []
        h.crash_hook = lambda role, _: roles.append(role)

        def drain() -> None:
            while True:
                trips.clear(), roles.clear()
                if not h.step_once():
                    return
                if roles == ["engine"]:  # its transaction is the step's last (a relay's first)
                    engine.append(_blocks(trips)[-1])

        run_id = h.start("everything", 1)
        drain()
        h.advance(timedelta(minutes=5))
        drain()
        (pending,) = h.approvals(run_id)
        h.approve(run_id, pending.call_id)
        drain()
        h.publish_event(run_id, "price", 42)
        drain()
        assert h.result(run_id) == {"x": 5, "approved": True, "price": 42}
        assert h.approvals(run_id) == [] and h.store.get_run(run_id).status == "completed"
    # the replies of the first two steps each schedule the next step: nothing but the checkpoint
    assert [t for t in engine if t[0] != "BEGIN"] == [["WITH"], ["WITH"]], engine
    # the start (its slot), the subscription and the timer, the approval asked, its answer
    # (the timer's wait over), the event with the last step (the subscription dropped)
    usual = [t for t in engine if t[0] == "BEGIN"]
    assert len(usual) == 5 and all(t[-1] == "COMMIT" for t in usual), engine
    assert all(len(t) > 3 for t in usual), "each writes more than its checkpoint"


def test_a_lone_checkpoint_carries_its_settle(store: SqlStore) -> None:
    """The message's row deleted in the statement: still one round trip. Its lease lost, the
    statement aborts, writes nothing and runs again in a usual transaction, which the lost
    lease rolls back."""
    env = Envelope(type="step", message_id="s", run_id="run", created_at=T0)
    with store.transaction() as tx:
        store.enqueue(tx, [Outgoing("lane", env)], T0)
    (row,) = store.claim(["lane"], 10, T0, timedelta(minutes=1))
    trips = _trips(store)
    with pytest.raises(_Boom), store.transaction(lone=True) as tx:
        store.settle_claimed(tx, [row.id], "not-the-token", _Boom())
        store.write_checkpoint(tx, _reply("m5"))
    assert trips == ["WITH", "BEGIN", "WITH", "ROLLBACK"], trips
    assert not _inbox(store, "m5") and store.queue_depths() == {"lane": 1}, "nothing written"
    trips.clear()
    with store.transaction(lone=True) as tx:
        store.settle_claimed(tx, [row.id], row.claim_token, _Boom())
        assert store.write_checkpoint(tx, _reply("m5")) is Written.WRITTEN
    assert trips == ["WITH", "NOTIFY"], trips
    assert _inbox(store, "m5") and store.queue_depths() == {"replies": 1}, "settled with it"


@app.step(local=True)
def here(ctx: StepContext, x: int) -> int:
    return x * 2


@app.saga(name="in_process")
async def in_process(ctx: SagaContext, x: int) -> int:
    for _ in range(4):
        x = await ctx.call(here, x)
    return x


def test_an_in_process_steps_checkpoint_is_its_one_statement(database: str) -> None:
    """The reply of an in-process step whose plan is the next step's message: its lane row's
    delete, its inbox row and the run's activation are the statement alone."""
    with closing(Harness(app, url=database, broker="memory")) as h:
        trips = _trips(h.store)
        local: list[list[str]] = []  # the transactions of each in-process step's message
        roles: list[str] = []
        h.crash_hook = lambda role, _: roles.append(role)
        run_id = h.start("in_process", 1)
        while True:
            trips.clear(), roles.clear()
            if not h.step_once():
                break
            if roles == ["worker"]:  # the harness claims the row first (an engine has it
                local.append(_blocks(trips)[-1])  # in memory); its checkpoint is the last
        assert h.result(run_id) == 16
    # the first three schedule the next step; the last ends the run (its timers cleared)
    assert local[:3] == [["WITH"]] * 3, local
    assert len(local) == 4 and local[3][0] == "BEGIN" and local[3][-1] == "COMMIT", local


def test_a_start_no_client_recorded_is_its_one_statement(database: str) -> None:
    """A start a plain publisher sent (no run row yet): the run is created by its checkpoint's
    statement, the whole transaction; only the run's row is read first (a run with no events
    has no history to read), below SQLAlchemy's statement layer (``SqlCore._fetch_one``)."""
    with closing(SqlStore(database)) as store:
        engine, trips = Engine(app, store), _trips(store)
        fetch_one = store._fetch_one

        def read(sql: str, *args: Any) -> Any:
            trips.append(f"read: {sql.split()[0]}")
            return fetch_one(sql, *args)

        store._fetch_one = read  # type: ignore[method-assign]
        run_id = f"plain-{uuid.uuid4().hex}"
        env = Envelope(type="start", run_id=run_id, saga="in_process", payload={"input": 3})
        plan = engine.prepare(env)
        assert engine.alone([plan])
        with store.transaction(lone=True) as tx:
            engine.apply(tx, plan)
        engine.committed()
        assert [t for t in trips if t != "NOTIFY"] == ["read: SELECT", "WITH"], trips
        run = store.get_run(run_id)
        assert run is not None and (run.saga, run.input, run.last_seq) == ("in_process", 3, 2)
        kinds = [e.kind for e in store.load_history(None, run_id)]
        assert kinds == ["run_started", "step_scheduled"]
