"""A service's store keeps a connection for each of the service's threads that may use it at
once (``Tuning.connections``, what ``sagaloop engine|worker|dev --concurrency N`` open it with),
so that a busy service keeps its connections: a pool smaller than that (5, the
default before) opened a PostgreSQL backend for each transaction beyond its size and closed it
again, measured as 131 new sessions per 1,280 in-process steps at ``--concurrency 32``. A
service on a store too small for it says so when it starts."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
import uuid
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import event

import sagaloop
from sagaloop import App, Roles, SagaContext, Service, StepContext, Tuning
from sagaloop.runtime.connect import open_broker, open_store
from sagaloop.testing import eventually

pytestmark = pytest.mark.integration

THREADS = 12
ROUNDS = 8

app = App(f"pool{uuid.uuid4().hex[:6]}")
meeting = threading.Barrier(THREADS)
"""Every round's steps end together, so that their replies are written at once."""


@app.step(queue="q")
def together(ctx: StepContext, i: int) -> int:
    with contextlib.suppress(threading.BrokenBarrierError):  # a slow round: its steps end
        meeting.wait(timeout=10)
    return i


@app.saga(name="meet")
async def meet(ctx: SagaContext, i: int) -> int:
    return int(await ctx.call(together, i))


def test_a_busy_service_on_a_store_sized_by_its_tuning_never_closes_a_connection(
    database: str,
) -> None:
    tuning = Tuning(concurrency=THREADS, poll=0.05)
    store = open_store(database, connections=tuning.connections)
    opened, closed = [], []
    event.listen(store.engine, "connect", lambda *_: opened.append(1))
    event.listen(store.engine, "close", lambda *_: closed.append(1))
    broker = open_broker("database", store)
    service = Service(app, store, broker, roles=Roles(), tuning=tuning).start()
    client = sagaloop.connect(database, app)
    try:
        for _ in range(ROUNDS):
            meeting.reset()
            ids = [client.start(meet, i) for i in range(THREADS)]
            assert [client.result(run_id, timeout=120) for run_id in ids] == list(range(THREADS))
        assert closed == [], f"{len(closed)} connections closed, {len(opened)} opened"
        assert len(opened) <= tuning.connections
    finally:
        service.stop()
        broker.close()
        client.store.close()
        store.close()


def test_a_service_on_a_store_smaller_than_its_threads_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    url = f"sqlite:///{tmp_path / 'pool.db'}"
    tuning = Tuning(concurrency=THREADS, poll=0.05)
    caplog.set_level(logging.WARNING, logger="sagaloop.runtime.service")

    def started(**options: Any) -> list[str]:
        caplog.clear()
        store = open_store(url, upgrade=True, **options)
        broker = open_broker("database", store)
        service = Service(app, store, broker, roles=Roles(), tuning=tuning).start()
        service.stop()
        broker.close()
        store.close()
        return [r.getMessage() for r in caplog.records if "pool" in r.getMessage()]

    (said,) = started()  # the default pool: 5
    assert "keeps 5 connections for 15 threads" in said
    assert f"connections=tuning.connections) ({tuning.connections})" in said
    assert started(connections=tuning.connections) == []
    with pytest.raises(ValueError, match="at least 1 connection"):
        open_store(url, connections=0)  # SQLAlchemy would read 0 as no limit at all


@pytest.mark.parametrize("command", ["dev", "engine", "worker"])
def test_the_service_commands_open_a_store_sized_for_their_concurrency(
    tmp_path: Path, command: str
) -> None:
    """``sagaloop dev|engine|worker --concurrency 12`` open their store with the pool their
    threads need: none says that its pool is too small (as a service on the default pool of 5
    does, above)."""
    here = Path(__file__).resolve().parent
    url = f"sqlite:///{tmp_path / 'cli.db'}"
    env = {
        **os.environ,
        "SAGALOOP_DATABASE_URL": url,
        "SAGALOOP_BROKER_URL": "database",
        "PYTHONPATH": os.pathsep.join([str(here), str(here.parents[1])]),
    }
    if command != "dev":  # dev creates the database; the others need it made
        subprocess.run(
            [sys.executable, "-m", "sagaloop", "db", "upgrade"], env=env, check=True, timeout=120
        )
    log = tmp_path / f"{command}.log"
    args = ["--concurrency", str(THREADS), "--poll", "0.05", "--app", "itapp"]
    if command == "worker":
        args += ["--queue", "work,other"]
    with log.open("wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "sagaloop", command, *args],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=err,
        )
    try:
        eventually(lambda: f"{command}: app" in log.read_text(), what=f"{command} to start")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    said = log.read_text()
    assert "ready" in said and "pool keeps" not in said, said


def test_a_client_that_many_threads_use_at_once_keeps_its_connections(tmp_path: Path) -> None:
    """``connect(url, app, connections=N)``: a client used by N threads at once (a web
    server's) keeps a connection for each; on a pool of 5 its starts opened and closed them."""
    url = f"sqlite:///{tmp_path / 'client.db'}"
    open_store(url, upgrade=True).close()
    client = sagaloop.connect(url, app, connections=THREADS)
    closed: list[int] = []
    event.listen(client.store.engine, "close", lambda *_: closed.append(1))
    together_now = threading.Barrier(THREADS)

    def starts() -> None:
        together_now.wait(timeout=60)
        for i in range(ROUNDS):
            client.start(meet, i)

    threads = [threading.Thread(target=starts) for _ in range(THREADS)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert sum(client.count().values()) == THREADS * ROUNDS
        assert closed == [], f"{len(closed)} connections opened and closed"
    finally:
        client.store.close()
