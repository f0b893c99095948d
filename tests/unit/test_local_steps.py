"""In-process steps (``local=True``): run by the engine's process, outside any transaction, then
checkpointed with the same rules as a worker's steps (see sagaloop/runtime/local.py)."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest

from sagaloop import App, RetryPolicy, SagaContext, StepContext
from sagaloop.client import Client
from sagaloop.engine import history as h
from sagaloop.engine.messages import StepTask, inbox_key, local_queue
from sagaloop.runtime import crashpoints
from sagaloop.runtime.consumers import decode
from sagaloop.runtime.crashpoints import CrashPointRaised
from sagaloop.runtime.local import _Checkpoint
from sagaloop.store.sql import SqlStore
from sagaloop.testing import Harness

FAST = RetryPolicy(max_attempts=3, initial_interval=timedelta(milliseconds=10))


def test_in_process_steps_need_no_worker_and_record_the_engine_as_their_worker() -> None:
    app = App("inproc")

    @app.step(local=True)
    def double(ctx: StepContext, x: int) -> int:
        return 2 * x

    @app.saga(name="s")
    async def s(ctx: SagaContext, x: int) -> int:
        return await ctx.call(double, await ctx.call(double, x))

    assert app.queues == []  # nothing for a worker process
    env = Harness(app)
    run_id = env.start(s, 3)
    env.run_until_idle()
    assert env.result(run_id) == 12
    done = [e for e in env.history(run_id) if e.kind == h.STEP_COMPLETED]
    assert [e.data["worker"] for e in done] == ["engine", "engine"]


def test_an_in_process_step_runs_after_its_dispatch_is_committed(tmp_path: Path) -> None:
    """The body runs outside the activation's transaction: when it runs, the history already
    says that it was scheduled, as seen from another connection (before, a local step ran
    while its activation was being prepared, before anything of it was committed)."""
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    seen: list[list[str]] = []
    app = App("committed")

    @app.step(local=True)
    def look(ctx: StepContext) -> None:
        other = SqlStore(url)
        try:
            seen.append([e.kind for e in Client(other, app).history(ctx.run_id)])
        finally:
            other.close()

    @app.saga(name="s")
    async def s(ctx: SagaContext) -> None:
        await ctx.call(look)

    env = Harness(app, url=url)
    run_id = env.start(s)
    env.run_until_idle()
    assert env.get(run_id).status == "completed"
    assert seen == [[h.RUN_STARTED, h.STEP_SCHEDULED]]


def test_one_transaction_stores_the_result_and_goes_on_with_the_run() -> None:
    """The step's row, its reply and the run's next decision are one commit: no reply message
    travels to the engine queue."""
    app = App("onecommit")

    @app.step(local=True)
    def inc(ctx: StepContext, x: int) -> int:
        return x + 1

    @app.saga(name="s")
    async def s(ctx: SagaContext) -> int:
        return await ctx.call(inc, await ctx.call(inc, 0))

    env = Harness(app)
    run_id = env.start(s)
    # the start, then each step's delivery does both the step and the next activation
    assert env.step_once() == 1 and env.step_once() == 1 and env.step_once() == 1
    assert env.get(run_id).status == "completed"
    assert env.store.queue_depths() == {}


@pytest.mark.parametrize("point", ["local.before_commit", "local.after_commit"])
def test_a_crash_around_the_checkpoint_neither_loses_nor_repeats_a_guarded_effect(
    point: str,
) -> None:
    """The process dies after the body of a non-idempotent step ran: before its checkpoint
    committed, the next delivery is in doubt and reconciled, not run again; after, the inbox
    answers it."""
    effects: list[str] = []
    app = App("crash")

    @app.step(local=True, idempotent=False, retry=FAST)
    def charge(ctx: StepContext, order: str) -> str:
        effects.append(ctx.idempotency_key)
        return "charged"

    @charge.reconcile
    def find(ctx: StepContext, order: str) -> str | None:
        return "found" if ctx.idempotency_key in effects else None

    @app.saga(name="s")
    async def s(ctx: SagaContext) -> str:
        return await ctx.call(charge, "o-1")

    env = Harness(app)
    run_id = env.start(s)
    crashpoints.arm(f"{point}:raise")
    try:
        with pytest.raises(CrashPointRaised):
            env.run_until_idle()
    finally:
        crashpoints.disarm()
    env.restart()  # the process died: what it held in memory is gone
    env.run_until_idle()  # the step's row comes back once its claim runs out
    assert len(effects) == 1
    assert env.result(run_id) == ("found" if point == "local.before_commit" else "charged")
    completed = [e for e in env.history(run_id) if e.kind == h.STEP_COMPLETED]
    assert [e.data["reconciled"] for e in completed] == [point == "local.before_commit"]


def test_an_in_process_step_in_doubt_without_reconcile_halts_the_run() -> None:
    ran: list[int] = []
    app = App("halt")

    @app.step(local=True, idempotent=False, retry=FAST)
    def charge(ctx: StepContext) -> str:
        ran.append(ctx.attempt)
        return "charged"

    @app.saga(name="s")
    async def s(ctx: SagaContext) -> str:
        return await ctx.call(charge)

    env = Harness(app)
    run_id = env.start(s)
    crashpoints.arm("local.before_commit:raise")
    try:
        with pytest.raises(CrashPointRaised):
            env.run_until_idle()
    finally:
        crashpoints.disarm()
    env.restart()
    env.run_until_idle()
    assert ran == [1]
    assert env.get(run_id).status == "needs_attention"


def test_failed_in_process_steps_retry_and_compensate_as_remote_ones() -> None:
    calls: list[str] = []
    app = App("comp")

    @app.step(local=True)
    def book(ctx: StepContext, what: str) -> str:
        calls.append(f"book {what}")
        return what

    @book.compensation
    def unbook(ctx: StepContext, what: str, result: str) -> None:
        calls.append(f"unbook {what}")

    @app.step(local=True, retry=FAST)
    def pay(ctx: StepContext) -> None:
        calls.append(f"pay {ctx.attempt}")
        raise RuntimeError("card declined")

    @app.saga(name="s")
    async def s(ctx: SagaContext) -> None:
        await ctx.call(book, "hotel")
        await ctx.call(pay)

    env = Harness(app)
    run_id = env.start(s)
    env.run_until_idle()
    assert env.get(run_id).status == "compensated"
    assert calls == ["book hotel", "pay 1", "pay 2", "pay 3", "unbook hotel"]


def test_an_in_process_step_may_have_a_rate_limit() -> None:
    app = App("limited")

    @app.step(local=True, rate_limit="2/s")
    def tick(ctx: StepContext, i: int) -> int:
        return i

    @app.saga(name="s")
    async def s(ctx: SagaContext) -> list[int]:
        return [await ctx.call(tick, i) for i in range(3)]

    env = Harness(app)
    run_id = env.start(s)
    env.run_until_idle()
    assert env.result(run_id) == [0, 1, 2]


def test_no_relay_sweep_takes_the_rows_of_an_in_process_lane() -> None:
    """The lane lives in the database: a relay (any process's, any app's) never publishes it
    to a broker; only the app's engines claim it by name."""
    from datetime import UTC, datetime

    from sagaloop.engine.messages import Envelope
    from sagaloop.engine.ports import Outgoing

    store = SqlStore("sqlite://")
    store.upgrade()
    now = datetime.now(UTC)
    env = Envelope(type="step", message_id="step:x", run_id="r", payload={}, created_at=now)
    with store.transaction() as tx:
        store.enqueue(tx, [Outgoing(local_queue("a"), env), Outgoing("a.steps.q", env)], now)
    swept = store.claim(None, 10, now, timedelta(seconds=5))
    assert [r.queue for r in swept] == ["a.steps.q"]
    store.delete_claimed(None, [r.id for r in swept], swept[0].claim_token)
    # a long in-process step keeps its row: not a message the relay is late with (health)
    assert store.oldest_outbox_message() is None
    assert [r.queue for r in store.claim([local_queue("a")], 10, now, timedelta(seconds=5))] == [
        local_queue("a")
    ]


def test_an_engine_that_trusts_its_cache_still_sees_what_another_engine_did(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An activation does not read a run this engine activated last (its cached row says
    where the run stands); if another engine changed the run since, the update fails on the
    ``last_seq`` it started from and the message is prepared again from a fresh read."""
    from sagaloop.engine.activation import Engine
    from sagaloop.runtime.consumers import EngineConsumer

    app = App("twoengines")

    @app.saga(name="s")
    async def s(ctx: SagaContext) -> list[str]:
        return [await ctx.wait_for_event("a"), await ctx.wait_for_event("b")]

    env = Harness(app, cache=True)
    other = EngineConsumer(Engine(app, env.store, clock=env.clock), env.store)
    run_id = env.start(s)
    env.run_until_idle()  # this harness's engine caches the waiting run
    env.send_event(run_id, "a", "first")
    (delivery,) = env.broker.receive(env._consumed(), 1, 0)
    other.process(delivery)  # another engine takes the event
    env.send_event(run_id, "b", "second")
    with caplog.at_level("DEBUG", logger="sagaloop.runtime.consumers"):
        env.run_until_idle()  # the cached run is stale: found by the update, then read again
    assert env.result(run_id) == ["first", "second"]
    assert f"run {run_id!r} changed meanwhile; preparing again" in caplog.text
    assert not env.engine.trusts_cache, "runs are shared with another engine: read them"


def test_replies_ready_together_are_checkpointed_in_one_transaction() -> None:
    """Group commit: the thread that takes the engine's lock checkpoints every reply that is
    ready, in one transaction; then the run goes on as if each had been alone."""
    import asyncio

    from sqlalchemy import event

    app = App("group")

    @app.step(local=True)
    def square(ctx: StepContext, x: int) -> int:
        return x * x

    @app.saga(name="s")
    async def s(ctx: SagaContext) -> list[int]:
        return list(await asyncio.gather(*(ctx.call(square, x) for x in (1, 2, 3))))

    env = Harness(app, cache=True)
    run_id = env.start(s)
    assert env.step_once() == 1  # the start: three in-process steps dispatched
    worker = env._local_consumer
    ready = ready_replies(env)
    assert len(ready) == 3
    commits: list[int] = []
    event.listen(env.store.engine, "commit", lambda conn: commits.append(1))
    worker._ready.extend(ready[:2])  # two threads wait for the lock, the third takes it
    assert worker._checkpoint(ready[2])
    assert [c.done for c in ready] == [True, True, True] and len(commits) == 1
    stages = worker.consumer.engine._stages
    assert stages.open == [stages.own], "every transaction's stage ended"
    env.run_until_idle()
    assert env.result(run_id) == [1, 4, 9]
    assert env.store.queue_depths() == {}


def test_a_stale_cache_never_discards_a_result_as_late() -> None:
    """A result that the engine's cached state would ignore (its step is not there yet: another
    engine dispatched it since) must not be dropped as late: a plan from the cache that writes
    nothing still checks that the run did not move, and is prepared again if it did."""
    from sagaloop.engine.activation import Engine
    from sagaloop.engine.messages import engine_queue
    from sagaloop.runtime.consumers import EngineConsumer

    app = App("stale")

    @app.step(queue="q")
    def inc(ctx: StepContext, x: int) -> int:
        return x + 1

    @app.saga(name="s")
    async def s(ctx: SagaContext) -> int:
        return await ctx.call(inc, await ctx.call(inc, 0))

    env = Harness(app, cache=True)
    other = EngineConsumer(Engine(app, env.store, clock=env.clock), env.store)
    run_id = env.start(s)
    assert env.step_once() == 1  # this engine: the start, the first inc dispatched (cached)
    assert env.step_once() == 1  # a worker: the first inc's result
    (result,) = env.broker.receive([engine_queue("stale")], 1, 0)
    other.process(result)  # another engine: the second inc dispatched
    env.run_until_idle()  # its result reaches this engine, whose cache has no second inc
    assert env.result(run_id) == 2


def test_a_stopping_engine_gives_back_the_in_process_steps_it_did_not_start() -> None:
    """Rows handed over to an engine's lane but not taken when it stops (SIGTERM:
    ``Runtime.stop``) are released at once, not held until their claim runs out: another
    engine's lane takes them on its next look."""
    from datetime import UTC, datetime

    from sagaloop.engine.messages import Envelope
    from sagaloop.engine.ports import Outgoing
    from sagaloop.runtime.lane import Handoffs, LocalLane

    store = SqlStore("sqlite://")
    store.upgrade()
    stopping, other = LocalLane(store, "a"), LocalLane(store, "a")
    store.hand_over_to(Handoffs(stopping, None))
    now = datetime.now(UTC)
    task = Envelope(type="step", message_id="step:x", run_id="r", payload={}, created_at=now)
    with store.transaction() as tx:
        store.enqueue(tx, [Outgoing(local_queue("a"), task)], now)
    store.hand_over_to(None)
    assert other.receive([other.queue], 10, 0) == [], "claimed by the engine it was handed to"
    stopping.release_handed()  # a receive without waiting looks at the database at once
    assert [d.queue for d in other.receive([other.queue], 10, 0)] == [local_queue("a")]


def a_lost_lease_discards_the_attempt(url: str) -> list[str]:
    """Run an in-process step, lose its row's lease to another engine, then checkpoint it:
    LeaseLostError, and nothing of the attempt is written (no reply, no activation, the row
    is the other engine's). Returns the statements of the in-process checkpoint. Shared
    with ``tests/integration/test_checkpoint_deletes_postgres.py`` (the one statement)."""
    import uuid

    from sqlalchemy import event

    from sagaloop.brokers.database import LeaseLostError
    from sagaloop.engine.messages import inbox_key
    from sagaloop.runtime.delivery import decode
    from sagaloop.runtime.local import _Checkpoint
    from sagaloop.runtime.worker import WORKER_CONSUMER

    app = App(f"lost{uuid.uuid4().hex[:8]}")

    @app.step(local=True)
    def inc(ctx: StepContext, x: int) -> int:
        return x + 1

    @app.saga(name="s")
    async def s(ctx: SagaContext) -> int:
        return await ctx.call(inc, 0)

    env = Harness(app, url=url)
    run_id = env.start(s)
    assert env.step_once() == 1  # the start: the step's row on the lane
    worker, lane = env._local_consumer, local_queue(app.name)
    (delivery,) = env._lane.receive([lane], 1, 0)
    message = decode(delivery, env.store)
    assert message is not None
    task, key = StepTask.parse(message), inbox_key(app.name, message)
    reply = worker.runner.run(message, task=task)
    env.clock.advance(env.lease + timedelta(seconds=1))
    (taken,) = env.store.claim([lane], 10, env.clock.now(), env.lease)  # another engine's now
    statements: list[str] = []

    def seen(conn: object, cursor: object, statement: str, *args: object) -> None:
        statements.append(statement)

    event.listen(env.store.engine, "before_cursor_execute", seen)
    try:
        assert worker._checkpoint(_Checkpoint(delivery, message, task, key, reply)) is False
    finally:
        event.remove(env.store.engine, "before_cursor_execute", seen)
    with pytest.raises(LeaseLostError):  # the usual way (the reply queued) refuses too
        worker._store(delivery, message, task, key, reply)
    assert [e.kind for e in env.history(run_id)] == [h.RUN_STARTED, h.STEP_SCHEDULED]
    assert env.store.inbox_get(None, WORKER_CONSUMER, key) == (False, None)
    assert env.store.queue_depths() == {lane: 1}, "no reply queued; the row is still there"
    assert env.store.delete_claimed(None, [taken.id], taken.claim_token) == 1, "held by the other"
    env.store.close()
    return statements


def test_a_lost_lease_discards_an_in_process_attempt(tmp_path: Path) -> None:
    """On SQLite the row's delete is its own statement, made before the commit."""
    a_lost_lease_discards_the_attempt(f"sqlite:///{tmp_path / 'db.sqlite'}")


def ready_replies(env: Harness) -> list[_Checkpoint]:
    """The in-process steps on the lane of ``env``'s app, run; their replies not yet
    checkpointed (what the lane's threads hold before ``LocalWorker._checkpoint``)."""
    worker, ready, name = env._local_consumer, [], env.app.name
    for delivery in env._lane.receive([local_queue(name)], 100, 0):
        message = decode(delivery, env.store)
        assert message is not None
        task = StepTask.parse(message)
        reply = worker.runner.run(message, task=task)
        ready.append(_Checkpoint(delivery, message, task, inbox_key(name, message), reply))
    return ready
