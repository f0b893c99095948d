"""Cancellation delivered into saga code (issue 25, item 13) on real processes: a `sagaloop
engine` and a `sagaloop worker` on RabbitMQ + PostgreSQL. The engine is SIGKILLed while the
saga's ``finally`` runs its cleanup step; a new engine replays the history (the cancel raised
at the same await), takes the cleanup's result, and the cleanup step ran once."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from system import System

from sagaloop.engine import history as h
from sagaloop.testing import eventually

pytestmark = pytest.mark.integration


@pytest.fixture
def system(tmp_path: Path, rabbitmq_url: str) -> Iterator[System]:
    system = System(tmp_path, rabbitmq_url, app="primitives_app")
    try:
        yield system
    finally:
        system.close()


def marks(system: System, prefix: str) -> list[str]:
    rows = system.ledger("select what from marks order by rowid")
    return [str(w) for (w,) in rows if str(w).startswith(prefix)]


def mark(system: System, what: str) -> None:
    import sqlite3

    with sqlite3.connect(system.ledger_path, timeout=60) as conn:
        conn.execute("create table if not exists marks (what text)")
        conn.execute("insert into marks values (?)", (what,))


def test_cancel_cleanup_survives_an_engine_kill(system: System) -> None:
    engine = system.engine()
    system.worker(queues="work")
    system.wait_ready("engine")
    system.wait_ready("worker")
    client = system.client
    run = client.start("tidy", "t1")
    eventually(lambda: client.get(run).status == "waiting", timeout=60, what="the run to wait")
    client.cancel(run, "the user left")
    eventually(lambda: marks(system, "t1 ") == ["t1 cleaning"], timeout=60, what="the cleanup")
    assert client.get(run).status == "cancelling"
    system.kill(engine)  # the engine dies with the saga code suspended in its finally
    system.engine()
    mark(system, "t1 release")  # the cleanup step ends; its result reaches the new engine
    assert system.wait_final([run], timeout=90) == {run: "cancelled"}, system.logs()

    bodies = system.ledger("select step, attempt from bodies where key not like '%/undo'")
    assert sorted(bodies) == [("t1", 1), ("t1-after", 1), ("t1-before", 1)], bodies
    undone = [s for (s,) in system.ledger("select step from undos order by seq")]
    assert undone == ["t1-after", "t1-before"]  # the cancel wins: all its effects undone
    events = client.history(run)
    kinds = [e.kind for e in events]
    assert kinds.count(h.CANCEL_DELIVERED) == 1 and kinds.count(h.CANCEL_REQUESTED) == 1
    assert h.CANCEL_GRACE_EXPIRED not in kinds
    assert [e.name for e in events if e.kind == h.STEP_SCHEDULED] == [
        "effect",
        "held_cleanup",
        "effect",
    ]
    system.assert_histories_sound([run])
