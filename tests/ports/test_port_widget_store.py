"""Port of DBOS's widget store (its checkout and order dispatch workflows).

Original: github.com/dbos-inc/dbos-demo-apps, commit 90064b85b5838e403c006c077afdc09bea70f348,
``python/widget-store/widget_store/main.py``, tested by
``python/widget-store/tests/test_widget_store.py`` (``test_checkout_workflow``).

What maps to what:

- each ``@DBOS.transaction()`` (``create_order``, ``reserve_inventory``,
  ``undo_reserve_inventory``, ``update_order_status``, ``update_order_progress``) -> a step
  declared ``transactional=True``, whose ``ctx.transaction`` stands for ``DBOS.sql_session``:
  its writes commit with the step's checkpoint, as a DBOS transaction's do; the app's tables
  (the original's ``schema.py``, with its ``progress_remaining`` migration) live in the
  store's database;
- ``DBOS.set_event(key, value)`` -> ``ctx.publish(key, value)``; ``DBOS.get_event`` (what the
  checkout and payment endpoints wait for) -> ``Client.get_published``;
- ``DBOS.recv("payment_status")`` and ``DBOS.send(payment_id, status, "payment_status")`` ->
  ``ctx.wait_for_event("payment_status")`` and ``Client.send_event``; the payment id is the
  run id, as the workflow id is in the original;
- ``DBOS.start_workflow(dispatch_order_workflow, order_id)`` -> ``ctx.start(dispatch_order,
  order_id)`` (fire-and-forget), ``DBOS.sleep(1)`` -> ``ctx.sleep``;
- ``SetWorkflowID(idempotency_key)`` -> ``Client.start(..., run_id=idempotency_key)``;
- the test's ``MagicMock`` per transaction -> the same mocks, put in place with
  ``Harness.override`` (which keeps each step transactional); the patched ``DBOS.recv``
  returning ``"paid"`` -> the event sent by the test; the patched ``DBOS.start_workflow`` ->
  the run the saga started, read from the store.
"""

from __future__ import annotations

from datetime import timedelta
from enum import IntEnum
from typing import Any
from unittest.mock import MagicMock

import pytest
import sqlalchemy as sa
from sqlalchemy import Column, Connection, Integer, MetaData, String, Table, Text

from sagaloop import App, SagaContext, StepContext
from sagaloop.engine import history as h
from sagaloop.runtime import crashpoints
from sagaloop.runtime.crashpoints import CrashPointRaised
from sagaloop.testing import Harness

app = App("port-widget-store")

WIDGET_ID = 1
PAYMENT_STATUS = "payment_status"
PAYMENT_ID = "payment_id"
ORDER_ID = "order_id"


class OrderStatus(IntEnum):
    CANCELLED = -1
    PENDING = 0
    DISPATCHED = 1
    PAID = 2


metadata = MetaData()

products = Table(
    "products",
    metadata,
    Column("product_id", Integer, primary_key=True, autoincrement=True),
    Column("product", String(255), unique=True, nullable=False),
    Column("description", Text, nullable=False),
    Column("inventory", Integer, nullable=False),
)

orders = Table(
    "orders",
    metadata,
    Column("order_id", Integer, primary_key=True, autoincrement=True),
    Column("order_status", Integer, nullable=False),
    Column("progress_remaining", Integer, nullable=False, server_default="10"),
)


def session(ctx: StepContext) -> Connection:
    """``DBOS.sql_session``: the connection of the step's transaction."""
    assert ctx.transaction is not None, "a transactional step run by a worker"
    return ctx.transaction


@app.step(transactional=True)
def reserve_inventory(ctx: StepContext) -> bool:
    rows_affected = (
        session(ctx)
        .execute(
            products.update()
            .where(products.c.product_id == WIDGET_ID)
            .where(products.c.inventory > 0)
            .values(inventory=products.c.inventory - 1)
        )
        .rowcount
    )
    return rows_affected > 0


@app.step(transactional=True)
def undo_reserve_inventory(ctx: StepContext) -> None:
    session(ctx).execute(
        products.update()
        .where(products.c.product_id == WIDGET_ID)
        .values(inventory=products.c.inventory + 1)
    )


@app.step(transactional=True)
def create_order(ctx: StepContext) -> int:
    result = session(ctx).execute(orders.insert().values(order_status=OrderStatus.PENDING.value))
    return int(result.inserted_primary_key[0])


@app.step(transactional=True)
def update_order_status(ctx: StepContext, order_id: int, status: int) -> None:
    session(ctx).execute(
        orders.update().where(orders.c.order_id == order_id).values(order_status=status)
    )


@app.step(transactional=True)
def update_order_progress(ctx: StepContext, order_id: int) -> None:
    # Update the progress of paid orders.
    progress_remaining = (
        session(ctx)
        .execute(
            orders.update()
            .where(orders.c.order_id == order_id)
            .values(progress_remaining=orders.c.progress_remaining - 1)
            .returning(orders.c.progress_remaining)
        )
        .scalar_one()
    )

    # Dispatch if the order is fully-progressed.
    if progress_remaining == 0:
        session(ctx).execute(
            orders.update()
            .where(orders.c.order_id == order_id)
            .values(order_status=OrderStatus.DISPATCHED.value)
        )


@app.saga(name="dispatch-order")
async def dispatch_order(ctx: SagaContext, order_id: int) -> None:
    for _ in range(10):
        await ctx.sleep(timedelta(seconds=1))
        await ctx.call(update_order_progress, order_id)


@app.saga(name="checkout")
async def checkout(ctx: SagaContext) -> None:
    order_id = await ctx.call(create_order)

    # Reserve inventory, cancelling the order if none remains.
    if not await ctx.call(reserve_inventory):
        ctx.logger.error("failed to reserve inventory for order %s", order_id)
        await ctx.call(update_order_status, order_id=order_id, status=OrderStatus.CANCELLED.value)
        ctx.publish(PAYMENT_ID, None)
        return

    # The checkout endpoint redirects the customer to the payment page of this id.
    ctx.publish(PAYMENT_ID, ctx.run_id)
    payment_status = await ctx.wait_for_event(PAYMENT_STATUS)

    if payment_status == "paid":
        ctx.logger.info("payment successful for order %s", order_id)
        await ctx.call(update_order_status, order_id=order_id, status=OrderStatus.PAID.value)
        ctx.start(dispatch_order, order_id)
    else:
        ctx.logger.warning("payment failed for order %s", order_id)
        await ctx.call(undo_reserve_inventory)
        await ctx.call(update_order_status, order_id=order_id, status=OrderStatus.CANCELLED.value)

    # The payment endpoint redirects the customer to the status page of this order.
    ctx.publish(ORDER_ID, str(order_id))


def test_checkout_workflow() -> None:
    """Use mocks to test that the checkout saga correctly handles a checkout whose payment
    succeeds."""
    order_id = 123

    # A mock for each of the saga's database transactions.
    mock_create_order = MagicMock(return_value=order_id)
    mock_reserve_inventory = MagicMock(return_value=True)
    # (a step's result is validated against its annotation: these return None, not a mock)
    mock_undo_reserve_inventory = MagicMock(return_value=None)
    mock_update_order_status = MagicMock(return_value=None)

    def mocked(mock: MagicMock) -> Any:
        return lambda ctx, **kwargs: mock(**kwargs)

    env = Harness(app)
    env.override(create_order, mocked(mock_create_order))
    env.override(reserve_inventory, mocked(mock_reserve_inventory))
    env.override(undo_reserve_inventory, mocked(mock_undo_reserve_inventory))
    env.override(update_order_status, mocked(mock_update_order_status))

    run_id = env.start(checkout, run_id="idempotency-key-1")
    env.run_until_idle(skip_time=False)
    # The run waits for the payment webhook (the original patches DBOS.recv to answer it).
    assert env.get(run_id).status == "waiting"
    waits = [e.name for e in env.history(run_id) if e.kind == h.EVENT_WAITING]
    assert waits == [PAYMENT_STATUS]
    assert env.client.get_published(run_id, PAYMENT_ID) == run_id
    env.send_event(env.client.get_published(run_id, PAYMENT_ID), PAYMENT_STATUS, "paid")
    env.run_until_idle(skip_time=False)
    assert env.result(run_id) is None
    assert env.client.get_published(run_id, ORDER_ID) == str(order_id)

    # Verify an order was created and inventory was reserved for it
    mock_create_order.assert_called_once_with()
    mock_reserve_inventory.assert_called_once_with()

    # Verify the saga waited for the payment webhook, once
    waits = [e.name for e in env.history(run_id) if e.kind == h.EVENT_WAITING]
    assert waits == [PAYMENT_STATUS]

    # Verify the paid order was marked paid and handed to the dispatch saga
    mock_update_order_status.assert_called_once_with(
        order_id=order_id, status=OrderStatus.PAID.value
    )
    started = [e for e in env.history(run_id) if e.kind == h.RUN_SPAWNED]
    assert len(started) == 1
    dispatches = env.client.list(saga="dispatch-order")
    assert [(r.run_id, r.input) for r in dispatches] == [(started[0].data["run_id"], order_id)]

    # Verify that because payment succeeded, inventory was never returned
    mock_undo_reserve_inventory.assert_not_called()


# --- beyond the original's test: the same sagas against the real tables --------------------


def store(inventory: int = 100) -> Harness:
    """A harness whose database holds the widget store's tables, its one product stocked."""
    env = Harness(app)
    metadata.create_all(env.store.engine)
    with env.store.engine.begin() as conn:
        conn.execute(
            products.insert().values(
                product_id=WIDGET_ID, product="widget", description="a widget", inventory=inventory
            )
        )
    return env


def inventory(env: Harness) -> int:
    with env.store.engine.connect() as conn:
        return int(conn.execute(sa.select(products.c.inventory)).scalar_one())


def order_rows(env: Harness) -> list[tuple[int, int, int]]:
    with env.store.engine.connect() as conn:
        rows = conn.execute(sa.select(orders).order_by(orders.c.order_id))
        return [(int(a), int(b), int(c)) for a, b, c in rows]


def test_a_paid_checkout_is_dispatched_in_the_tables() -> None:
    env = store()
    run_id = env.start(checkout, run_id="idempotency-key-1")
    env.run_until_idle(skip_time=False)
    assert inventory(env) == 99
    assert order_rows(env) == [(1, OrderStatus.PENDING.value, 10)]
    env.send_event(env.client.get_published(run_id, PAYMENT_ID), PAYMENT_STATUS, "paid")
    env.run_until_idle(skip_time=False)
    assert env.client.get_published(run_id, ORDER_ID) == "1"
    assert order_rows(env) == [(1, OrderStatus.PAID.value, 10)]
    env.run_until_idle()  # the dispatch saga's ten seconds
    assert order_rows(env) == [(1, OrderStatus.DISPATCHED.value, 0)]
    assert inventory(env) == 99


def test_a_failed_payment_returns_the_inventory_and_cancels_the_order() -> None:
    env = store()
    run_id = env.start(checkout, run_id="idempotency-key-2")
    env.run_until_idle(skip_time=False)
    env.send_event(run_id, PAYMENT_STATUS, "failed")
    env.run_until_idle()
    assert env.client.get_published(run_id, ORDER_ID) == "1"
    assert order_rows(env) == [(1, OrderStatus.CANCELLED.value, 10)]
    assert inventory(env) == 100
    assert env.client.list(saga="dispatch-order") == []


def test_no_inventory_cancels_the_order() -> None:
    env = store(inventory=0)
    run_id = env.start(checkout, run_id="idempotency-key-3")
    env.run_until_idle()
    assert env.result(run_id) is None
    assert env.client.get_published(run_id, PAYMENT_ID, "unset") is None
    assert order_rows(env) == [(1, OrderStatus.CANCELLED.value, 10)]
    assert inventory(env) == 0


def test_a_crash_before_a_checkpoint_reserves_the_inventory_once() -> None:
    """The original's promise ("each of its steps executes exactly-once"): the worker dies
    after ``reserve_inventory`` ran and before its checkpoint committed (the second step of
    the run); its decrement went with the checkpoint, and the step runs again."""
    env = store()
    run_id = env.start(checkout, run_id="idempotency-key-4")
    crashpoints.arm("worker.before_commit:2:raise")
    try:
        with pytest.raises(CrashPointRaised):
            env.run_until_idle(skip_time=False)
    finally:
        crashpoints.disarm()
    assert inventory(env) == 100
    assert order_rows(env) == [(1, OrderStatus.PENDING.value, 10)]
    env.run_until_idle()  # the message comes back once its lease expired
    env.send_event(run_id, PAYMENT_STATUS, "paid")
    env.run_until_idle()
    assert inventory(env) == 99
    assert order_rows(env) == [(1, OrderStatus.DISPATCHED.value, 0)]
