"""Transactional steps on real processes: a `sagaloop worker` (PostgreSQL + RabbitMQ) or a
`sagaloop dev` (SQLite file) killed with SIGKILL at a crash point before or after the commit
that records a step's outcome; the step's row in the app's own table (in the store's database)
is written exactly once either way. The app is txapp.py."""

from __future__ import annotations

import signal
import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from system import System
from test_hostile_saga_processes import Dev
from txapp import meta

from sagaloop import App, SagaContext, StepContext
from sagaloop.engine.messages import Envelope, Outcome, StepReply, inbox_key
from sagaloop.engine.ports import Delivery
from sagaloop.runtime.worker import WORKER_CONSUMER
from sagaloop.testing import Harness, eventually

pytestmark = pytest.mark.integration


@pytest.fixture
def txsystem(tmp_path: Path, rabbitmq_url: str) -> Iterator[System]:
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


# --- on PostgreSQL, in one process: a copy of the message that commits first ---------------


def test_a_copy_that_committed_first_wins_and_this_attempts_writes_roll_back(
    postgres_url: str,
) -> None:
    """Two copies of a step message (a relay that republished it) run at once on two workers;
    the one that stores its reply second must not keep its writes. Here the step's body
    commits the other copy's inbox row (on its own connection) while it runs."""
    app = App("tx-copies")
    table = sa.Table(
        "tx_copies",
        sa.MetaData(),
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("item", sa.String, nullable=False),
    )
    envelopes: list[Envelope] = []

    @app.step(transactional=True)
    def place(ctx: StepContext, item: str) -> int:
        assert ctx.transaction is not None
        ctx.transaction.execute(table.insert(), {"item": item})
        key = inbox_key(app.name, envelopes[-1])
        copy = StepReply(direction="do", worker="copy", outcome=Outcome.COMPLETED, result=42)
        with env.store.transaction() as tx:  # the copy's transaction, committed first
            env.store.inbox_put(tx, WORKER_CONSUMER, key, copy.to_payload(), env.clock.now())
        return 1

    @app.saga(name="buy")
    async def buy(ctx: SagaContext, item: str) -> int:
        return await ctx.call(place, item)

    def keep(role: str, delivery: Delivery) -> None:
        if role == "worker":
            envelopes.append(Envelope.from_bytes(delivery.body))

    env = Harness(app, url=postgres_url)
    try:
        table.create(env.store.engine)
        env.crash_hook = keep
        run_id = env.start(buy, "widget")
        env.run_until_idle()
        assert env.result(run_id) == 42  # the copy's reply, stored first
        with env.store.engine.connect() as conn:
            assert conn.execute(sa.select(table.c.item)).all() == []
    finally:
        env.close()


# --- the embedded default: one `sagaloop dev` process on a SQLite file ------------------------


@pytest.mark.parametrize(
    ("point", "runs_of_b"),
    [("worker.before_commit", 2), ("worker.after_commit", 1)],
)
def test_embedded_a_dev_process_killed_around_the_commit_writes_the_row_once(
    tmp_path: Path, point: str, runs_of_b: int
) -> None:
    url = f"sqlite:///{tmp_path / 'sagaloop.db'}"
    engine = sa.create_engine(url)
    meta.create_all(engine)  # the app's table, in the store's database
    doomed = Dev(tmp_path, app="txapp", SAGALOOP_LEASE="2", SAGALOOP_CRASH_AT=f"{point}:2")
    dev: Dev | None = None
    try:
        eventually(lambda: "dev: app" in doomed.log.read_text(), what="dev to start")
        run = doomed.cli("start", "reserve-all", "--input", '["a", "b", "c"]', "--app", "txapp")
        assert doomed.proc.wait(timeout=60) == -signal.SIGKILL, doomed.log.read_text()
        dev = Dev(tmp_path, app="txapp", SAGALOOP_LEASE="2")
        eventually(
            lambda: dev is not None and dev.status(run)["status"] == "completed",
            60,
            what="the run to complete",
        )
        with engine.connect() as conn:
            items = [str(r[0]) for r in conn.exec_driver_sql("select item from tx_orders")]
        assert sorted(items) == ["a", "b", "c"]
        with sqlite3.connect(tmp_path / "ledger.db") as ledger:
            runs = ledger.execute("select count(*) from bodies where item = 'b'").fetchone()
        assert runs[0] == runs_of_b
    finally:
        doomed.close()
        if dev is not None:
            dev.close()
        engine.dispose()
