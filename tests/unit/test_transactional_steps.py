"""Transactional steps (``@app.step(transactional=True)``) on SQLite: the step's writes to the
app's own tables, made through ``ctx.transaction``, commit in the transaction that records the
step's outcome, or not at all. The app's table lives in the store's own database."""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Literal

import pytest
import sqlalchemy as sa

from sagaloop import App, ApplicationError, RetryPolicy, SagaContext, StepContext
from sagaloop.engine import history as h
from sagaloop.errors import DeclarationError
from sagaloop.runtime import crashpoints
from sagaloop.runtime.crashpoints import CrashPointRaised
from sagaloop.testing import Harness

Broker = Literal["database", "memory"]
FAST = RetryPolicy(max_attempts=3, initial_interval=timedelta(seconds=1))
meta = sa.MetaData()
orders = sa.Table(
    "app_orders",
    meta,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("item", sa.String, nullable=False),
    sa.Column("attempt", sa.Integer, nullable=False),
)


def rows(env: Harness) -> list[tuple[str, int]]:
    with env.store.engine.connect() as conn:
        found = conn.execute(sa.select(orders.c.item, orders.c.attempt).order_by(orders.c.id))
        return [(str(item), int(attempt)) for item, attempt in found]


def make(fail_first: int = 0, *, retryable: bool = True) -> tuple[App, Any, list[list[str]]]:
    """An app whose transactional step inserts an order; its first ``fail_first`` attempts
    raise after inserting. ``seen``: the items each attempt found in the table first."""
    app = App(f"tx-{fail_first}-{retryable}")
    seen: list[list[str]] = []

    @app.step(transactional=True, retry=FAST)
    def place(ctx: StepContext, item: str) -> int:
        assert ctx.transaction is not None
        seen.append([str(r[0]) for r in ctx.transaction.execute(sa.select(orders.c.item))])
        inserted = ctx.transaction.execute(orders.insert(), {"item": item, "attempt": ctx.attempt})
        if ctx.attempt <= fail_first:
            raise ApplicationError("the card was declined", non_retryable=not retryable)
        return int(inserted.inserted_primary_key[0])

    @app.saga(name="buy")
    async def buy(ctx: SagaContext, item: str) -> int:
        return await ctx.call(place, item)

    return app, buy, seen


def harness(app: App, broker: Broker = "database") -> Harness:
    """A harness whose store's database (SQLite in memory) holds the app's table; its broker
    is the database's outbox, or one in memory (as RabbitMQ: settled apart from the commit)."""
    env = Harness(app, broker=broker)
    meta.create_all(env.store.engine)
    return env


def test_the_writes_commit_with_the_steps_completion() -> None:
    app, buy, seen = make()
    env = harness(app)
    run_id = env.start(buy, "widget")
    env.run_until_idle()
    assert env.result(run_id) == 1
    assert rows(env) == [("widget", 1)]
    assert seen == [[]]


@pytest.mark.parametrize("broker", ["database", "memory"])
def test_a_crash_before_the_commit_leaves_no_write_and_the_step_runs_again(broker: Broker) -> None:
    app, buy, seen = make()
    env = harness(app, broker)
    run_id = env.start(buy, "widget")
    crashpoints.arm("worker.before_commit:raise")
    try:
        with pytest.raises(CrashPointRaised):
            env.run_until_idle()
    finally:
        crashpoints.disarm()
    assert rows(env) == []  # the step ran, its write went with the uncommitted outcome
    assert env.get(run_id).status == "running"
    env.run_until_idle()  # the lease expires, the message comes back
    assert env.result(run_id) == 1
    assert rows(env) == [("widget", 1)]
    assert seen == [[], []]  # the second run saw nothing of the first
    # the redelivered attempt was not in doubt: its predecessor's writes were rolled back
    completed = [e for e in env.history(run_id) if e.kind == h.STEP_COMPLETED]
    assert len(completed) == 1


@pytest.mark.parametrize("broker", ["database", "memory"])
def test_a_crash_after_the_commit_never_runs_the_step_again(broker: Broker) -> None:
    app, buy, seen = make()
    env = harness(app, broker)
    run_id = env.start(buy, "widget")
    crashpoints.arm("worker.after_commit:raise")
    try:
        with pytest.raises(CrashPointRaised):
            env.run_until_idle()
    finally:
        crashpoints.disarm()
    assert rows(env) == [("widget", 1)]
    env.run_until_idle()
    assert env.result(run_id) == 1
    assert rows(env) == [("widget", 1)]
    assert len(seen) == 1


def test_a_raising_attempt_rolls_its_writes_back_and_the_retry_sees_none() -> None:
    app, buy, seen = make(fail_first=2)
    env = harness(app)
    run_id = env.start(buy, "widget")
    env.run_until_idle()
    assert env.get(run_id).status == "completed"
    assert rows(env) == [("widget", 3)]  # the writes of attempts 1 and 2 were rolled back
    assert seen == [[], [], []]
    retried = [e.data for e in env.history(run_id) if e.kind == h.STEP_RETRYING]
    assert [e["error"]["message"] for e in retried] == ["the card was declined"] * 2
    # the failure is recorded with its writes rolled back, so the retry is not in doubt
    assert [(e["error"]["not_applied"], e["in_doubt"]) for e in retried] == [(True, False)] * 2


def test_a_non_retryable_failure_is_recorded_without_its_writes() -> None:
    app, buy, _ = make(fail_first=1, retryable=False)
    env = harness(app)
    run_id = env.start(buy, "widget")
    env.run_until_idle()
    assert env.get(run_id).status == "failed"
    assert rows(env) == []


def test_an_unstorable_result_rolls_the_writes_back() -> None:
    app = App("tx-unstorable")

    @app.step(transactional=True, retry=RetryPolicy(max_attempts=1))
    def place(ctx: StepContext) -> float:
        assert ctx.transaction is not None
        ctx.transaction.execute(orders.insert(), {"item": "nan", "attempt": ctx.attempt})
        return float("nan")

    @app.saga(name="buy")
    async def buy(ctx: SagaContext) -> float:
        return await ctx.call(place)

    env = harness(app)
    run_id = env.start(buy)
    env.run_until_idle()
    assert env.get(run_id).status == "failed"
    assert rows(env) == []


def test_the_compensation_of_a_transactional_step_runs_in_its_own_transaction() -> None:
    app = App("tx-undo")

    @app.step(transactional=True)
    def place(ctx: StepContext, item: str) -> int:
        assert ctx.transaction is not None
        result = ctx.transaction.execute(orders.insert(), {"item": item, "attempt": ctx.attempt})
        return int(result.inserted_primary_key[0])

    @place.compensation
    def unplace(ctx: StepContext, item: str, order_id: int) -> None:
        assert ctx.transaction is not None
        ctx.transaction.execute(orders.delete().where(orders.c.id == order_id))

    @app.step()
    def ship(ctx: StepContext) -> None:
        raise ApplicationError("no courier", non_retryable=True)

    @app.saga(name="buy")
    async def buy(ctx: SagaContext, item: str) -> None:
        await ctx.call(place, item)
        await ctx.call(ship)

    env = harness(app)
    run_id = env.start(buy, "widget")
    env.run_until_idle()
    assert env.get(run_id).status == "compensated"
    assert rows(env) == []


def test_a_plain_step_has_no_transaction() -> None:
    app = App("tx-plain")
    got: list[Any] = []

    @app.step()
    def plain(ctx: StepContext) -> None:
        got.append(ctx.transaction)

    @app.saga(name="s")
    async def s(ctx: SagaContext) -> None:
        await ctx.call(plain)

    env = Harness(app)
    env.start(s)
    env.run_until_idle()
    assert got == [None]


def test_what_makes_no_sense_with_transactional_is_refused() -> None:
    app = App("tx-refused")

    def body(ctx: StepContext) -> None: ...

    async def async_body(ctx: StepContext) -> None: ...

    refused = {
        "must be a plain `def`": dict(fn=async_body),
        "local=True makes no sense": dict(local=True),
        "idempotent=False makes no sense": dict(idempotent=False),
        "heartbeat_timeout makes no sense": dict(heartbeat_timeout=timedelta(seconds=5)),
    }
    for i, (why, options) in enumerate(refused.items()):
        fn = options.pop("fn", body)
        with pytest.raises(DeclarationError, match=why.replace("(", r"\(")):
            app.step(name=f"s{i}", transactional=True, **options)(fn)  # type: ignore[call-overload]

    step = app.step(name="ok", transactional=True, timeout=timedelta(seconds=5))(body)
    with pytest.raises(DeclarationError, match="needs no reconcile"):
        step.reconcile(lambda ctx: None)

    async def async_undo(ctx: StepContext, result: None) -> None: ...

    with pytest.raises(DeclarationError, match="compensation must be a plain `def`"):
        step.compensation(async_undo)


def test_a_transactional_step_reads_its_runs_history_in_its_transaction() -> None:
    """On SQLite in memory (the harness's one connection is the step's), a read outside the
    step's transaction could not begin: ``ctx.history()`` reads in it."""
    app = App("tx-history")

    @app.step()
    def first(ctx: StepContext) -> str:
        return "one"

    @app.step(transactional=True)
    def second(ctx: StepContext) -> list[str]:
        return [e.kind for e in ctx.history() if e.kind == h.STEP_COMPLETED]

    @app.saga(name="s")
    async def s(ctx: SagaContext) -> list[str]:
        await ctx.call(first)
        return await ctx.call(second)

    env = harness(app)
    run_id = env.start(s)
    env.run_until_idle()
    assert env.result(run_id) == [h.STEP_COMPLETED]
