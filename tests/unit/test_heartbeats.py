"""Running steps that can be told to stop: `ctx.heartbeat()` renews the attempt and raises
StepCancelled once the run is cancelled (Temporal's hello_cancellation: the activity
heartbeats, is cancelled, runs its cleanup); `heartbeat_timeout` fails a silent attempt in
doubt early; `schedule_to_close` bounds all attempts together. Real threads, a SQLite file."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from sqlalchemy import event

from sagaloop import App, Client, RetryPolicy, SagaContext, StepCancelled, StepContext
from sagaloop.brokers.database import DatabaseBroker
from sagaloop.engine import history as h
from sagaloop.engine.messages import Envelope
from sagaloop.engine.ports import Outgoing
from sagaloop.runtime.service import Runtime
from sagaloop.runtime.worker import _Heartbeat
from sagaloop.store.sql import SqlStore
from sagaloop.testing import eventually

app = App("beats")
seen: list[str] = []
running = threading.Event()
FAST = RetryPolicy(max_attempts=3, initial_interval=timedelta(milliseconds=50))


@app.step(queue="q", heartbeat_timeout=timedelta(seconds=5))
def never_complete(ctx: StepContext) -> str:
    seen.append("started")
    try:
        while True:
            running.set()
            ctx.heartbeat("still going")
            time.sleep(0.05)
    except StepCancelled:
        seen.append("cancelled")
        raise
    finally:
        seen.append("cleanup")


@never_complete.compensation
def undo_never(ctx: StepContext, result: str) -> None:
    seen.append("compensated")


@app.step(queue="q", heartbeat_timeout=timedelta(milliseconds=300), retry=FAST)
def silent(ctx: StepContext) -> int:
    seen.append(f"silent {ctx.attempt} in doubt={ctx.in_doubt}")
    if ctx.attempt == 1:
        time.sleep(1.5)  # never heartbeats: failed in doubt after 0.3 s, not after 1.5 s
    return ctx.attempt


@app.step(
    queue="q",
    schedule_to_close=timedelta(milliseconds=800),
    retry=RetryPolicy(
        max_attempts=None,
        initial_interval=timedelta(milliseconds=100),
        maximum_interval=timedelta(milliseconds=100),
    ),
)
def doomed(ctx: StepContext) -> None:
    seen.append("doomed")
    raise ConnectionError("down")


@app.saga(name="cancel-me")
async def cancel_me(ctx: SagaContext) -> str:
    return await ctx.call(never_complete)


@app.saga(name="silent")
async def silent_saga(ctx: SagaContext) -> int:
    return await ctx.call(silent)


@app.saga(name="doomed")
async def doomed_saga(ctx: SagaContext) -> None:
    await ctx.call(doomed)


@pytest.fixture
def client(tmp_path: Path) -> Iterator[Client]:
    seen.clear()
    running.clear()
    store = SqlStore(f"sqlite:///{tmp_path / 'beats.db'}")
    store.upgrade()
    broker = DatabaseBroker(store, lease=timedelta(seconds=2), poll_interval=0.02)
    runtime = Runtime(app, store, broker, poll=0.02, heartbeat=0.5, concurrency=2).start()
    try:
        yield Client(store, app)
    finally:
        runtime.stop()
        store.close()


def test_a_cancelled_run_stops_its_running_step_through_heartbeats(client: Client) -> None:
    run_id = client.start(cancel_me)
    assert running.wait(10)
    client.cancel(run_id, "the user gave up")
    eventually(lambda: client.get(run_id).status == "cancelled", timeout=20, what="cancelled")
    assert seen[:3] == ["started", "cancelled", "cleanup"], seen
    assert seen[3:] == ["compensated"], seen  # in doubt: it may have done something
    failed = [e for e in client.history(run_id) if e.kind == h.STEP_FAILED]
    assert failed and failed[0].data["error"]["type"] == "StepCancelled"


def test_a_silent_attempt_fails_in_doubt_after_its_heartbeat_timeout(client: Client) -> None:
    started = time.monotonic()
    run_id = client.start(silent_saga)
    assert client.result(run_id, timeout=20) == 2
    assert time.monotonic() - started < 1.4, "it waited for the silent attempt"
    assert seen[:2] == ["silent 1 in doubt=False", "silent 2 in doubt=True"]
    [retrying] = [e for e in client.history(run_id) if e.kind == h.STEP_RETRYING]
    assert "heartbeat" in retrying.data["error"]["message"]


def test_schedule_to_close_bounds_all_attempts_together(client: Client) -> None:
    started = time.monotonic()
    run_id = client.start(doomed_saga)
    eventually(lambda: client.get(run_id).status == "failed", timeout=20, what="the step to fail")
    assert time.monotonic() - started < 5
    assert 2 <= len(seen) <= 10, seen  # unlimited attempts, yet bounded by 0.8 s


def test_an_attempts_first_heartbeat_looks_at_the_run_and_renews_nothing(tmp_path: Path) -> None:
    """The lease was taken, or renewed, as the attempt began: its first beat only reads the run
    (so a cancel recorded meanwhile is seen at once); renewals start ``every`` seconds in. A
    model step that streams beats with its first token: a transaction less per request."""
    store = SqlStore(f"sqlite:///{tmp_path / 'lease.db'}")
    store.upgrade()
    env = Envelope(type="step", message_id="m", run_id="r", created_at=datetime.now(UTC))
    with store.transaction() as tx:
        store.enqueue(tx, [Outgoing("q", env)], datetime.now(UTC))
    broker = DatabaseBroker(store, lease=timedelta(seconds=60), poll_interval=0.02)
    (delivery,) = broker.receive(["q"], 1, 0)
    statements: list[str] = []
    event.listen(store.engine, "before_cursor_execute", lambda *a: statements.append(a[2]))
    beat = _Heartbeat(store, delivery, "r", every=0.2)
    beat(None)
    renewed = lambda: any(s.startswith("UPDATE") for s in statements)  # noqa: E731
    assert not renewed() and any("FROM sagaloop_runs" in s for s in statements), statements
    eventually(lambda: beat(None) or renewed(), 10, "a renewal once 0.2 s passed")
    store.close()
