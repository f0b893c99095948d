"""``sagaloop.connect`` on PostgreSQL and RabbitMQ: a Client opened from URLs starts a run that
a Service (its relay publishing to RabbitMQ) carries out, and the run is recorded."""

from __future__ import annotations

import uuid

import pika
import pytest

import sagaloop
from sagaloop import App, Roles, SagaContext, Service, StepContext, Tuning
from sagaloop.runtime.connect import open_broker, open_store

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
