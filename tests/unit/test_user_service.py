"""A user's own service executes a step with sagaloop.outbox.handle_step: its business row,
the inbox row and the reply commit together, and a redelivered message changes nothing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import sqlalchemy as sa

from sagaloop import App, SagaContext, StepContext
from sagaloop.engine.messages import engine_queue, step_queue
from sagaloop.outbox import StepTask, handle_step
from sagaloop.testing import Harness

app = App("billing")


@app.step(queue="cards")
def charge(ctx: StepContext, cents: int) -> str:
    raise AssertionError("executed by the user's service, never by a sagaloop worker here")


@app.saga(name="bill")
async def bill(ctx: SagaContext, cents: int) -> str:
    return await ctx.call(charge, cents)


def test_business_row_inbox_and_reply_commit_together(tmp_path: Path) -> None:
    env = Harness(app, url=f"sqlite:///{tmp_path / 'b.db'}")
    store = env.store
    with store.engine.begin() as conn:
        conn.exec_driver_sql("create table charges (key text primary key, cents int)")
    env.queues = [engine_queue(app.name)]  # the user's service, not the harness, runs "cards"
    run_id = env.start(bill, 250)
    env.run_until_idle(skip_time=False)
    queue = step_queue(app.name, "cards")
    claimed = store.claim([queue], 1, env.clock.now(), env.lease)
    assert len(claimed) == 1
    body = claimed[0].body
    calls: list[StepTask] = []

    def handler(conn: sa.Connection, task: StepTask) -> Any:
        calls.append(task)
        conn.execute(
            sa.text("insert into charges values (:k, :c)"),
            {"k": task.idempotency_key, "c": task.args["cents"]},
        )
        return f"ch-{task.args['cents']}"

    for _ in range(2):  # the second is a redelivery of the same message
        with store.engine.begin() as conn:
            reply = handle_step(store, conn, body, handler, app=app.name, clock=env.clock)
        assert reply["outcome"] == "completed" and reply["result"] == "ch-250"
    assert len(calls) == 1, "the handler ran once"
    store.delete_claimed(None, [claimed[0].id], claimed[0].claim_token)
    env.run_until_idle()
    assert env.get(run_id).status == "completed" and env.result(run_id) == "ch-250"
    with store.engine.connect() as conn:
        assert conn.exec_driver_sql("select count(*) from charges").scalar() == 1
    env.close()


def test_a_failing_handler_rolls_everything_back(tmp_path: Path) -> None:
    env = Harness(app, url=f"sqlite:///{tmp_path / 'c.db'}")
    store = env.store
    with store.engine.begin() as conn:
        conn.exec_driver_sql("create table charges (key text primary key, cents int)")
    env.queues = [engine_queue(app.name)]
    env.start(bill, 99)
    env.run_until_idle(skip_time=False)
    claimed = store.claim([step_queue(app.name, "cards")], 1, env.clock.now(), env.lease)

    def broken(conn: sa.Connection, task: StepTask) -> Any:
        conn.execute(sa.text("insert into charges values ('x', 1)"))
        raise ConnectionError("card network down")

    try:
        with store.engine.begin() as conn:
            handle_step(store, conn, claimed[0].body, broken, app=app.name, clock=env.clock)
    except ConnectionError:
        pass
    with store.engine.connect() as conn:
        assert conn.exec_driver_sql("select count(*) from charges").scalar() == 0
    assert store.queue_depths().get(f"{app.name}.engine", 0) == 0, "no reply was queued"
    env.close()
