"""Hostile outcomes: whatever a step's code produces (a result or an error that cannot be stored
or sent, a ``BaseException``) and whatever fails around it, the body runs as often as the retry
policy allows and no more, the run ends (failed, compensated or parked), and the worker goes on
serving other runs. Executions are counted outside the engine.
"""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from collections import Counter
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from sagaloop import App, Client, RetryPolicy, SagaContext, StepContext
from sagaloop.brokers.database import DatabaseBroker
from sagaloop.engine import history as h
from sagaloop.engine.messages import Envelope, StepReply, engine_queue, step_queue
from sagaloop.engine.ports import Delivery
from sagaloop.errors import MAX_ERROR_MESSAGE, ErrorInfo, UnencodableError
from sagaloop.outbox import StepTask, handle_step
from sagaloop.runtime.consumers import WorkerConsumer
from sagaloop.runtime.service import Runtime
from sagaloop.runtime.steps import StepRunner
from sagaloop.sagas.convert import MAX_VALUE_BYTES, Converter, encode_value
from sagaloop.store.sql import SqlStore
from sagaloop.testing import Crash, Harness, eventually

TWICE = RetryPolicy(max_attempts=2, initial_interval=timedelta(seconds=1))
ran: Counter[str] = Counter()
"""Executions of each step body (and compensation), counted outside the engine."""

app = App("outcomes")


class Unreadable(Exception):
    def __str__(self) -> str:
        raise RuntimeError("no message for you")


def nested(depth: int) -> Any:
    value: Any = 0
    for _ in range(depth):
        value = [value]
    return value


RESULTS: dict[str, Any] = {
    "lone_surrogate": "the reply was cut mid-emoji \ud83d",
    "huge_int": 10**5000,
    "nan": float("nan"),
    "infinity": float("inf"),
    "surrogate_key": {"ok\udc80": 1},
    "too_deep": nested(150),
}
RAISES: dict[str, BaseException] = {
    "surrogate_message": ValueError("bad reply \ud83d"),
    "unreadable_message": Unreadable(),
    "huge_message": ValueError("x" * 1_000_000),
    "keyboard_interrupt": KeyboardInterrupt(),
    "system_exit": SystemExit(3),
    "cancelled": asyncio.CancelledError(),
    "generator_exit": GeneratorExit(),
}


@app.step(retry=TWICE)
def book(ctx: StepContext, what: str) -> str:
    ran["book"] += 1
    return f"booked {what}"


@book.compensation
def unbook(ctx: StepContext, what: str, result: str | None) -> None:
    ran["unbook"] += 1


@app.step(retry=TWICE)
def produce(ctx: StepContext, what: str) -> Any:
    ran[what] += 1
    if what in RAISES:
        raise RAISES[what]
    return RESULTS[what]


@app.step(retry=TWICE)
async def produce_async(ctx: StepContext, what: str) -> Any:
    ran[f"async {what}"] += 1
    if what == "cancelled":
        await asyncio.sleep(0)
        asyncio.current_task().cancel()  # type: ignore[union-attr]
        await asyncio.sleep(1)
    raise RAISES[what]


@app.step(retry=TWICE)
def fine(ctx: StepContext, n: int) -> int:
    ran["fine"] += 1
    return n + 1


@app.saga(name="produce")
async def produce_saga(ctx: SagaContext, what: str) -> Any:
    await ctx.call(book, what)
    return await ctx.call(produce, what)


@app.saga(name="produce_async")
async def produce_async_saga(ctx: SagaContext, what: str) -> Any:
    return await ctx.call(produce_async, what)


@app.saga(name="fine")
async def fine_saga(ctx: SagaContext, n: int) -> int:
    return await ctx.call(fine, n)


@pytest.fixture(autouse=True)
def fresh_counts() -> None:
    ran.clear()


@pytest.fixture
def env() -> Iterator[Harness]:
    harness = Harness(app)
    yield harness
    harness.close()


def settle(env: Harness) -> None:
    """Process until idle; the unfixed worker re-runs forever, which ends here as an error."""
    env.run_until_idle(max_steps=400)


def failures(env: Harness, run_id: str) -> list[dict[str, Any]]:
    kinds = (h.STEP_RETRYING, h.STEP_FAILED)
    return [e.data["error"] for e in env.history(run_id) if e.kind in kinds]


# --- defect 1: an outcome that cannot be stored or sent --------------------------------------


@pytest.mark.parametrize("what", sorted(RESULTS))
def test_an_unencodable_result_fails_the_attempt_and_is_retried_per_policy(
    env: Harness, what: str
) -> None:
    run_id = env.start(produce_saga, what)
    settle(env)
    assert ran[what] == 2, "the body runs as often as max_attempts allows, no more"
    run = env.get(run_id)
    assert run.status == "compensated"
    assert ran["unbook"] == 1
    errors = failures(env, run_id)
    assert [e["type"] for e in errors] == ["UnencodableResult"] * 2
    assert "result of step 'produce' cannot be stored" in errors[0]["message"]
    assert "step 'produce' failed" in str(run.error)
    settle(env)
    assert ran[what] == 2, "and not once more later"


@pytest.mark.parametrize("what", ["surrogate_message", "unreadable_message", "huge_message"])
def test_an_error_that_cannot_be_stored_as_it_is_is_recorded_readably(
    env: Harness, what: str
) -> None:
    run_id = env.start(produce_saga, what)
    settle(env)
    assert ran[what] == 2
    assert env.get(run_id).status == "compensated"
    errors = failures(env, run_id)
    assert len(errors) == 2
    message = errors[0]["message"]
    encode_value(errors[0], what="the error")  # storable and sendable
    if what == "surrogate_message":
        assert errors[0]["type"] == "ValueError" and message == "bad reply \\ud83d"
    elif what == "unreadable_message":
        assert errors[0]["type"] == "Unreadable" and "could not be read" in message
    else:
        assert len(message) < MAX_ERROR_MESSAGE + 100 and "cut" in message
    assert "Traceback" in errors[0]["traceback"] and "in produce" in errors[0]["traceback"]


def test_an_unencodable_result_of_a_non_idempotent_step_parks_its_run(env: Harness) -> None:
    """The body ran and took effect: without a reconcile, the next attempt is not made."""
    once = App("once")
    count: list[int] = []

    @once.step(retry=TWICE, idempotent=False)
    def send(ctx: StepContext) -> str:
        count.append(1)
        return "sent \ud800"

    @once.saga(name="send")
    async def send_saga(ctx: SagaContext) -> str:
        return await ctx.call(send)

    harness = Harness(once)
    run_id = harness.start(send_saga)
    harness.run_until_idle(max_steps=400)
    assert len(count) == 1
    assert harness.get(run_id).status == "needs_attention"
    harness.close()


def test_encode_value_refuses_what_cannot_be_stored_or_sent() -> None:
    for value in RESULTS.values():
        with pytest.raises(UnencodableError, match=r"^result of step 's' cannot be stored"):
            encode_value(value, what="result of step 's'")
    with pytest.raises(UnencodableError, match=f"over the limit of {MAX_VALUE_BYTES} bytes"):
        encode_value("x" * (MAX_VALUE_BYTES + 1), what="transcript")
    assert encode_value(nested(99), what="deep") == b"[" * 99 + b"0" + b"]" * 99
    assert encode_value({"t": "é[{"}, what="v") == '{"t":"é[{"}'.encode()
    with pytest.raises(UnencodableError, match="input of saga 'x' cannot be stored"):
        Converter(float).to_json(float("nan"), what="input of saga 'x'")


def test_error_info_never_raises_and_keeps_a_traceback() -> None:
    try:
        raise Unreadable()
    except Unreadable as e:
        info = ErrorInfo.from_exception(e, with_traceback=True)
    assert info.type == "Unreadable" and "could not be read" in info.message
    assert info.traceback is not None and "raise Unreadable()" in info.traceback
    back = ErrorInfo.from_json(info.to_json())
    assert (back.type, back.message, back.traceback) == (info.type, info.message, info.traceback)
    assert ErrorInfo.from_exception(ValueError("a\udc80b")).message == "a\\udc80b"


# --- defect 2: BaseException from step code ---------------------------------------------------


@pytest.mark.parametrize(
    "what", ["keyboard_interrupt", "system_exit", "cancelled", "generator_exit"]
)
def test_a_base_exception_from_a_step_is_a_failed_attempt(env: Harness, what: str) -> None:
    run_id = env.start(produce_saga, what)
    other = env.start(fine_saga, 1)
    settle(env)
    assert ran[what] == 2
    assert env.get(run_id).status == "compensated" and ran["unbook"] == 1
    assert [e["type"] for e in failures(env, run_id)] == [type(RAISES[what]).__name__] * 2
    assert env.result(other) == 2, "the worker goes on serving other runs"


@pytest.mark.parametrize("what", ["keyboard_interrupt", "system_exit", "cancelled"])
def test_a_base_exception_from_an_async_step_is_a_failed_attempt(env: Harness, what: str) -> None:
    run_id = env.start(produce_async_saga, what)
    settle(env)
    assert ran[f"async {what}"] == 2
    assert env.get(run_id).status == "failed"
    assert [e["type"] for e in failures(env, run_id)] == [type(RAISES[what]).__name__] * 2


@pytest.mark.parametrize("what", ["keyboard_interrupt", "system_exit", "cancelled"])
def test_a_base_exception_from_a_compensation_is_a_failed_compensation(what: str) -> None:
    comp = App("comp")

    @comp.step(retry=TWICE)
    def reserve(ctx: StepContext) -> str:
        return "r-1"

    @reserve.compensation
    def release(ctx: StepContext, result: str | None) -> None:
        ran["release"] += 1
        raise RAISES[what]

    @comp.step(retry=RetryPolicy(max_attempts=1))
    def boom(ctx: StepContext) -> None:
        raise ValueError("no")

    @comp.saga(name="s")
    async def s(ctx: SagaContext) -> None:
        await ctx.call(reserve)
        await ctx.call(boom)

    harness = Harness(comp)
    run_id = harness.start(s)
    harness.run_until_idle(max_steps=400)
    assert ran["release"] == 2, "the compensation is retried per policy, then the run parks"
    assert harness.get(run_id).status == "needs_attention"
    harness.close()


def test_a_base_exception_on_the_step_pool_is_a_failed_attempt() -> None:
    """A step with a timeout runs on the runner's pool; what it raises comes back as a reply."""
    pool_app = App("pool")

    @pool_app.step(timeout=timedelta(seconds=5))
    def interrupt(ctx: StepContext, what: str) -> int:
        raise RAISES[what]

    runner = StepRunner(pool_app, threads=1)
    try:
        for what in ("keyboard_interrupt", "system_exit", "cancelled"):
            task = Envelope(
                type="step",
                run_id="r",
                position=1,
                attempt=1,
                payload={"step": "interrupt", "args": {"what": what}},
            )
            replies: list[StepReply] = []
            thread = threading.Thread(target=lambda t=task, r=replies: r.append(runner.run(t)))
            thread.start()
            thread.join(10)
            assert replies and replies[0].outcome == "failed"
            assert replies[0].error["type"] == type(RAISES[what]).__name__
    finally:
        runner.close()


def test_consumer_threads_survive_base_exceptions(tmp_path: Path) -> None:
    """Real threads on the embedded default: steps that raise BaseExceptions fail their runs
    per policy, and the same consumers then complete a good run."""
    store = SqlStore(f"sqlite:///{tmp_path / 'threads.db'}")
    store.upgrade()
    broker = DatabaseBroker(store, lease=timedelta(seconds=5), poll_interval=0.02)
    fast = App("threads")

    @fast.step(queue="q", retry=RetryPolicy(max_attempts=2, initial_interval=timedelta(0)))
    def hostile(ctx: StepContext, what: str) -> int:
        ran[what] += 1
        raise RAISES[what]

    @fast.step(queue="q")
    def good(ctx: StepContext, n: int) -> int:
        return n * 2

    @fast.saga(name="hostile")
    async def hostile_saga(ctx: SagaContext, what: str) -> int:
        return await ctx.call(hostile, what)

    @fast.saga(name="good")
    async def good_saga(ctx: SagaContext, n: int) -> int:
        return await ctx.call(good, n)

    runtime = Runtime(fast, store, broker, poll=0.02, concurrency=1).start()
    try:
        client = Client(store, fast)
        kinds = ["keyboard_interrupt", "system_exit", "cancelled"]
        runs = [client.start(hostile_saga, what) for what in kinds]
        for run_id in runs:
            eventually(lambda r=run_id: client.get(r).status == "failed", timeout=30)
        assert [ran[w] for w in kinds] == [2, 2, 2]
        assert client.result(client.start(good_saga, 21), timeout=30) == 42
        assert all(t.is_alive() for t in runtime.threads)
    finally:
        runtime.stop()
        store.close()


# --- the worker: storing the reply ------------------------------------------------------------


def refuse_inbox_rows(path: Path, when: str) -> None:
    """A database that refuses some inbox rows (a constraint of the database's own), as a
    non-transient error: what a reply the database will not take looks like."""
    with sqlite3.connect(path) as db:
        db.execute(
            "create trigger refuse before insert on sagaloop_inbox when new.consumer = 'worker' "
            f"and {when} begin select raise(abort, 'refused by the database'); end"
        )


def test_a_reply_the_database_refuses_is_recorded_as_a_failure(tmp_path: Path) -> None:
    path = tmp_path / "refuse.db"
    env = Harness(app, url=f"sqlite:///{path}")
    refuse_inbox_rows(path, "new.result like '%booked%'")
    run_id = env.start(produce_saga, "huge_int")
    settle(env)
    assert ran["book"] == 2, "each attempt ran once, its refused reply became its failure"
    assert ran["huge_int"] == 0
    assert env.get(run_id).status == "compensated", "failed in doubt: it may have taken effect"
    assert ran["unbook"] == 1
    assert [e["type"] for e in failures(env, run_id)] == ["UnstorableResult"] * 2
    assert "refused by the database" in failures(env, run_id)[0]["message"]
    env.close()


def test_a_reply_not_stored_for_an_outage_is_kept_and_the_body_not_run_again(
    tmp_path: Path,
) -> None:
    """The database is locked by someone else when the reply is to be stored: the message is
    retried, and the retry stores the reply computed before instead of running the body."""
    path = tmp_path / "busy.db"
    env = Harness(app, url=f"sqlite:///{path}", broker="memory")
    env.queues = [engine_queue(app.name)]
    run_id = env.start(fine_saga, 1)
    env.run_until_idle(skip_time=False)
    env.relay.relay_once()
    worker_store = SqlStore(f"sqlite:///{path}", busy_timeout=0.1)
    worker = WorkerConsumer(app, worker_store, StepRunner(app, inline=True), env.clock)
    queue = step_queue(app.name, "default")
    locker = sqlite3.connect(path, isolation_level=None)
    (delivery,) = env.broker.receive([queue], 1, 0)
    locker.execute("begin immediate")  # held while the step runs and its reply is stored
    worker.process(delivery)
    assert ran["fine"] == 1
    locker.execute("rollback")
    env.clock.advance(timedelta(seconds=2))
    (again,) = env.broker.receive([queue], 1, 0)
    worker.process(again)
    assert ran["fine"] == 1, "the reply kept in memory was stored: the body did not run again"
    env.queues = None
    env.run_until_idle()
    assert env.result(run_id) == 2
    locker.close()
    worker_store.close()
    env.close()


# --- defect 8: no step message spins ----------------------------------------------------------


def test_a_message_that_keeps_failing_is_answered_halted_and_parks_its_run(
    tmp_path: Path,
) -> None:
    """Every reply for the step is refused, the failed one too: after MAX_FAILURES failures
    the worker answers ``halted`` (which the database takes), the run parks, the message is
    acked, and the body ran once."""
    path = tmp_path / "spin.db"
    env = Harness(app, url=f"sqlite:///{path}")
    refuse_inbox_rows(path, "new.result not like '%halted%'")
    run_id = env.start(fine_saga, 1)
    settle(env)
    assert ran["fine"] == 1
    run = env.get(run_id)
    assert run.status == "needs_attention"
    (halted,) = [e for e in env.history(run_id) if e.kind == h.STEP_HALTED]
    error = halted.data["error"]
    assert error["type"] == "RepeatedFailure" and "failed 5 times" in error["message"]
    assert "refused by the database" in error["message"] and "Traceback" in error["traceback"]
    assert "sagaloop retry" in error["message"]
    env.close()


def test_a_crash_loop_across_restarts_ends_halted(env: Harness) -> None:
    """The worker dies whenever it takes the step message (out of memory, say): redelivered
    after each lease, the message is answered ``halted`` instead of killing the next worker."""

    def die_on_steps(role: str, delivery: Delivery) -> None:
        if role == "worker":
            env.restart()  # the process is gone with everything it held in memory
            if delivery.deliveries <= 10:
                raise Crash()

    env.crash_hook = die_on_steps
    run_id = env.start(fine_saga, 1)
    settle(env)
    assert ran["fine"] == 0
    assert env.get(run_id).status == "needs_attention"
    (halted,) = [e for e in env.history(run_id) if e.kind == h.STEP_HALTED]
    assert "delivered 11 times without being answered" in halted.data["error"]["message"]


# --- a user's own service -----------------------------------------------------------------------


billing = App("billing")


@billing.step(queue="cards", retry=TWICE)
def bill_step(ctx: StepContext, cents: int) -> Any:
    raise AssertionError("executed by the user's service")


@billing.saga(name="bill")
async def bill(ctx: SagaContext, cents: int) -> Any:
    return await ctx.call(bill_step, cents)


def test_handle_step_records_an_unencodable_result_as_a_failure_and_rolls_back(
    tmp_path: Path,
) -> None:
    env = Harness(billing, url=f"sqlite:///{tmp_path / 'svc.db'}")
    store = env.store
    with store.engine.begin() as conn:
        conn.exec_driver_sql("create table charges (key text primary key)")
    env.queues = [engine_queue(billing.name)]
    run_id = env.start(bill, 250)
    calls: list[StepTask] = []

    def handler(conn: sa.Connection, task: StepTask) -> Any:
        calls.append(task)
        conn.execute(sa.text("insert into charges values (:k)"), {"k": task.idempotency_key})
        return "charged \ud83d"

    for _ in range(10):
        env.run_until_idle(skip_time=False)
        claimed = store.claim([step_queue(billing.name, "cards")], 1, env.clock.now(), env.lease)
        if not claimed:
            if env.get(run_id).status != "running":
                break
            env.advance(timedelta(seconds=2))  # the retry timer
            continue
        with store.engine.begin() as conn:
            body = claimed[0].body
            reply = handle_step(store, conn, body, handler, app=billing.name, clock=env.clock)
        store.delete_claimed(None, [claimed[0].id], claimed[0].claim_token)
        assert reply["outcome"] == "failed"
        assert reply["error"]["type"] == "UnencodableResult"
        assert reply["error"]["not_applied"] is True
    assert len(calls) == 2, "one handler call per attempt"
    assert env.get(run_id).status == "failed"
    with store.engine.connect() as conn:
        assert conn.exec_driver_sql("select count(*) from charges").scalar() == 0
    env.close()
