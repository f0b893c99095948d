"""The engine takes the messages it has prefetched as a batch: one transaction, one commit, and
a bad message in the batch costs only itself."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import event

from sagaloop import App, Client, SagaContext, StepContext
from sagaloop.brokers.database import DatabaseBroker
from sagaloop.engine import history as h
from sagaloop.engine.activation import ENGINE_CONSUMER, ActivationConflict, Engine
from sagaloop.engine.messages import Envelope, engine_queue, inbox_key, start_queue
from sagaloop.engine.ports import Delivery, Outgoing
from sagaloop.runtime.consumers import EngineConsumer, decode
from sagaloop.store.sql import SqlStore

app = App("batch")


@app.step(queue="q")
def echo(ctx: StepContext, n: int) -> int:
    return n


@app.saga(name="call")
async def call(ctx: SagaContext, n: int) -> int:
    return await ctx.call(echo, n)


@app.saga(name="wait")
async def wait(ctx: SagaContext) -> str:
    return str(await ctx.wait_for_event("go"))


@pytest.fixture
def store(tmp_path: Path) -> Iterator[SqlStore]:
    store = SqlStore(f"sqlite:///{tmp_path / 'batch.db'}")
    store.upgrade()
    yield store
    store.close()


def _commits(store: SqlStore) -> list[int]:
    commits = [0]

    @event.listens_for(store.engine, "commit")
    def _count(_conn: object) -> None:
        commits[0] += 1

    return commits


def _take(store: SqlStore, n: int) -> list[Delivery]:
    broker = DatabaseBroker(store)
    deliveries = broker.receive([engine_queue(app.name), start_queue(app.name)], 16, 0)
    assert len(deliveries) == n
    return deliveries


def _processed_copy(store: SqlStore, client: Client, run_id: str, event: str) -> None:
    """An event for ``run_id`` on the engine queue whose first delivery was processed already
    (its inbox row is there): a copy published again after a crash."""
    name, now = str(client.app_name), client.clock.now()
    dup = Envelope(
        type="event",
        message_id="copy-1",
        run_id=run_id,
        payload={"name": event, "data": None},
        created_at=now,
    )
    with store.transaction() as tx:
        store.enqueue(tx, [Outgoing(engine_queue(name), dup)], now)
        store.inbox_put(tx, ENGINE_CONSUMER, inbox_key(name, dup), None, now)


def test_a_batch_is_one_transaction(store: SqlStore) -> None:
    client = Client(store, app)
    ids = [client.start("call", i, run_id=f"run-{i}") for i in (3, 1, 2)]
    deliveries = _take(store, 3)
    commits = _commits(store)
    EngineConsumer(Engine(app, store), store).process_batch(deliveries)
    assert commits == [1]
    for run_id in ids:
        kinds = [e.kind for e in client.history(run_id)]
        assert kinds[-1] == h.STEP_SCHEDULED, kinds
    assert store.queue_depths() == {"batch.steps.q": 3}, "settled: the engine queue is empty"


def test_a_run_s_messages_keep_their_order_within_a_batch(store: SqlStore) -> None:
    client = Client(store, app)
    client.start("wait", run_id="z-waiter")
    client.start("call", 7, run_id="a-caller")  # sorts first: runs are locked in id order
    client.send_event("z-waiter", "go", "now")
    deliveries = _take(store, 3)
    EngineConsumer(Engine(app, store), store).process_batch(deliveries)
    waiter = client.get("z-waiter")
    assert waiter.status == "completed" and waiter.output == "now"


def test_a_bad_message_costs_only_itself(store: SqlStore) -> None:
    client = Client(store, app)
    client.start("call", 1, run_id="good-1")
    bad = {
        "type": "event",
        "message_id": "m-bad",
        "run_id": "no-such-run",
        "payload": {"name": "go", "data": None},
    }
    store.enqueue_raw([(engine_queue(app.name), json.dumps(bad).encode())], client.clock.now())
    client.start("call", 2, run_id="good-2")
    deliveries = _take(store, 3)
    commits = _commits(store)
    EngineConsumer(Engine(app, store), store).process_batch(deliveries)
    for run_id in ("good-1", "good-2"):
        assert client.history(run_id)[-1].kind == h.STEP_SCHEDULED
    letters = store.dead_letters()
    assert [(q, reason) for q, _, reason in letters] == [
        (engine_queue(app.name), "no run with id 'no-such-run'")
    ]
    assert commits[0] >= 3, "the batch rolled back, then one transaction per message"


def test_a_duplicate_ahead_of_a_live_message_of_its_run_does_not_swallow_its_activation(
    store: SqlStore,
) -> None:
    """A run not yet activated (its start, or a continue-as-new's, still to be processed) and,
    ahead of that message in one batch, a duplicate the inbox already holds (a copy
    published again after a crash). The duplicate's activation is discarded at apply; the
    live message must not be taken as done on the strength of it: the run is activated."""
    client = Client(store, app)
    _processed_copy(store, client, "r-1", "go")
    client.start("call", 5, run_id="r-1")
    deliveries = _take(store, 2)  # the copy first (its row is older), then the start
    EngineConsumer(Engine(app, store), store).process_batch(deliveries)
    kinds = [e.kind for e in client.history("r-1")]
    assert kinds[-1] == h.STEP_SCHEDULED, kinds
    assert store.queue_depths() == {"batch.steps.q": 1}, "both settled, the step dispatched"


def test_a_run_is_in_one_open_stage_at_a_time(store: SqlStore) -> None:
    """Transactions of one engine may overlap (each prepares in a stage of its own, see
    ``Engine.stage``), never on one run: preparing a run that another open stage holds is a
    conflict; each stage keeps what it did apart until it ends, in whatever order they end."""
    client = Client(store, app)
    client.start("wait", run_id="r-1")
    client.start("wait", run_id="r-2")
    engine = Engine(app, store)
    EngineConsumer(engine, store).process_batch(_take(store, 2))  # both wait, in the cache
    client.send_event("r-1", "go", "one")
    client.send_event("r-2", "go", "two")
    envs = {e.run_id: e for d in _take(store, 2) if (e := decode(d, store)) is not None}
    first, second = engine.stage(), engine.stage()
    plan_1 = engine.prepare(envs["r-1"], trust_cache=True, stage=first)
    assert engine.holds(["r-1"]) and not engine.holds(["r-2"])
    with pytest.raises(ActivationConflict, match="in another open transaction"):
        engine.prepare(envs["r-1"], trust_cache=True, stage=second)
    plan_2 = engine.prepare(envs["r-2"], trust_cache=True, stage=second)
    with store.transaction() as tx:
        engine.apply(tx, plan_2)
    engine.committed(second)  # the later stage ends first
    assert engine.holds(["r-1"]) and not engine.holds(["r-2"])
    with store.transaction() as tx:
        engine.apply(tx, plan_1)
    engine.committed(first)
    assert not engine.holds(["r-1", "r-2"])
    assert (client.get("r-1").output, client.get("r-2").output) == ("one", "two")


def test_saga_code_dropped_with_a_duplicate_unwinds_under_the_engines_lock(
    store: SqlStore,
) -> None:
    """A transaction writes without the engine's lock (``EngineConsumer.transaction``), but
    saga code, its unwinding too, runs only under it: the code of a run whose message turns
    out a duplicate when applied is dropped when the transaction's stage ends, not in apply."""
    unwound: list[bool] = []
    other = App("unwind")

    @other.saga(name="w")
    async def w(ctx: SagaContext) -> None:
        try:
            await ctx.wait_for_event("go")
            await ctx.wait_for_event("more")
        finally:
            unwound.append(consumer.lock._is_owned())  # type: ignore[attr-defined]

    client = Client(store, other)
    consumer = EngineConsumer(Engine(other, store), store)
    client.start("w", run_id="r-1")
    broker = DatabaseBroker(store)
    queues = [engine_queue(other.name), start_queue(other.name)]
    consumer.process_batch(broker.receive(queues, 16, 0))  # it waits for "go", in the cache
    _processed_copy(store, client, "r-1", "go")
    consumer.process_batch(broker.receive(queues, 16, 0))  # prepared: it waits for "more"
    assert unwound == [True], "dropped at apply, outside the lock"
    assert h.EVENT_ARRIVED not in [e.kind for e in client.history("r-1")], "nothing written"
