"""A database outage seen through SqlStore: a private PostgreSQL server is stopped under an
open transaction and while a new one starts (both TransientStoreError), then started and
restarted (the pool reconnects: transactions succeed again)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime

import pytest
from private_postgres import PrivatePostgres

from sagaloop.engine.messages import Envelope
from sagaloop.engine.ports import Outgoing, RunRecord
from sagaloop.errors import TransientStoreError
from sagaloop.store import migrations
from sagaloop.store.sql import SqlStore

pytestmark = pytest.mark.integration

NOW = datetime(2030, 1, 1, tzinfo=UTC)


@pytest.fixture
def pg() -> Iterator[PrivatePostgres]:
    server = PrivatePostgres()
    try:
        server.start()
        yield server
    finally:
        server.close()


def _create(store: SqlStore, run_id: str) -> bool:
    with store.transaction() as tx:
        return store.create_run(tx, RunRecord(run_id, "app", "outage", "running", None, NOW, NOW))


@pytest.mark.parametrize("mode", ["fast", "immediate"])
def test_an_outage_is_transient_and_the_store_recovers(pg: PrivatePostgres, mode: str) -> None:
    """``fast`` ends sessions with an admin shutdown (57P01); ``immediate`` is a crash: the
    connection just closes."""
    started = time.monotonic()
    store = SqlStore(pg.url, connect_timeout=2, pool_timeout=5)
    try:
        assert store.upgrade() == (0, migrations.LATEST)
        assert _create(store, "before")

        # the server stops under an open transaction: the connection is lost
        with pytest.raises(TransientStoreError) as lost, store.transaction() as tx:
            assert store.lock_run(tx, "before") is not None
            pg.stop(mode)
            store.lock_run(tx, "before")
        assert lost.value.__cause__ is not None

        # while it is down, a new transaction cannot connect
        with pytest.raises(TransientStoreError) as refused:
            _create(store, "during")
        assert "retry" in str(refused.value)
        with pytest.raises(TransientStoreError):
            store.get_run("before")

        # back up: the pool replaces its dead connections and the work succeeds
        pg.start()
        assert _create(store, "after")
        assert store.get_run("before") is not None
        assert store.get_run("during") is None, "the failed transaction left nothing"

        # a restart with connections in the pool costs nothing visible (store/connect.py)
        pg.restart()
        assert _create(store, "after-restart")
        assert {r.run_id for r in store.list_runs()} == {"before", "after", "after-restart"}
    finally:
        store.close()
    pg.stop()
    assert not pg.running()
    assert time.monotonic() - started < 20


def test_the_outbox_listener_hears_again_after_the_server_restarts(pg: PrivatePostgres) -> None:
    """``SqlStore.listen_for_writes`` (what wakes a relay when another process commits outbox
    rows) survives its server's crash: it listens again once the server is back, and never
    raises into the thread that runs it."""
    store = SqlStore(pg.url, connect_timeout=2, pool_timeout=5)
    store.upgrade()
    heard = threading.Semaphore(0)
    stopping = threading.Event()
    failed: list[BaseException] = []

    def listen() -> None:
        try:
            store.listen_for_writes(heard.release, stopping)
        except BaseException as e:  # the test fails on it
            failed.append(e)

    listener = threading.Thread(target=listen, daemon=True)
    listener.start()

    def write_until_heard(run_id: str) -> None:
        """Commit an unclaimed outbox row until the listener hears one (it may not listen yet)."""
        deadline = time.monotonic() + 60
        while not heard.acquire(timeout=0.5):
            assert time.monotonic() < deadline, f"{run_id}: never heard"
            try:
                with store.transaction() as tx:
                    message = Envelope(type="event", run_id=run_id)
                    store.enqueue(tx, [Outgoing("q", message)], NOW)
            except TransientStoreError:
                pass  # the server is still coming back

    try:
        while heard.acquire(timeout=0.5):  # its first wake: rows written before it listened
            pass
        write_until_heard("before")
        pg.stop("immediate")  # a crash: the listener's connection just closes
        pg.start()
        while heard.acquire(timeout=0.1):
            pass
        write_until_heard("after")
        assert listener.is_alive() and not failed
    finally:
        stopping.set()
        listener.join(10)
        store.close()
    assert not listener.is_alive() and not failed
