"""``sagaloop.connect`` and the URL factory of ``sagaloop.runtime.connect`` on the embedded
default: a Client from a URL starts runs that a Service in the same process carries out."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

import sagaloop
from sagaloop import App, Roles, SagaContext, Service, StepContext, Tuning
from sagaloop.runtime.connect import URLError, open_broker, open_store

app = App("connected")


@app.step(queue="q")
def greet(ctx: StepContext, name: str) -> str:
    return f"hello {name}"


@app.saga(name="hello")
async def hello(ctx: SagaContext, name: str) -> str:
    return await ctx.call(greet, name)


@pytest.fixture
def url(tmp_path: Path) -> str:
    url = f"sqlite:///{tmp_path / 'connected.db'}"
    open_store(url, upgrade=True).close()
    return url


@pytest.fixture
def service(url: str) -> Iterator[Service]:
    store = open_store(url)
    broker = open_broker("database", store)
    service = Service(app, store, broker, tuning=Tuning(poll=0.02, concurrency=1)).start()
    try:
        yield service
    finally:
        service.stop()
        broker.close()
        store.close()


def test_a_run_started_through_connect_is_carried_out_and_recorded(
    url: str, service: Service
) -> None:
    client = sagaloop.connect(url, app)
    try:
        run_id = client.start(hello, "ada")
        assert client.result(run_id, timeout=30) == "hello ada"
        assert client.get(run_id).status == "completed"
        kinds = [event.kind for event in client.history(run_id)]
        assert "step_completed" in kinds, kinds
    finally:
        client.store.close()


def test_connect_refuses_a_database_that_does_not_exist(tmp_path: Path) -> None:
    missing = tmp_path / "nothing.db"
    with pytest.raises(URLError, match=r"no database at .*sagaloop db upgrade"):
        sagaloop.connect(f"sqlite:///{missing}", app)
    assert not missing.exists(), "no empty database is left behind"


def test_connect_refuses_an_unknown_broker_with_its_password_masked(url: str) -> None:
    with pytest.raises(URLError, match="unsupported broker URL") as raised:
        sagaloop.connect(url, app, broker="kafka://me:secret@host")
    assert "secret" not in str(raised.value)
    assert isinstance(raised.value, sagaloop.SagaloopError)
    assert isinstance(raised.value, ValueError)


def test_an_unknown_broker_url_is_refused_by_the_factory(url: str) -> None:
    store = open_store(url)
    try:
        with pytest.raises(URLError, match="unsupported SAGALOOP_BROKER_URL 'nats://x'"):
            open_broker("nats://x", store, what="SAGALOOP_BROKER_URL")
    finally:
        store.close()


def test_the_service_plays_the_roles_it_is_given(url: str) -> None:
    store = open_store(url)
    try:
        broker = open_broker("database", store)
        worker = Service(app, store, broker, roles=Roles(engine=False, timers=False))
        assert [t.name for t in worker.threads] == ["worker-0", "worker-1", "worker-2", "worker-3"]
        assert worker.consumes == ["connected.steps.q"]
        engine = Service(app, store, broker, roles=Roles(queues=()), tuning=Tuning(batch=4))
        assert [t.name for t in engine.threads] == ["engine", "starts", "timers"]
        assert engine.consumes == ["connected.engine", "connected.starts"]
    finally:
        store.close()
