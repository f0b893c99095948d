"""The threaded services on the embedded default: real threads, real time, a SQLite file."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest

from sagaloop import App, Client, RetryPolicy, SagaContext, StepContext
from sagaloop.brokers.database import DatabaseBroker
from sagaloop.engine import history as h
from sagaloop.runtime.assembly import Roles, Tuning
from sagaloop.runtime.service import Runtime
from sagaloop.store.sql import SqlStore

app = App("rt")
calls: dict[str, list[tuple[int, bool]]] = {"slow": [], "long": [], "aio": []}
FAST = RetryPolicy(max_attempts=3, initial_interval=timedelta(milliseconds=50))


@app.step(queue="q", timeout=timedelta(milliseconds=300), retry=FAST)
def slow(ctx: StepContext, n: int) -> int:
    calls["slow"].append((ctx.attempt, ctx.in_doubt))
    if ctx.attempt == 1:
        time.sleep(1.5)  # past the timeout: the attempt is abandoned, in doubt
    return n + 1


@app.step(queue="q")
def long(ctx: StepContext, n: int) -> int:
    calls["long"].append((ctx.attempt, ctx.in_doubt))
    time.sleep(1.5)  # three leases long: the worker must keep renewing its claim
    return n * 2


@app.step(queue="q")
async def aio(ctx: StepContext, n: int) -> int:
    calls["aio"].append((ctx.attempt, ctx.in_doubt))
    return n * 10


@app.saga(name="timeouts")
async def timeouts(ctx: SagaContext, n: int) -> int:
    return await ctx.call(slow, n)


@app.saga(name="long")
async def long_saga(ctx: SagaContext, n: int) -> int:
    return await ctx.call(long, n)


@app.saga(name="async")
async def async_saga(ctx: SagaContext, n: int) -> int:
    return await ctx.call(aio, n)


@pytest.fixture
def services(tmp_path: Path) -> Iterator[tuple[Client, SqlStore]]:
    for v in calls.values():
        v.clear()
    store = SqlStore(f"sqlite:///{tmp_path / 'rt.db'}")
    store.upgrade()
    broker = DatabaseBroker(store, lease=timedelta(milliseconds=500), poll_interval=0.02)
    runtime = Runtime(app, store, broker, poll=0.02, heartbeat=0.1, concurrency=2).start()
    try:
        yield Client(store, app), store
    finally:
        runtime.stop()
        assert not [t for t in runtime.threads if t.is_alive()], "stop() must end every thread"
        store.close()


def test_a_timed_out_attempt_is_retried_in_doubt(services: tuple[Client, SqlStore]) -> None:
    client, _ = services
    run_id = client.start(timeouts, 1)
    assert client.result(run_id, timeout=20) == 2
    assert calls["slow"][:2] == [(1, False), (2, True)]
    retrying = [e for e in client.history(run_id) if e.kind == h.STEP_RETRYING]
    assert retrying[0].data["error"]["type"] == "StepTimeoutError"
    assert retrying[0].data["in_doubt"] is True


def test_a_step_longer_than_the_lease_runs_once(services: tuple[Client, SqlStore]) -> None:
    client, _ = services
    run_id = client.start(long_saga, 4)
    assert client.result(run_id, timeout=20) == 8
    assert calls["long"] == [(1, False)]


def test_async_steps_run(services: tuple[Client, SqlStore]) -> None:
    client, _ = services
    run_id = client.start(async_saga, 3)
    assert client.result(run_id, timeout=20) == 30
    assert calls["aio"] == [(1, False)]


def test_stop_is_prompt_and_leaves_queued_work(tmp_path: Path) -> None:
    store = SqlStore(f"sqlite:///{tmp_path / 'stop.db'}")
    store.upgrade()
    runtime = Runtime(app, store, DatabaseBroker(store), poll=0.05).start()
    started = time.monotonic()
    runtime.stop()
    assert time.monotonic() - started < 5
    assert threading.active_count() < 50
    client = Client(store, app)
    run_id = client.start(async_saga, 1)
    assert store.queue_depths() == {"rt.starts": 1}, "nothing consumed after stop"
    assert client.get(run_id).status == "running"
    store.close()


def test_runtime_keeps_its_keywords_for_one_release(tmp_path: Path) -> None:
    """``Runtime``'s 15 keywords are ``Service``'s roles and tuning."""
    store = SqlStore(f"sqlite:///{tmp_path / 'rt.db'}")
    store.upgrade()
    try:
        runtime = Runtime(
            app,
            store,
            DatabaseBroker(store),
            engine=False,
            queues=["q"],
            timers=False,
            concurrency=2,
            poll=0.5,
            heartbeat=3.0,
            relay_lease=timedelta(seconds=9),
            batch=8,
            activation_deadline=1.0,
        )
        assert runtime.roles == Roles(engine=False, queues=["q"], timers=False)
        assert runtime.tuning == Tuning(
            concurrency=2,
            batch=8,
            poll=0.5,
            heartbeat=3.0,
            lease=timedelta(seconds=9),
            activation_deadline=1.0,
        )
        assert [t.name for t in runtime.threads] == ["worker-0", "worker-1"]
    finally:
        store.close()
