"""Run concurrency keys (issue 25): ``@app.saga(concurrency=Concurrency(limit, key, at_limit))``
keeps at most ``limit`` runs of a key running their code; at the limit a start queues, cancels
the running one or is cancelled itself."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import closing
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from sagaloop import App, Client, SagaContext
from sagaloop.brokers.database import DatabaseBroker
from sagaloop.engine import history as h
from sagaloop.engine.activation import ActivationConflict, Engine
from sagaloop.engine.messages import Envelope, engine_queue, start_queue
from sagaloop.engine.ports import KeySlots
from sagaloop.errors import DeclarationError
from sagaloop.sagas.concurrency import Concurrency
from sagaloop.store.sql import SqlStore
from sagaloop.testing import Harness


def gated_app(limit: Concurrency) -> App:
    """A saga that waits for the event ``go`` once started: its code started iff it waits."""
    app = App("gated")

    @app.saga(name="job", concurrency=limit)
    async def job(ctx: SagaContext, input: dict[str, Any]) -> str:
        await ctx.wait_for_event("go")
        return str(input["n"])

    return app


def started(harness: Harness, run_id: str) -> bool:
    """Whether the run's saga code started: an engine processed its history."""
    return harness.get(run_id).processed_seq > 0


def test_queue_starts_runs_of_a_key_in_start_order_when_slots_free() -> None:
    app = gated_app(Concurrency(limit=1, key=lambda i: i["user"]))
    with closing(Harness(app)) as harness:
        first = harness.start("job", {"user": "u1", "n": 1})
        second = harness.start("job", {"user": "u1", "n": 2})
        third = harness.start("job", {"user": "u1", "n": 3})
        other = harness.start("job", {"user": "u2", "n": 4})  # another key: not limited
        harness.run_until_idle()
        assert started(harness, first) and started(harness, other)
        assert not started(harness, second) and not started(harness, third)
        words = harness.status(third).waiting_for
        assert any("queued behind 2 runs of key 'u1'" in w for w in words), words
        assert harness.get(third).status == "running"  # recorded, not started

        harness.send_event(first, "go")
        harness.run_until_idle()
        assert harness.result(first) == "1"
        assert started(harness, second) and not started(harness, third)
        words = harness.status(third).waiting_for  # its place, told by the release
        assert any("queued behind 1 run of key 'u1'" in w for w in words), words
        harness.send_event(second, "go")
        harness.run_until_idle()
        assert started(harness, third)
        harness.send_event(third, "go")
        harness.run_until_idle()
        assert harness.result(third) == "3"


def test_queue_with_limit_two_and_one_key_per_saga() -> None:
    app = gated_app(Concurrency(limit=2))  # no key function: one key for the saga
    with closing(Harness(app)) as harness:
        runs = [harness.start("job", {"n": n}) for n in range(4)]
        harness.run_until_idle()
        assert [started(harness, r) for r in runs] == [True, True, False, False]
        harness.send_event(runs[1], "go")
        harness.run_until_idle()
        assert [started(harness, r) for r in runs] == [True, True, True, False]


def test_an_event_to_a_queued_run_waits_with_it_and_a_cancel_ends_it_unstarted() -> None:
    app = gated_app(Concurrency(limit=1))
    with closing(Harness(app)) as harness:
        first = harness.start("job", {"n": 1})
        second = harness.start("job", {"n": 2})
        third = harness.start("job", {"n": 3})
        harness.run_until_idle()
        harness.send_event(second, "go")  # recorded; seen by its code once it starts
        harness.cancel(third, "not needed")
        harness.run_until_idle()
        assert not started(harness, second)
        assert harness.get(third).status == "cancelled"
        harness.send_event(first, "go")
        harness.run_until_idle()
        assert harness.result(second) == "2"  # it started and took the event recorded


def test_cancel_new_ends_the_new_run_cancelled_naming_its_key() -> None:
    app = gated_app(Concurrency(limit=1, key=lambda i: i["user"], at_limit="cancel_new"))
    with closing(Harness(app)) as harness:
        first = harness.start("job", {"user": "u1", "n": 1})
        harness.run_until_idle()
        second = harness.start("job", {"user": "u1", "n": 2})
        harness.run_until_idle()
        assert harness.get(second).status == "cancelled"
        assert not any(e.kind == h.EVENT_WAITING for e in harness.history(second))
        reason = harness.status(second).cancel_reason or ""
        assert "'u1'" in reason and "cancel_new" in reason
        harness.send_event(first, "go")
        harness.run_until_idle()
        assert harness.result(first) == "1"
        third = harness.start("job", {"user": "u1", "n": 3})  # the slot is free again
        harness.run_until_idle()
        assert started(harness, third) and harness.get(third).status == "waiting"


def test_cancel_in_progress_cancels_the_running_run_and_starts_the_new() -> None:
    app = gated_app(Concurrency(limit=1, at_limit="cancel_in_progress"))
    with closing(Harness(app)) as harness:
        first = harness.start("job", {"n": 1})
        harness.run_until_idle()
        second = harness.start("job", {"n": 2})
        harness.run_until_idle()
        assert harness.get(first).status == "cancelled"
        assert "cancel_in_progress" in (harness.status(first).cancel_reason or "")
        assert started(harness, second)
        harness.send_event(second, "go")
        harness.run_until_idle()
        assert harness.result(second) == "2"


def test_a_bad_key_fails_the_start_saying_why() -> None:
    app = gated_app(Concurrency(key=lambda i: i["user"]))
    with closing(Harness(app)) as harness:
        run = harness.start("job", {"n": 1})
        harness.run_until_idle()
        record = harness.get(run)
        assert record.status == "failed"
        assert "concurrency key function raised KeyError" in str(record.error)


@pytest.mark.parametrize(
    "kwargs",
    [{"limit": 0}, {"limit": True}, {"key": "user"}, {"at_limit": "drop"}],
)
def test_bad_declarations_are_refused(kwargs: dict[str, Any]) -> None:
    with pytest.raises(DeclarationError):
        Concurrency(**kwargs)
    app = App("bad")
    with pytest.raises(DeclarationError, match="concurrency="):

        @app.saga(concurrency=3)  # type: ignore[arg-type]
        async def job(ctx: SagaContext) -> None: ...


# --- exact across engines ------------------------------------------------------------------


@pytest.fixture
def store(tmp_path: Path) -> Iterator[SqlStore]:
    store = SqlStore(f"sqlite:///{tmp_path / 'slots.db'}")
    store.upgrade()
    yield store
    store.close()


def _starts(store: SqlStore, app: App) -> list[Envelope]:
    broker = DatabaseBroker(store)
    deliveries = broker.receive([engine_queue(app.name), start_queue(app.name)], 16, 0)
    return [Envelope.model_validate_json(d.body) for d in deliveries]


def test_two_engines_racing_for_the_last_slot_never_exceed_the_limit(store: SqlStore) -> None:
    app = gated_app(Concurrency(limit=1))
    client = Client(store, app)
    client.start("job", {"n": 1}, run_id="a")
    client.start("job", {"n": 2}, run_id="b")
    env_a, env_b = sorted(_starts(store, app), key=lambda e: e.run_id)
    one, two = Engine(app, store), Engine(app, store)
    plan_a, plan_b = one.prepare(env_a), two.prepare(env_b)  # both see the slot free
    assert plan_a.slot is not None and plan_b.slot is not None
    assert (plan_a.slot.kind, plan_b.slot.kind) == ("claim", "claim")
    with store.transaction() as tx:
        one.apply(tx, plan_a)
    one.committed()
    with pytest.raises(ActivationConflict), store.transaction() as tx:
        two.apply(tx, plan_b)  # the key moved: prepared again, it queues
    two.rolled_back()
    again = two.prepare(env_b)
    assert again.slot is not None and again.slot.kind == "queue"
    with store.transaction() as tx:
        two.apply(tx, again)
    two.committed()
    assert store.key_slots(None, app.name, "job", "") == KeySlots({0: "a"}, ["b"])
    assert client.get("a").processed_seq > 0 and client.get("b").processed_seq == 0


def test_the_slot_row_is_unique_and_a_rolled_back_claim_holds_nothing(store: SqlStore) -> None:
    now = datetime.now(UTC)
    with store.transaction() as tx:
        assert store.claim_slot(tx, "x", "job", "k", 0, "a", now)
        assert not store.claim_slot(tx, "x", "job", "k", 0, "b", now)  # the primary key
    with pytest.raises(RuntimeError), store.transaction() as tx:  # a crash before the commit
        assert store.claim_slot(tx, "x", "job", "k", 1, "c", now)
        raise RuntimeError("crash")
    assert store.key_slots(None, "x", "job", "k") == KeySlots({0: "a"}, [])
    with store.transaction() as tx:
        assert store.release_slot(tx, "a") == ("x", "job", "k")
        assert store.release_slot(tx, "a") is None
    assert store.key_slots(None, "x", "job", "k") == KeySlots({}, [])


def test_a_run_s_end_frees_its_slot_in_the_same_transaction(store: SqlStore) -> None:
    app = gated_app(Concurrency(limit=1))
    client = Client(store, app)
    client.start("job", {"n": 1}, run_id="a")
    client.start("job", {"n": 2}, run_id="b")
    engine = Engine(app, store)
    for env in sorted(_starts(store, app), key=lambda e: e.run_id):
        with store.transaction() as tx:
            engine.apply(tx, engine.prepare(env))
        engine.committed()
    client.send_event("a", "go")
    (event,) = _starts(store, app)
    plan = engine.prepare(event)
    with pytest.raises(RuntimeError), store.transaction() as tx:
        engine.apply(tx, plan)
        assert store.key_slots(tx, app.name, "job", "") == KeySlots({}, ["b"])
        raise RuntimeError("crash before the commit")
    engine.rolled_back()
    assert client.get("a").status != "completed"
    assert store.key_slots(None, app.name, "job", "") == KeySlots({0: "a"}, ["b"])
    with store.transaction() as tx:
        engine.apply(tx, engine.prepare(event))
    engine.committed()
    assert client.get("a").status == "completed"
    (wake,) = _starts(store, app)  # the wake of the queued run, sent with the end
    assert (wake.type, wake.run_id) == ("start", "b")
    with store.transaction() as tx:
        engine.apply(tx, engine.prepare(wake))
    engine.committed()
    assert store.key_slots(None, app.name, "job", "") == KeySlots({0: "b"}, [])


def test_child_runs_of_a_limited_saga_queue_too() -> None:
    app = gated_app(Concurrency(limit=1, key=lambda i: i["user"]))

    @app.saga(name="parent")
    async def parent(ctx: SagaContext, n: int) -> str:
        return await ctx.call(app.sagas["job"], {"user": "u1", "n": n})

    with closing(Harness(app)) as harness:
        first = harness.start("parent", 1)
        second = harness.start("parent", 2)
        harness.run_until_idle()
        children = harness.client.list(saga="job")
        assert len(children) == 2
        waiting = [c.run_id for c in children if not started(harness, c.run_id)]
        running = [c.run_id for c in children if started(harness, c.run_id)]
        assert len(waiting) == 1 and len(running) == 1
        harness.send_event(running[0], "go")
        harness.run_until_idle()
        assert started(harness, waiting[0])
        harness.send_event(waiting[0], "go")
        harness.run_until_idle()
        assert sorted([harness.result(first), harness.result(second)]) == ["1", "2"]


def test_an_event_processed_before_its_start_does_not_start_the_code(store: SqlStore) -> None:
    """Signal-with-start: the event (engine queue) may be processed before the start (start
    queue, behind the work in flight); it is recorded, and the code starts only with a slot."""
    app = gated_app(Concurrency(limit=1))
    client = Client(store, app)
    engine = Engine(app, store)
    client.start("job", {"n": 1}, run_id="a")
    (start_a,) = _starts(store, app)
    with store.transaction() as tx:
        engine.apply(tx, engine.prepare(start_a))
    engine.committed()
    client.start("job", {"n": 2}, run_id="b", event=("go", None))
    start_b, event_b = sorted(_starts(store, app), key=lambda e: e.type != "event")
    for env in (start_b, event_b) if start_b.type == "event" else (event_b, start_b):
        with store.transaction() as tx:
            engine.apply(tx, engine.prepare(env))
        engine.committed()
    assert client.get("b").processed_seq == 0, "its code started beside a's: over the limit"
    assert store.key_slots(None, app.name, "job", "") == KeySlots({0: "a"}, ["b"])


def test_an_event_sent_with_the_start_does_not_start_the_code_without_a_slot() -> None:
    """Signal-with-start: the event (engine queue) may be processed before the start (start
    queue); it is recorded, and the code starts only with a slot."""
    app = gated_app(Concurrency(limit=1))
    with closing(Harness(app)) as harness:
        first = harness.start("job", {"n": 1})
        harness.run_until_idle()
        second = harness.client.start("job", {"n": 2}, event=("go", None))
        harness.run_until_idle()
        assert not started(harness, second), "it ran beside the first: over the limit"
        harness.send_event(first, "go")
        harness.run_until_idle()
        assert harness.result(first) == "1" and harness.result(second) == "2"


def test_a_start_published_without_a_client_queues_creating_its_run(store: SqlStore) -> None:
    app = gated_app(Concurrency(limit=1))
    engine = Engine(app, store)
    client = Client(store, app)
    for run_id, n in (("a", 1), ("b", 2)):  # as a plain publisher on the broker would
        env = Envelope(type="start", run_id=run_id, saga="job", payload={"input": {"n": n}})
        with store.transaction() as tx:
            engine.apply(tx, engine.prepare(env))
        engine.committed()
    queued = client.get("b")
    assert (queued.status, queued.processed_seq, queued.last_seq) == ("running", 0, 1)
    assert [e.kind for e in client.history("b")] == [h.RUN_STARTED]
    assert store.key_slots(None, app.name, "job", "") == KeySlots({0: "a"}, ["b"])


def test_a_queued_run_s_code_starts_when_it_claims_its_slot_its_clock_too() -> None:
    """A run queued for a slot starts its code later than its run_started: ``ctx.now()`` is
    the claim's time, and its durable sleeps last their duration from there (they counted
    from the start, so a run queued longer than its sleep did not sleep at all)."""
    app = App("queued-clock")
    seen: dict[str, Any] = {}

    @app.saga(name="job", concurrency=Concurrency(limit=1))
    async def job(ctx: SagaContext, n: int) -> None:
        seen[f"begun-{n}"] = ctx.now()
        await ctx.sleep(timedelta(seconds=2))
        seen[f"woke-{n}"] = ctx.now()

    env = Harness(app)
    t0 = env.clock.now()
    first, second = env.start(job, 1), env.start(job, 2)
    env.run_until_idle()
    assert env.result(first) is None and env.result(second) is None
    assert seen["begun-2"] - t0 == timedelta(seconds=2)  # when the first ended
    assert seen["woke-2"] - t0 == timedelta(seconds=4)
    ends = {r: env.get(r).updated_at - t0 for r in (first, second)}
    assert ends == {first: timedelta(seconds=2), second: timedelta(seconds=4)}
    assert [e.kind for e in env.history(second)][:2] == [h.RUN_STARTED, h.SLOT_CLAIMED]
