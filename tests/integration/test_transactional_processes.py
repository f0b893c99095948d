"""Transactional steps on real processes (PostgreSQL + RabbitMQ): a `sagaloop worker` killed
with SIGKILL at a crash point before or after the commit that records a step's outcome; the
step's row in the app's own table (in the store's database) is written exactly once either
way. The app is txapp.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from system import System
from txapp import meta

pytestmark = pytest.mark.integration


@pytest.fixture
def txsystem(tmp_path: Path, rabbitmq_url: str) -> System:
    s = System(tmp_path, rabbitmq_url, app="txapp")
    meta.create_all(s.store.engine)
    try:
        yield s
    finally:
        s.close()


def orders(system: System) -> list[str]:
    with system.store.engine.connect() as conn:
        return [str(r[0]) for r in conn.exec_driver_sql("select item from tx_orders order by id")]


def bodies(system: System, step: str) -> list[str]:
    return [str(i) for (i,) in system.ledger("select item from bodies where step = ?", step)]


@pytest.mark.parametrize(
    ("point", "runs_of_b"),
    [("worker.before_commit", 2), ("worker.after_commit", 1)],
)
def test_a_worker_killed_around_the_commit_writes_the_row_once(
    txsystem: System, point: str, runs_of_b: int
) -> None:
    system = txsystem
    system.engine()
    doomed = system.worker(queues="work", SAGALOOP_CRASH_AT=f"{point}:2")
    run = system.client.start("reserve-all", ["a", "b", "c"])
    system.wait_killed_by_crash_point(doomed)
    system.worker(queues="work")
    assert system.wait_final([run]) == {run: "completed"}
    assert orders(system) == ["a", "b", "c"]
    # before the commit, the body of b ran twice and its first write was rolled back with its
    # outcome; after it, the redelivered message found its inbox row and ran nothing
    assert bodies(system, "reserve").count("b") == runs_of_b
    ids = system.client.get(run).output
    assert len(set(ids)) == 3
    system.assert_histories_sound([run])
    assert system.dead_letter_count() == 0


def test_the_steps_timeout_is_the_transactions_statement_timeout(txsystem: System) -> None:
    system = txsystem
    system.engine()
    system.worker(queues="work")
    run = system.client.start("reserve-slowly", "s")
    assert system.wait_final([run], timeout=60) == {run: "failed"}
    error = system.client.get(run).error
    assert error is not None and "StepTimeoutError" in str(error), error
    assert bodies(system, "slow_reserve") == ["s"]
    assert orders(system) == []  # its insert was rolled back with the cancelled statement
