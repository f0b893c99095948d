"""Updates (``Client.update``, ``ctx.on_update``) on real processes: a `sagaloop engine` and a
`sagaloop worker` on RabbitMQ + PostgreSQL. The engine is SIGKILLed between an update's
acceptance and its answer (its handler awaits a step that is held meanwhile): a new engine
answers it once, the sender's ``Client.update`` returns that answer, and a retry with the same
``update_id`` gets the same answer without applying it again. A validator's refusal reaches
the sender and records nothing but the refusal."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from system import System
from test_hostile_saga_processes import Dev

from sagaloop import UpdateRefusedError
from sagaloop.client import Client
from sagaloop.engine import history as h
from sagaloop.store.sql import SqlStore
from sagaloop.testing import eventually

pytestmark = pytest.mark.integration


@pytest.fixture
def system(tmp_path: Path, rabbitmq_url: str) -> Iterator[System]:
    system = System(tmp_path, rabbitmq_url, app="updates_app")
    try:
        yield system
    finally:
        system.close()


def _kinds(system: System, run_id: str) -> list[str]:
    return [e.kind for e in system.client.history(run_id) if e.kind.startswith("update_")]


def _marks(system: System) -> list[str]:
    return [str(w) for (w,) in system.ledger("select what from marks order by rowid")]


def test_an_update_accepted_before_the_engine_is_killed_is_answered_once(
    system: System, tmp_path: Path
) -> None:
    gate = tmp_path / "gate"
    engine = system.engine()
    system.worker(queues="work")
    system.wait_ready("engine")
    system.wait_ready("worker")
    client = system.client
    run_id = client.start("account", str(gate))
    with pytest.raises(UpdateRefusedError, match="a deposit is positive, not -5") as refused:
        client.update(run_id, "deposit", {"id": "d0", "amount": -5}, timeout=60)
    assert refused.value.error.type == "ValueError"
    assert _kinds(system, run_id) == [h.UPDATE_REFUSED]

    with ThreadPoolExecutor(1) as pool:
        sent = pool.submit(
            client.update, run_id, "deposit", {"id": "d1", "amount": 7}, update_id="u1", timeout=120
        )
        eventually(lambda: "d1 booking" in _marks(system), 60, "the booking to start")
        assert _kinds(system, run_id) == [h.UPDATE_REFUSED, h.UPDATE_ACCEPTED]
        System.kill(engine)  # accepted, not answered
        gate.touch()  # the step ends; its result waits for an engine
        assert not sent.done()
        system.engine()
        assert sent.result(timeout=120) == 7, system.logs()

    assert client.update(run_id, "deposit", {"id": "d1", "amount": 7}, update_id="u1") == 7
    assert _kinds(system, run_id) == [h.UPDATE_REFUSED, h.UPDATE_ACCEPTED, h.UPDATE_COMPLETED]
    assert system.ledger("select count(*) from effects where step = 'd1'") == [(1,)]
    assert client.update(run_id, "close", timeout=60) == 7
    assert system.wait_final([run_id]) == {run_id: "completed"}
    assert client.get(run_id).output == 7
    system.assert_histories_sound([run_id])


@pytest.mark.parametrize("point", ["engine.before_commit", "engine.after_commit"])
def test_the_engine_killed_at_a_crash_point_as_it_takes_an_update(
    system: System, tmp_path: Path, point: str
) -> None:
    """The engine dies at ``point`` in the activation that takes the update (before its
    acceptance commits; after it commits, the message not yet acknowledged): the next engine
    takes the redelivered message and the update is accepted and answered once."""
    gate = tmp_path / "gate"
    gate.touch()
    engine = system.engine()
    system.worker(queues="work")
    system.wait_ready("engine")
    system.wait_ready("worker")
    client = system.client
    run_id = client.start("account", str(gate))
    assert client.update(run_id, "deposit", {"id": "d0", "amount": 1}, timeout=60) == 1
    System.kill(engine)
    doomed = system.engine(SAGALOOP_CRASH_AT=point)  # its first commit: the update's
    eventually(lambda: "engine: app" in system._logs[-1].read_text(), what="the engine")
    with ThreadPoolExecutor(1) as pool:
        data = {"id": "d1", "amount": 7}
        sent = pool.submit(client.update, run_id, "deposit", data, update_id="u1", timeout=120)
        System.wait_killed_by_crash_point(doomed)
        system.engine()
        assert sent.result(timeout=120) == 8, system.logs()
    updates = [(e.kind, e.data["update_id"]) for e in client.history(run_id) if "update" in e.kind]
    assert updates[2:] == [(h.UPDATE_ACCEPTED, "u1"), (h.UPDATE_COMPLETED, "u1")]
    assert system.ledger("select count(*) from effects where step = 'd1'") == [(1,)]
    assert client.update(run_id, "close", timeout=60) == 8
    assert system.wait_final([run_id]) == {run_id: "completed"}
    system.assert_histories_sound([run_id])


def test_embedded_an_update_accepted_before_dev_is_killed_is_answered_once(
    tmp_path: Path,
) -> None:
    """The same on the embedded default: one `sagaloop dev` process (engine and worker) on a
    SQLite file, SIGKILLed while the update's step runs; the next `sagaloop dev` runs the
    step again (in doubt, with its key) and answers the update once."""
    gate = tmp_path / "gate"
    dev = Dev(tmp_path, "updates_app", SAGALOOP_LEASE="3")
    store = SqlStore(dev.env["SAGALOOP_DATABASE_URL"])
    ledger = dev.ledger
    try:
        eventually(lambda: "dev: app" in dev.log.read_text(), what="dev to start")
        client = Client(store, "updates_app")
        run_id = client.start("account", str(gate))
        with ThreadPoolExecutor(1) as pool:
            data = {"id": "d1", "amount": 7}
            sent = pool.submit(client.update, run_id, "deposit", data, update_id="u1", timeout=120)
            eventually(lambda: "d1 booking" in _marks_at(ledger), 60, "the booking to start")
            assert [e.kind for e in client.history(run_id) if "update" in e.kind] == [
                h.UPDATE_ACCEPTED
            ]
            System.kill(dev.proc)
            gate.touch()
            dev = Dev(tmp_path, "updates_app", SAGALOOP_LEASE="3")
            assert sent.result(timeout=120) == 7, dev.log.read_text()[-4000:]
        kinds = [e.kind for e in client.history(run_id) if "update" in e.kind]
        assert kinds == [h.UPDATE_ACCEPTED, h.UPDATE_COMPLETED]
        assert dev.effects() == ["d1"]  # one effect: the step's key, whichever attempt
        assert client.update(run_id, "close", timeout=60) == 7
        eventually(lambda: client.get(run_id).status == "completed", 60, "the run to end")
    finally:
        dev.close()
        store.close()


def _marks_at(ledger: Path) -> list[str]:
    if not ledger.exists():
        return []
    with sqlite3.connect(ledger, timeout=60) as conn:
        try:
            return [str(w) for (w,) in conn.execute("select what from marks order by rowid")]
        except sqlite3.OperationalError:
            return []
