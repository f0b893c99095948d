"""``sagaloop.connect`` on PostgreSQL and RabbitMQ: a Client opened from URLs starts a run that
a Service (its relay publishing to RabbitMQ) carries out, and the run is recorded."""

from __future__ import annotations

import collections
import threading
import time
import uuid
from typing import Any

import pika
import pytest

import sagaloop
from sagaloop import App, Roles, SagaContext, Service, StepContext, Tuning
from sagaloop.runtime.connect import open_broker, open_store
from sagaloop.testing import eventually

pytestmark = pytest.mark.integration

app = App(f"conn{uuid.uuid4().hex[:6]}")


@app.step(queue="q")
def greet(ctx: StepContext, name: str) -> str:
    return f"hello {name}"


@app.saga(name="hello")
async def hello(ctx: SagaContext, name: str) -> str:
    return await ctx.call(greet, name)


def test_a_run_started_through_connect_runs_on_rabbitmq_and_is_recorded(
    postgres_url: str, rabbitmq_url: str
) -> None:
    namespace = f"it-{uuid.uuid4().hex[:8]}"
    store = open_store(postgres_url)
    broker = open_broker(rabbitmq_url, store, namespace=namespace)
    service = Service(app, store, broker, tuning=Tuning(poll=0.05, concurrency=1))
    assert service.relay is not None, "RabbitMQ is outside the database: a relay publishes"
    service.start()
    client = sagaloop.connect(postgres_url, app, broker=rabbitmq_url, namespace=namespace)
    try:
        run_id = client.start(hello, "ada")
        assert client.result(run_id, timeout=60) == "hello ada"
        assert client.get(run_id).status == "completed"
        assert "step_completed" in [event.kind for event in client.history(run_id)]
    finally:
        service.stop()
        broker.close()
        client.store.close()
        store.close()
        _delete_namespace(rabbitmq_url, namespace)


def _delete_namespace(url: str, namespace: str) -> None:
    connection = pika.BlockingConnection(pika.URLParameters(url))
    try:
        ch = connection.channel()
        for queue in ("engine", "starts", "steps.q"):
            ch.queue_delete(f"{namespace}.{app.name}.{queue}")
        ch.queue_delete(f"{namespace}.dead")
        for exchange in (namespace, f"{namespace}.dlx", f"{namespace}.internal"):
            ch.exchange_delete(exchange)
    finally:
        connection.close()


def test_only_an_engine_process_listens_for_other_processes_writes(
    postgres_url: str, rabbitmq_url: str
) -> None:
    """What another process commits unclaimed (a client's start, an event, a step completed
    from outside) goes to an engine's queue; an engine's relay is woken for it at once. A
    worker's relay sweeping for it too would only spend the worker's CPU on every start (a
    burst of starts woke every worker as often)."""
    namespace = f"it-{uuid.uuid4().hex[:8]}"
    store = open_store(postgres_url)
    broker = open_broker(rabbitmq_url, store, namespace=namespace)
    try:
        worker = Service(app, store, broker, roles=Roles(engine=False, timers=False))
        engine = Service(app, store, broker, roles=Roles(queues=[]))
        assert worker.relay is not None and engine.relay is not None
        assert "outbox-listener" not in [t.name for t in worker.threads]
        assert "outbox-listener" in [t.name for t in engine.threads]
    finally:
        broker.close()
        store.close()
        _delete_namespace(rabbitmq_url, namespace)


def _count_sweeps(store: Any, monkeypatch: pytest.MonkeyPatch) -> collections.Counter[int]:
    """The relays' sweeps (``claim`` of rows nobody holds), by the service that made them."""
    sweeps: collections.Counter[int] = collections.Counter()
    claim = store.claim

    def counted(queues: Any, *args: Any, **kwargs: Any) -> Any:
        if queues is None and threading.current_thread().name == "relay":
            sweeps[threading.get_ident()] += 1
        return claim(queues, *args, **kwargs)

    monkeypatch.setattr(store, "claim", counted)
    return sweeps


def test_on_postgresql_a_relay_nothing_wakes_sweeps_about_once_a_second(
    postgres_url: str, rabbitmq_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows nobody holds are announced (``NOTIFY``) to the engines' listeners, whose relays
    sweep at once; a sweep nothing woke only looks for rows of processes that died or of
    publishes that failed, never urgent to the second. Every ``poll`` it cost an idle engine a
    statement and, at each step of a sequential run, a busy one a transaction (6 % of its
    GIL's time, its pending deletes riding the claim): it runs once a second at most."""
    namespace = f"it-{uuid.uuid4().hex[:8]}"
    store = open_store(postgres_url)
    broker = open_broker(rabbitmq_url, store, namespace=namespace)
    sweeps = _count_sweeps(store, monkeypatch)
    fast = Tuning(poll=0.02)
    worker = Service(app, store, broker, roles=Roles(engine=False, timers=False), tuning=fast)
    engine = Service(app, store, broker, roles=Roles(queues=[]), tuning=fast)
    try:
        worker.start()
        engine.start()
        assert engine.listening.wait(60)
        listened = sweeps.copy()  # then the listener's first wake is swept: count from there
        eventually(lambda: len(sweeps - listened) == 2, 60, "a sweep of each relay")
        began, counted = time.monotonic(), sweeps.copy()

        def three_each() -> collections.Counter[int] | None:
            swept = sweeps - counted
            return swept if len(swept) == 2 and min(swept.values()) >= 3 else None

        # A rate, bounded from below only: a loaded machine sweeps less often, not more.
        swept = eventually(three_each, 60, "three sweeps of each relay")
        assert time.monotonic() - began >= 1.5, swept  # two quiet intervals, not two polls
        assert max(swept.values()) <= 4, swept  # about once a second, not every poll
    finally:
        engine.stop()
        worker.stop()
        broker.close()
        store.close()
        _delete_namespace(rabbitmq_url, namespace)


def test_an_engine_whose_listener_is_not_connected_sweeps_every_poll(
    postgres_url: str, rabbitmq_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While its listener cannot listen (the server restarting, a pooler that drops
    ``LISTEN``), nothing announces other processes' rows: the engine's relay sweeps every
    ``poll``, as on SQLite."""
    namespace = f"it-{uuid.uuid4().hex[:8]}"
    store = open_store(postgres_url)
    broker = open_broker(rabbitmq_url, store, namespace=namespace)
    sweeps = _count_sweeps(store, monkeypatch)
    never = lambda woken, stopping, listening: stopping.wait()  # noqa: E731 (cannot listen)
    monkeypatch.setattr(store, "listen_for_writes", never)
    engine = Service(app, store, broker, roles=Roles(queues=[]), tuning=Tuning(poll=0.02))
    try:
        engine.start()
        began = time.monotonic()
        eventually(lambda: sum(sweeps.values()) >= 20, 60, "20 sweeps")
        assert time.monotonic() - began < 15, sweeps  # 20 s at one a second
        assert not engine.listening.is_set()
    finally:
        engine.stop()
        broker.close()
        store.close()
        _delete_namespace(rabbitmq_url, namespace)
